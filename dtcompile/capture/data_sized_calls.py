"""Calls whose result turns on whether a size read from data is 1, decided before they run.

A size read from data (the rows ``x[mask]`` selects, a ``nonzero``'s count) has no value
while tracing, and torch's ops reason about it "size-obliviously": taken to be 2 or more,
``squeeze`` keeps its dim and ``.item()`` does not ask whether it holds one element, where
eager's drops the dim or raises. Before such a call the question is asked as a branch on
data (computed now from the call's inputs, checked at run time: ``data_branches.py``); a
size found to be 1 is 1 from then on (``core/data_symbols.py``), so the op's own kernel
decides as eager's does, and an entry traced so serves only calls where it is 1.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

_SQUEEZES = {torch.squeeze, torch.Tensor.squeeze, torch.Tensor.squeeze_}
# What eager raises where the tensor does not hold one element: (type, message of a count)
_ONE_ELEMENT = {
    torch.Tensor.item: (RuntimeError, lambda n: f"a Tensor with {n} elements cannot be converted to Scalar"),
    torch.Tensor.__float__: (ValueError, lambda n: "only one element tensors can be converted to Python scalars"),
    torch.Tensor.__int__: (ValueError, lambda n: "only one element tensors can be converted to Python scalars"),
    torch.Tensor.__index__: (
        TypeError,
        lambda n: "only integer tensors of a single element can be converted to an index",
    ),
    torch.Tensor.__bool__: (
        RuntimeError,
        lambda n: f"Boolean value of Tensor with {'no values' if n == 0 else 'more than one value'} is ambiguous",
    ),
}


def _read_from_data(size) -> bool:
    return isinstance(size, torch.SymInt) and bool(free_unbacked_symbols(size))


def sizes_decided(func, args: tuple, kwargs: dict) -> None:
    """Ask, before ``func`` runs, each question on a size read from data that its result
    turns on (see the module docstring); raise eager's error where its answer is one."""
    if not args or not isinstance(args[0], torch.Tensor):
        return
    if func in _SQUEEZES:
        x = args[0]
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = range(x.dim()) if dims is None else (dims,) if isinstance(dims, int) else dims
        for dim in dims:
            if _read_from_data(size := x.shape[dim]):
                bool(size == 1)  # (a branch on data: where True, the size is 1 from then on)
    elif func in _ONE_ELEMENT and _read_from_data(count := args[0].numel()):
        if not bool(count == 1):
            error, message = _ONE_ELEMENT[func]
            raise error(message(int(count)))
