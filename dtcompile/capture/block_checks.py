"""What a block's first call must not have done for its recording to be replayed, and the
Python state a replay must find unchanged (``blocks.py``)."""

from __future__ import annotations

import types

import torch
from torch.utils._pytree import tree_flatten

from .equivalence import TENSOR_TABLES


def recording_counts(recording) -> tuple:
    return (
        len(recording.captured),
        len(recording.read_by),
        len(recording.cones),
        recording.c10d_calls,
    )


def python_state(module: torch.nn.Module) -> list:
    """The containers a block's code reads Python values from: its modules' tables and
    attributes, the plain objects these hold (a config) and those they hold, levels down
    (``self.config.attention.rope.theta``), its classes' dicts and their functions'
    globals, and the small lists and dicts any of these hold (a global table). A first
    call that changes one is not replayed (a later block would have read the new value),
    nor is a later call after the code changed one."""
    found: dict[int, object] = {}
    for sub in module.modules():
        for table in (*(getattr(sub, name) for name in TENSOR_TABLES), vars(sub)):
            found[id(table)] = table
        _plain_objects(vars(sub), found, _OBJECT_LEVELS)
        for klass in type(sub).__mro__:
            if klass is torch.nn.Module:
                break
            found[id(klass)] = klass.__dict__
            for value in vars(klass).values():
                if isinstance(value, types.FunctionType):
                    found[id(value.__globals__)] = value.__globals__
    for container in list(found.values()):
        for value in container.values():
            if type(value) in (dict, list) and len(value) <= _SMALL and id(value) not in found:
                found[id(value)] = value
    return list(found.values())


_SMALL = 64  # the largest list or dict held in those whose items are compared too
_OBJECT_LEVELS = 4  # plain objects followed down from a module's attributes (the prologue guards 3)


def _plain_objects(attributes: dict, found: dict[int, object], levels: int) -> None:
    """Add the attribute dicts of the plain objects in ``attributes``, ``levels`` down."""
    for value in attributes.values():
        if (
            levels
            and not isinstance(value, (torch.nn.Module, torch.Tensor, type, types.ModuleType))
            and isinstance(getattr(value, "__dict__", None), dict)
        ):
            if id(vars(value)) not in found:
                found[id(vars(value))] = vars(value)
                _plain_objects(vars(value), found, levels - 1)


def contents(container) -> tuple:
    """What a container holds, compared by identity (keys by value)."""
    if type(container) is list:
        return tuple(map(id, container))
    return tuple((k, id(v)) for k, v in container.items())


def arguments_changed(args: tuple, kwargs: dict, flat_before: list, treespec) -> bool:
    """Whether the call changed the containers it received (a list it wrote into)."""
    flat, spec = tree_flatten((args, kwargs))
    return spec != treespec or any(a is not b for a, b in zip(flat, flat_before))


# What a traced tensor the recorder made holds in its ``__dict__``: an output holding more
# (an attribute the code set) cannot be rebuilt by a replay.
TRACED_ATTRIBUTES = frozenset({"fake", "label", "provenance", "value"})


def unreplayable(symbols: list) -> str | None:
    for bsym in symbols:
        if bsym.op is None:
            return f"it records {bsym.symbol.name}, which is not an aten op"
        if torch.Tag.nondeterministic_seeded in bsym.op.tags and not _without_dropout(bsym):
            return f"it draws random numbers ({bsym.op})"
    return None


def _without_dropout(bsym) -> bool:
    """Whether a seeded op draws nothing: attention with ``dropout_p`` 0. Other random ops
    are not replayed: DTensor's random ops on shards take their offsets from Python state
    at trace time, which a replay would not advance."""
    for index, argument in enumerate(bsym.op._schema.arguments):
        if argument.name == "dropout_p":
            if argument.kwarg_only or index >= len(bsym.args):
                value = bsym.kwargs.get("dropout_p", argument.default_value)
            else:
                value = bsym.args[index]
            return type(value) in (int, float) and value == 0
    return False
