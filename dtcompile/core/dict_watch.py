"""Being told when a dict changes, so that a prologue's checks that read only dicts (a
module tree's tables, hook tables, instance dicts, globals) need not read them at all while
none has changed: Python 3.12's dict watchers (``PyDict_AddWatcher``), reached through
ctypes. Every change of a watched dict (an item set, replaced or deleted, an attribute set
through the instance, ``clear``, ``update``) bumps :data:`changes`, so a prologue compares
one counter instead of reading a version per dict, whatever the depth of the model.

Where dict watchers are missing (Python 3.11) or do not see every such change
(:func:`_watchers_follow_changes`), :data:`available` is False and prologues read the
dicts' versions instead.

Safety: the callback is Python code, run by CPython inside the dict's change. A watched
dict is held here until nothing watches it (never freed while watched: a dict freed while
an exception unwinds would otherwise run the callback with the exception set), and the
watcher is cleared at exit, before the interpreter clears modules' dicts.
"""

from __future__ import annotations

import atexit
import ctypes
import sys
import weakref

changes = [0]  # bumped at each change of a watched dict; a prologue reads ``changes[0]``

_watched: dict[int, list] = {}  # id -> [the dict, how many owners watch it]
_watcher: int | None = None


def _on_change(event: int, d: int, key: int, value: int) -> int:
    changes[0] += 1
    return 0


_CALLBACK_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_callback = _CALLBACK_TYPE(_on_change)  # kept alive for the process: CPython calls it


def _api(name: str, argtypes: list, restype=ctypes.c_int):
    fn = getattr(ctypes.pythonapi, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _start() -> bool:
    global _watcher, _watch, _unwatch
    if sys.version_info < (3, 12) or not hasattr(ctypes.pythonapi, "PyDict_AddWatcher"):
        return False
    add = _api("PyDict_AddWatcher", [_CALLBACK_TYPE])
    _watch = _api("PyDict_Watch", [ctypes.c_int, ctypes.py_object])
    _unwatch = _api("PyDict_Unwatch", [ctypes.c_int, ctypes.py_object])
    try:
        _watcher = add(_callback)
    except (OSError, ValueError):  # no free watcher slot (an interpreter has 8)
        return False
    atexit.register(_stop)
    return True


def _stop() -> None:
    """At exit: no more callbacks, before the interpreter clears modules' dicts."""
    global _watcher
    if _watcher is not None:
        _api("PyDict_ClearWatcher", [ctypes.c_int])(_watcher)
        _watcher = None


def watch(dicts: list[dict], owner: object) -> None:
    """Watch ``dicts`` for as long as ``owner`` lives (a prologue's token)."""
    ids = []
    for d in {id(d): d for d in dicts}.values():
        held = _watched.get(id(d))
        if held is None:
            _watch(_watcher, d)
            held = _watched[id(d)] = [d, 0]
        held[1] += 1
        ids.append(id(d))
    weakref.finalize(owner, _release, ids)


def _release(ids: list[int]) -> None:
    for key in ids:
        held = _watched[key]
        held[1] -= 1
        if held[1] == 0:
            del _watched[key]
            if _watcher is not None:
                _unwatch(_watcher, held[0])


def _watchers_follow_changes() -> bool:
    """Whether every change prologues rely on is told, on this Python: an attribute set or
    deleted through an instance whose ``__dict__`` was read (a module's, a tensor's), an item set,
    replaced or deleted in a dict and in an OrderedDict (a module's hook tables), ``update``
    and ``clear``. Where one is not, dict watchers are not used at all."""
    import collections

    class Probe:
        pass

    class Token:
        pass

    import torch

    probe, tensor = Probe(), torch.nn.Parameter(torch.zeros(1))
    probe.a = 1
    state, table, token = probe.__dict__, collections.OrderedDict(a=1), Token()
    watch([state, table, vars(tensor)], token)
    try:
        for change in (
            lambda: setattr(probe, "a", 2),
            lambda: setattr(probe, "b", 1),
            lambda: delattr(probe, "b"),
            lambda: object.__setattr__(probe, "a", 3),
            lambda: table.__setitem__("b", 1),
            lambda: table.__setitem__("b", 2),
            lambda: table.pop("b"),
            lambda: state.update(a=4),
            lambda: table.clear(),
            lambda: setattr(tensor, "tag", 1),  # a tensor's Python attributes
        ):
            before = changes[0]
            change()
            if changes[0] == before:
                return False
        return True
    finally:
        del token


available = _start() and _watchers_follow_changes()
