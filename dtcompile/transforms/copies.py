"""Removal of copies that change nothing.

Models multiply by a scaling of 1.0 (Llama's rotary ``attention_scaling``), cast to the
dtype a tensor already has, or clone. Each makes a new
buffer equal to its input, element for element and stride for stride; the program can
read the input instead, as long as nobody writes to either and the copy is not returned
(the caller would get the input, or one tensor twice, where eager gives a new tensor).
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten

from ..core import TensorProxy, Trace, renamed
from ..core.symbolic import known_equal, known_shape_equal
from .effects import mutates, storage_bases

aten = torch.ops.aten


def _is_float(value, target: float) -> bool:
    """``value`` is the float ``target``. Only floats: integer arguments may differ between
    ranks (DTensor adds each rank's shard offset to an ``argmax``, 0 on rank 0), and a copy
    removed on some ranks only would make the ranks' programs differ (consistency.py)."""
    return type(value) is float and not math.isnan(value) and value == target


def _copies_input(bsym) -> bool:
    """Whether the op's result equals its first argument, element for element (and in
    dtype, shape and strides, checked by the caller)."""
    op, args, kwargs = bsym.op, bsym.args, bsym.kwargs
    if op in (aten.mul.Tensor, aten.div.Tensor):
        return len(args) == 2 and _is_float(args[1], 1.0) and not kwargs
    if op is aten.sub.Tensor:  # not add: x + 0.0 turns -0.0 into 0.0
        return len(args) == 2 and _is_float(args[1], 0.0) and kwargs.get("alpha", 1) == 1
    if op is aten.clone.default:
        return kwargs.get("memory_format", torch.preserve_format) in (torch.preserve_format, None)
    if op is aten._to_copy.default:
        allowed = {"dtype", "layout", "device", "memory_format", "non_blocking"}
        return set(kwargs) <= allowed and len(args) == 1
    return False


def _same_tensor_metadata(a: TensorProxy, b: TensorProxy) -> bool:
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and known_shape_equal(a.shape, b.shape)
        and known_shape_equal(a.stride(), b.stride())
        and known_equal(a.storage_offset(), 0)
        and a.is_conj() == b.is_conj()  # (``resolve_conj`` is a clone that clears the bit)
        and a.is_neg() == b.is_neg()
    )


def remove_redundant_copies(trace: Trace) -> Trace:
    """Replace each copy that changes nothing by its input (see the module docstring)."""
    base = storage_bases(trace, inputs_may_alias=True)
    written = {base.get(p.label) for bsym in trace.bound_symbols if mutates(bsym) for p in bsym.input_tensors()}
    leaves, _ = tree_flatten(trace.output)
    returned = {base.get(x.label) for x in leaves if isinstance(x, TensorProxy)}  # storages the caller gets
    renames: dict[str, TensorProxy] = {}
    kept = []
    for bsym in trace.bound_symbols:
        bsym = bsym.with_inputs_renamed(renames) if renames else bsym
        source, result = (bsym.args[0] if bsym.args else None), bsym.output
        if (
            isinstance(source, TensorProxy)
            and isinstance(result, TensorProxy)
            and _copies_input(bsym)
            and _same_tensor_metadata(source, result)
            and base.get(source.label) not in written
            and base.get(result.label) not in written
            and base.get(result.label) not in returned
        ):
            renames[result.label] = source
            continue
        kept.append(bsym)
    return trace.derive(f"{trace.fn_name}, after removing redundant copies", kept, renamed(trace.output, renames))
