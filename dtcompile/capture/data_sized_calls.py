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
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols

from ..core.symbol import leaves

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


# Calls that broadcast their tensors' sizes against each other (or against sizes given).
_BROADCASTING = {
    *(getattr(torch, n) for n in ("add", "sub", "mul", "div", "true_divide", "pow", "maximum", "minimum", "where")),
    *(getattr(torch, n) for n in ("lerp", "atan2", "remainder", "fmod", "eq", "ne", "lt", "le", "gt", "ge")),
    *(getattr(torch, n) for n in ("logical_and", "logical_or", "logical_xor", "broadcast_tensors", "broadcast_to")),
    *(getattr(torch.Tensor, n) for n in ("add", "sub", "mul", "div", "pow", "add_", "sub_", "mul_", "div_", "copy_")),
    *(getattr(torch.Tensor, n) for n in ("expand", "expand_as", "broadcast_to", "masked_fill", "lerp", "where")),
    *(getattr(torch.Tensor, f"__{n}__") for n in ("add", "radd", "iadd", "sub", "rsub", "isub", "mul", "rmul")),
    *(getattr(torch.Tensor, f"__{n}__") for n in ("imul", "truediv", "rtruediv", "itruediv", "pow", "rpow")),
    *(getattr(torch.Tensor, f"__{n}__") for n in ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor", "mod")),
    *(getattr(torch.Tensor, f"__{n}__") for n in ("floordiv", "rfloordiv")),
    # (C++ composites that broadcast before any op below them: ``cosine_similarity``)
    *(getattr(torch, n) for n in ("cosine_similarity", "pairwise_distance", "dist", "addcmul", "addcdiv", "hypot")),
    *(getattr(torch, n) for n in ("clamp", "clip", "fmax", "fmin", "xlogy", "copysign", "float_power", "masked_fill")),
}
_BROADCASTING |= {
    torch.broadcast_shapes,
    torch.polar,
    torch.cross,
    torch.linalg.cross,
    torch.take_along_dim,
    torch.Tensor.take_along_dim,
}
aten = torch.ops.aten
# The torch ops (below the calls above: a DTensor's local ops, composite ops' parts) that
# broadcast, beside those tagged pointwise (``addcmul``, ``clamp(min=t)``).
_ATEN_BROADCASTS = {aten.expand.default, aten.copy_.default, aten.copy.default}
_ATEN_BROADCASTS |= {aten.binary_cross_entropy_with_logits.default}
_EXPANDS = (torch.Tensor.expand, torch.Tensor.broadcast_to, torch.broadcast_to, aten.expand.default)
# Calls that broadcast only their batch dims (all but a matrix's last two).
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.cdist}
_MATMULS |= {torch.linalg.solve, torch.cholesky_solve, torch.linalg.solve_triangular, torch.linalg.lu_solve}
# Calls whose first tensor broadcasts against the shape the others make (``addmm``'s bias
# against the product: ``F.linear``'s), by the other tensors; the others do not broadcast.
_PRODUCTS = {
    "addmm": lambda a, b: (a.shape[0], b.shape[1]),
    "addmv": lambda a, v: (a.shape[0],),
    "addr": lambda u, v: (u.shape[0], v.shape[0]),
    "baddbmm": lambda a, b: (a.shape[0], a.shape[1], b.shape[2]),
    "addbmm": lambda a, b: (a.shape[1], b.shape[2]),
}
_SELF_AGAINST = {
    f: shape
    for name, shape in _PRODUCTS.items()
    for f in (getattr(torch, name), getattr(torch.Tensor, name), getattr(aten, name).default)
}


