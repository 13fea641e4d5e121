"""Tensors made from Python data holding numbers the trace computes: sizes under symbolic
values (``torch.tensor([x.shape[0]])``), numbers read from tensor data
(``torch.tensor([t.item() * 2])``), comparisons of them. torch's own factories take such
a number as its value now, truncated to 32 bits (``n * 10**9`` wraps), and make the
program hold that constant, one entry per value. Here each number becomes a 0-d tensor of
the trace (``torch.full``), computed at run time, and they are stacked into the shape of
the data, with the dtype torch's factory would infer."""

from __future__ import annotations

import functools

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols
from torch.utils._pytree import tree_map

from ..core.symbolic import is_symbolic

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_PLAIN = (int, float, bool)
FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


def holds_traced_numbers(func, args: tuple, kwargs: dict) -> bool:
    """Whether the data holds such a number (one whose value is known: torch's factory takes
    it), beside Python numbers only (NumPy scalars, complex numbers and a bool read from data:
    torch's factory, which infers their dtypes)."""
    try:
        leaves = _leaves(_data(func, args, kwargs))[0]
    except ValueError:  # ragged: torch's own error
        return False
    if not all(type(leaf) in _PLAIN or (isinstance(leaf, _SYMBOLIC) and _backed(leaf)) for leaf in leaves):
        return False
    return any(map(is_symbolic, leaves))


def _backed(leaf) -> bool:
    return not isinstance(leaf, torch.SymBool) or not free_unbacked_symbols(leaf)


def tensor_of_numbers(func):
    """``func`` (one of ``FACTORIES``) making its tensor as the module docstring says."""

    @functools.wraps(func)
    def make(*args, **kwargs):
        data = _data(func, args, kwargs)
        leaves, shape = _leaves(data)
        like = args[0] if func is torch.Tensor.new_tensor else None
        dtype = kwargs.get("dtype") or (like.dtype if like is not None else _inferred(leaves))
        device = kwargs.get("device") or (like.device if like is not None else None)
        scalars = [_scalar(leaf, dtype, device) for leaf in leaves]
        made = torch.stack(scalars).reshape(shape) if scalars else torch.empty(shape, dtype=dtype, device=device)
        return made.requires_grad_() if kwargs.get("requires_grad") else made

    return make


def _data(func, args: tuple, kwargs: dict):
    if func is torch.Tensor.new_tensor:
        return args[1] if len(args) > 1 else kwargs.get("data")
    return args[0] if args else kwargs.get("data", kwargs.get("obj"))


def _leaves(data) -> tuple[list, tuple]:
    """The numbers of nested lists and tuples, in order, and their shape."""
    if not isinstance(data, (list, tuple)):
        return [data], ()
    parts = [_leaves(item) for item in data]
    shapes = {shape for _, shape in parts}
    if len(shapes) > 1:  # ragged: torch's own error
        raise ValueError(f"expected sequence of length {len(parts[0][0])} at dim 1 (got {len(parts[-1][0])})")
    inner = shapes.pop() if shapes else ()
    return [leaf for leaves, _ in parts for leaf in leaves], (len(data), *inner)


def _inferred(leaves: list) -> torch.dtype:
    """The dtype torch's factory infers: bool of bools, int64 of ints, else the default."""
    if all(isinstance(leaf, (bool, torch.SymBool)) for leaf in leaves):
        return torch.bool
    if all(isinstance(leaf, (bool, int, torch.SymBool, torch.SymInt)) for leaf in leaves):
        return torch.int64
    return torch.get_default_dtype()


def _scalar(leaf, dtype: torch.dtype, device) -> torch.Tensor:
    """A 0-d tensor of ``leaf``, made in 64 bits and cast to ``dtype`` as torch's factory
    casts (``1e300`` as float32: inf)."""
    _refuse_overflow(leaf, dtype)
    wide = torch.float64 if isinstance(leaf, (float, torch.SymFloat)) else torch.int64
    return torch.full((), _number(leaf), dtype=wide, device=device).to(dtype)


# Integer dtypes torch's factory checks a number against (``torch.tensor([300], dtype=torch.int8)``
# raises); a cast would wrap it.
_CHECKED_INTS = (torch.int8, torch.int16, torch.int32, torch.uint8)


def _refuse_overflow(leaf, dtype: torch.dtype) -> None:
    """Eager's error where a number the trace computes does not fit ``dtype``: a question on
    its value, so a size is guarded, a number read from data checked at run time (where
    tracing cannot know that value, the cast is left as it is)."""
    if dtype not in _CHECKED_INTS or not is_symbolic(leaf) or isinstance(leaf, torch.SymBool):
        return
    info = torch.iinfo(dtype)
    # (uint8 takes a negative int down to -255, wrapped: eager's two's complement rule)
    low = -info.max if dtype is torch.uint8 and isinstance(leaf, torch.SymInt) else info.min
    try:
        fits = low <= leaf <= info.max
    except GuardOnDataDependentSymNode:
        return
    if not fits:
        raise RuntimeError(f"value cannot be converted to type {str(dtype).removeprefix('torch.')} without overflow")


def _number(leaf):
    if not is_symbolic(leaf):  # a constant (a Python number, a symbol's specialized value: -0.0 kept)
        return {torch.SymBool: bool, torch.SymInt: int, torch.SymFloat: float}.get(type(leaf), type(leaf))(leaf)
    return torch.sym_ite(leaf, 1, 0) if isinstance(leaf, torch.SymBool) else leaf


def bools_as_bools(func, args: tuple, kwargs: dict, leaves: list) -> tuple[tuple, dict]:
    """A SymBool among a torch-level call's arguments (a comparison of sizes under symbolic
    values, ``sum(keepdim=n > 4)``, ``is_causal=n > 1``; a tensor indexed by one): Python's
    bool, as eager's code has, which torch's ops take where they refuse a SymBool (and an
    index as a mask, a new dim of 1 or 0, where a SymBool is the int 1 or 0). ``bool()`` of
    it is a guard on the sizes, or a branch on data, traced and checked. Not where torch
    takes the SymBool itself (``torch._check``, ``sym_not``) or a factory computes it.
    ``leaves``: those of ``(args, kwargs)``, which the caller has."""
    if func in FACTORIES or getattr(func, "__name__", "").startswith(("sym_", "_check")):
        return args, kwargs
    if not any(isinstance(leaf, torch.SymBool) for leaf in leaves):
        return args, kwargs
    return tree_map(lambda v: bool(v) if isinstance(v, torch.SymBool) else v, (args, kwargs))
