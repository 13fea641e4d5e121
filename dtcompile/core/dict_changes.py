"""The changes to dicts a prologue relies on being told of, by a dict's version (Python
3.11) or a dict watcher (3.12+): each mechanism is used only where it sees every one."""

from __future__ import annotations

import collections


def dict_changes() -> tuple[list[dict], list]:
    """``(dicts, changes)``: dicts of each kind prologues read (an instance's ``__dict__``
    already made, as a module's is; an OrderedDict, as a module's hook tables; an empty
    dict; a tensor's Python attributes), and each change to them a prologue must see: an
    attribute set or deleted through the instance (also with ``object.__setattr__``), an
    item set, replaced or deleted, ``update`` (of an empty dict too: Python 3.12 copies the
    other's keys then, and keeps the version) and ``clear``."""
    import torch

    class Probe:
        pass

    probe, tensor = Probe(), torch.nn.Parameter(torch.zeros(1))
    probe.a = 1
    state, table, empty = probe.__dict__, collections.OrderedDict(a=1), {}
    changes = [
        lambda: setattr(probe, "a", 2),
        lambda: setattr(probe, "b", 1),
        lambda: delattr(probe, "b"),
        lambda: object.__setattr__(probe, "a", 3),
        lambda: table.__setitem__("b", 1),
        lambda: table.__setitem__("b", 2),
        lambda: table.pop("b"),
        lambda: state.update(a=4),
        lambda: table.clear(),
        lambda: empty.update({"a": 1}),
        lambda: setattr(tensor, "tag", 1),
    ]
    return [state, table, empty, vars(tensor)], changes
