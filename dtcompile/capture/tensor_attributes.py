"""Python attributes of an input tensor (``w.tag = "expert"``, nn.Buffer's ``persistent``,
a DTensor parameter's ``_is_param``), carried onto what the traced code gets, so that it
reads what eager would (``isinstance(w, nn.Parameter)``, ``getattr(b, "persistent")``).

The values are baked into the program: those a user sets are guarded (by value for
scalars, else by identity, and no name added or removed, ``attributes_match``), the
other tensors by how many attributes they hold (``batched_guards.attribute_checks``); the
values of torch's own marks (:data:`TORCH_MARKS`) are not compared.
"""

from __future__ import annotations

import torch

from ..core import TracingError
from ..core.proxy import PROXY_ATTRIBUTES, TensorProxy
from .python_reads import by_value, contents_guarded, value_key

# Set once, by torch, when a Parameter or Buffer is made.
TORCH_MARKS = frozenset({"_is_param", "_is_buffer", "persistent"})
# What a traced tensor holds in its ``__dict__`` (a proxy's own; a DTensor holds none), and
# the names its class adds to a tensor's (``meta``, ``memory``): an attribute of the call's
# tensor under one of these names would not be the one the traced code reads.
# (torch caches the sizes and strides C++ reads of a subclass under the ``_capsule`` names)
_TORCH_CACHES = {
    f"_{sym}{what}_capsule{n}" for sym in ("", "sym_") for what in ("sizes", "strides") for n in ("", "_len")
}
TRACED_ATTRIBUTES = PROXY_ATTRIBUTES | (set(vars(TensorProxy)) - set(dir(torch.Tensor))) | _TORCH_CACHES


def carry_attributes(real: torch.Tensor, traced: torch.Tensor, path) -> dict:
    """Set ``real``'s attributes (it is the call's ``path``) on ``traced`` (a plain
    Parameter's class too, as the ``_is_param`` mark); returns those guarded."""
    clash = sorted(TRACED_ATTRIBUTES & vars(real).keys())
    if clash:
        raise TracingError(
            f"dtcompile.jit: {path} holds the Python attribute {clash[0]!r}, a name dtcompile's traced "
            "tensors use for themselves; the traced code would read theirs. Rename the attribute"
        )
    if type(real) is torch.nn.Parameter:
        traced._is_param = True
    attributes = dict(vars(real))
    for name, value in attributes.items():
        setattr(traced, name, value)
    return {name: value for name, value in attributes.items() if name not in TORCH_MARKS}


def user_attributes(traced: torch.Tensor) -> dict:
    """The attributes of a traced tensor a user set (carried, or set while tracing)."""
    return {k: v for k, v in vars(traced).items() if k not in TRACED_ATTRIBUTES and k not in TORCH_MARKS}


def attributes_key(traced: torch.Tensor) -> tuple:
    """What two blocks' tensors must share: their user attributes, by value or identity."""
    return tuple((k, value_key(v) if by_value(v) else id(v)) for k, v in user_attributes(traced).items())


def attributes_match(tensor: torch.Tensor, expected: dict, contents: dict | None = None) -> bool:
    """Whether a call's tensor holds the attributes traced (the prologue's check); those
    in ``contents`` (a dict or list: ``p.d["k"] = 3`` in place) with those contents too."""
    found = {k: v for k, v in vars(tensor).items() if k not in TORCH_MARKS}
    return (
        found.keys() == expected.keys()
        and all(
            (by_value(v) and type(v) is type(w) and value_key(v) == value_key(w)) or v is w
            for v, w in zip(found.values(), (expected[k] for k in found))
        )
        and all(value_key(found[k]) == key for k, key in (contents or {}).items())
    )


def contents_keys(attributes: dict) -> dict:
    """The contents of the attributes that can change in place, to check at each call."""
    return {k: value_key(v) for k, v in attributes.items() if contents_guarded(v)}


_ABSENT = object()


def attribute_writes_refused(traced_inputs: list[tuple[torch.Tensor, dict]], outputs: list) -> None:
    """Refuse a Python attribute the traced code set on a tensor of the call (``x.tag =
    "seen"``) or on a tensor it returns (``y.note = 5``): the traced tensor got it, and a
    compiled call's tensors would not. ``traced_inputs``: each input's traced tensor and
    the attributes it was given."""
    given = set()
    for traced, carried in traced_inputs:
        given.add(id(traced))
        now = user_attributes(traced)
        changed = sorted(k for k in now.keys() | carried.keys() if now.get(k, _ABSENT) is not carried.get(k, _ABSENT))
        if changed:
            raise TracingError(
                f"dtcompile.jit: the traced code sets or deletes the attribute {changed[0]!r} of a tensor of the call; "
                "a compiled call would not. Set it outside the call"
            )
    for value in outputs:
        if isinstance(value, torch.Tensor) and id(value) not in given and user_attributes(value):
            raise TracingError(
                f"dtcompile.jit: the traced code sets the attribute {next(iter(user_attributes(value)))!r} of a "
                "tensor it returns; a compiled call's outputs would not have it. Set it after the call"
            )
