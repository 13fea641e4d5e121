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

from ..core.symbolic import is_symbolic

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


def holds_traced_numbers(func, args: tuple, kwargs: dict) -> bool:
    data = _data(func, args, kwargs)
    return any(map(is_symbolic, _leaves(data)[0]))  # (one whose value is known: torch's factory takes it)


def tensor_of_numbers(func):
    """``func`` (one of ``FACTORIES``) making its tensor as the module docstring says."""

    @functools.wraps(func)
    def make(*args, **kwargs):
        data = _data(func, args, kwargs)
        leaves, shape = _leaves(data)
        like = args[0] if func is torch.Tensor.new_tensor else None
        dtype = kwargs.get("dtype") or (like.dtype if like is not None else _inferred(leaves))
        device = kwargs.get("device") or (like.device if like is not None else None)
        scalars = [torch.full((), _number(leaf), dtype=dtype, device=device) for leaf in leaves]
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


def _number(leaf):
    if not is_symbolic(leaf):  # a constant (a Python number, a symbol's specialized value: -0.0 kept)
        return {torch.SymBool: bool, torch.SymInt: int, torch.SymFloat: float}.get(type(leaf), type(leaf))(leaf)
    return torch.sym_ite(leaf, 1, 0) if isinstance(leaf, torch.SymBool) else leaf