def _broadcast_questions(func, args: tuple, kwargs: dict) -> list:
    """The sizes read from data that broadcasting in ``func`` may stretch: each aligned
    (from the last dim) with a size that is neither 1 nor the same number."""
    shapes = [tuple(x.shape) for x in leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if func is torch.broadcast_shapes:
        shapes = [(shape,) if isinstance(shape, int | torch.SymInt) else tuple(shape) for shape in args]
    elif func in _SELF_AGAINST:
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        shapes = tensors[:1] and [tuple(tensors[0].shape), _SELF_AGAINST[func](*tensors[1:3])]
    elif func in _MATMULS:
        shapes = [shape[:-2] for shape in shapes]
    elif func is torch.Tensor.__setitem__:  # (the value against what it is written to: not traced for the question)
        value = args[2] if len(args) > 2 else None
        kept = {_expr(size) for size in args[0].shape}
        shape = value.shape if isinstance(value, torch.Tensor) else ()
        return [size for size in shape if _read_from_data(size) and _expr(size) not in kept]
    if func in _EXPANDS and len(args) > 1:
        sizes = args[1:] if isinstance(args[1], int | torch.SymInt) else args[1]
        shapes.append(tuple(s for s in sizes))
    asked = []
    for shape in shapes:
        for back, size in enumerate(reversed(shape)):
            if not _read_from_data(size) or any(size is q for q in asked):
                continue
            others = [other[-1 - back] for other in shapes if other is not shape and back < len(other)]
            if any(_other_than(size, other) for other in others):
                asked.append(size)
    return asked


def _other_than(size, other) -> bool:
    expression = _expr(other)
    return expression != size.node.expr and expression not in (1, -1)


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _asked(question) -> bool | None:
    """The answer to a question on sizes read from data, as a branch on data checked at run
    time; None where tracing cannot compute it now (a write before it: data_branches.py):
    a one-element read (a library's ``.item()`` after a write) or a broadcast (an MoE's
    tokens, back from an all_to_all, times their weights) then goes as torch's does (README,
    "Not yet"). A squeeze is refused there (it would keep a dim eager's drops)."""
    try:
        return bool(question)
    except GuardOnDataDependentSymNode:
        return None


def _read_from_data(size) -> bool:
    return isinstance(size, torch.SymInt) and bool(free_unbacked_symbols(size))


def sizes_decided(func, args: tuple, kwargs: dict, read_from_data: bool) -> None:
    """Ask, before ``func`` runs, each question on a size read from data that its result
    turns on (see the module docstring); raise eager's error where its answer is one.
    Nothing to ask while no tensor of the call has a size read from data (``read_from_data``:
    most calls of most programs)."""
    if not read_from_data or not args or not (isinstance(args[0], torch.Tensor) or func is torch.broadcast_shapes):
        return
    if func in _BROADCASTING or func in _MATMULS or func in _SELF_AGAINST or func is torch.Tensor.__setitem__:
        for size in _broadcast_questions(func, args, kwargs):
            _asked(size == 1)  # (where True: 1 from then on, and broadcast as eager's)
    elif func in _SQUEEZES:
        x = args[0]
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = range(x.dim()) if dims is None else (dims,) if isinstance(dims, int) else dims
        for dim in dims:
            if _read_from_data(size := x.shape[dim]):
                bool(size == 1)  # (a branch on data: where True, the size is 1 from then on)
    elif func in _ONE_ELEMENT and _read_from_data(count := args[0].numel()):
        if _asked(count == 1) is False:
            error, message = _ONE_ELEMENT[func]
            raise error(message(int(count)))


def broadcasts_decided(func, args: tuple, kwargs: dict, read_from_data: bool) -> None:
    """Ask, before the torch op ``func`` runs on fake tensors, whether each size read from
    data that it may broadcast is 1 (as ``sizes_decided`` asks before a call): where torch's
    meta takes it to be 2 or more, it would assume it equals the size it meets."""
    broadcasts = func in _ATEN_BROADCASTS or func in _SELF_AGAINST or torch.Tag.pointwise in getattr(func, "tags", ())
    if read_from_data and broadcasts:
        for size in _broadcast_questions(func, args, kwargs):
            _asked(size == 1)


def _equal(input, other) -> bool:  # (torch's names: ``torch.equal(input=a, other=b)``)
    """``torch.equal``: the same shape and every element equal (dtypes promoted, as eager's);
    of two DTensors, on every rank (DTensor's all-reduces each rank's answer)."""
    if isinstance(input, DTensor) != isinstance(other, DTensor):
        return torch.equal(input, other)  # (DTensor's error, as eager's)
    if input.shape != other.shape:
        return False
    same = (input == other).all()
    return bool(same.full_tensor() if isinstance(same, DTensor) else same)


def _allclose(input, other, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> bool:
    if isinstance(input, DTensor) or isinstance(other, DTensor):  # (DTensor has no rule for it: its error)
        return torch.allclose(input, other, rtol, atol, equal_nan)
    return bool(torch.isclose(input, other, rtol=rtol, atol=atol, equal_nan=equal_nan).all())


# Calls whose Python result eager computes from the tensors' data: as ops whose result is
# read as a number, a branch on data checked at run time (torch's fake tensors refuse them).
READ_AS_NUMBERS = {torch.equal: _equal, torch.Tensor.equal: _equal, torch.allclose: _allclose}
READ_AS_NUMBERS[torch.Tensor.allclose] = _allclose
