"""Translations of reductions and of the ops built on them: sums, means, max/min, var,
softmax and log-softmax (and their backwards), layer norm."""

from __future__ import annotations

import torch

from ...core import BoundSymbol
from ...core.symbolic import as_constant
from .program import Ref
from .program_builder import (
    Translator,
    argument,
    compute_dtype,
    handles,
    normalized_dims,
)

aten = torch.ops.aten


# --- reductions -----------------------------------------------------------------------------


def _plain_reduction(bsym: BoundSymbol) -> bool:
    return set(bsym.kwargs) <= {"dtype", "keepdim"}


@handles(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, check=_plain_reduction)
def _sum_mean(t: Translator, bsym: BoundSymbol):
    out = bsym.output
    x = t.value(bsym.args[0])
    default = bsym.op in (aten.sum.default, aten.mean.default)
    dims = normalized_dims(None if default else bsym.args[1], t.rank(x))
    keepdim = False if default else bool(argument(bsym, "keepdim", 2, False))
    dtype = compute_dtype(out.dtype)
    total = t.reduce("sum", t.cast(x, dtype), dims, keepdim)
    if bsym.op in (aten.mean.dim, aten.mean.default):
        total = t.op("div", total, t.numel(x, dims), dtype=dtype)
    return total


def _reduces_elements(bsym: BoundSymbol) -> bool:
    """A max or min over dims none of which is known empty (torch raises there; a fusion
    gives the reduction's identity)."""
    x = bsym.args[0]
    dims = normalized_dims(argument(bsym, "dim", 1, []), x.dim())
    return not any(as_constant(x.shape[d]) == 0 for d in dims)


@handles(aten.amax.default, aten.amin.default, check=_reduces_elements)
def _amax_amin(t: Translator, bsym: BoundSymbol):
    x = t.value(bsym.args[0])
    dims = normalized_dims(argument(bsym, "dim", 1, []), t.rank(x))
    primitive = "max" if bsym.op is aten.amax.default else "min"
    return t.reduce(primitive, x, dims, bool(argument(bsym, "keepdim", 2, False)))


@handles(aten.var.correction, check=lambda b: set(b.kwargs) <= {"correction", "keepdim"})
def _var(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(t.value(bsym.args[0]), dtype)
    dims = normalized_dims(argument(bsym, "dim", 1, None), t.rank(x))
    correction = as_constant(bsym.kwargs.get("correction", 1))
    correction = 1 if correction is None else correction
    count = t.numel(x, dims)
    mean = t.op("div", t.reduce("sum", x, dims, True), count, dtype=dtype)
    centered = t.op("sub", x, mean, dtype=dtype)
    squares = t.reduce(
        "sum", t.op("mul", centered, centered, dtype=dtype), dims, bool(bsym.kwargs.get("keepdim", False))
    )
    divisor = count - correction if isinstance(count, int) else t.emit("sub", count, correction, dtype=None)
    return t.op("div", squares, divisor, dtype=dtype)


def _softmax_parts(t: Translator, x: Ref, dims: list[int], dtype):
    """``(x - max, exp of it, its sum)`` along ``dims`` (one dim, or none for a 0-d
    tensor), kept as size-1 dims."""
    shifted = t.op("sub", x, t.reduce("max", x, dims, True), dtype=dtype)
    exps = t.op("exp", shifted, dtype=dtype)
    return shifted, exps, t.reduce("sum", exps, dims, True)


@handles(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def _softmax(t: Translator, bsym: BoundSymbol):
    x = t.value(bsym.args[0])
    dims = normalized_dims(bsym.args[1], t.rank(x))
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(x, dtype)
    shifted, exps, total = _softmax_parts(t, x, dims, dtype)
    if bsym.op is aten._log_softmax.default:
        return t.op("sub", shifted, t.op("log", total, dtype=dtype), dtype=dtype)
    result = t.op("div", exps, total, dtype=dtype)
    if bsym.op is aten._safe_softmax.default:  # rows that are all -inf give 0, not NaN
        all_masked = t.op("eq", t.reduce("max", x, dims, True), float("-inf"), dtype=dtype)
        result = t.op("where", all_masked, 0.0, result, dtype=dtype)
    return result


@handles(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward(t: Translator, bsym: BoundSymbol):
    grad, out = (t.value(a) for a in bsym.args[:2])
    dims = normalized_dims(bsym.args[2], t.rank(grad))
    dtype = compute_dtype(bsym.output.dtype)
    grad, out = t.cast(grad, dtype), t.cast(out, dtype)
    if bsym.op is aten._log_softmax_backward_data.default:
        total = t.reduce("sum", grad, dims, True)
        return t.op("sub", grad, t.op("mul", t.op("exp", out, dtype=dtype), total, dtype=dtype), dtype=dtype)
    total = t.reduce("sum", t.op("mul", grad, out, dtype=dtype), dims, True)
    return t.op("mul", out, t.op("sub", grad, total, dtype=dtype), dtype=dtype)


@handles(aten.native_layer_norm.default)
def _layer_norm(t: Translator, bsym: BoundSymbol):
    out, mean_out, rstd_out = bsym.output
    x, _, weight, bias, eps = bsym.args
    x = t.value(x)
    rank = t.rank(x)
    dims = list(range(rank - len(bsym.args[1]), rank))
    dtype = compute_dtype(out.dtype)
    x = t.cast(x, dtype)
    count = t.numel(x, dims)
    mean = t.op("div", t.reduce("sum", x, dims, True), count, dtype=dtype)
    centered = t.op("sub", x, mean, dtype=dtype)
    var = t.op("div", t.reduce("sum", t.op("mul", centered, centered, dtype=dtype), dims, True), count, dtype=dtype)
    rstd = t.op("rsqrt", t.op("add", var, as_constant(eps), dtype=dtype), dtype=dtype)
    y = t.op("mul", centered, rstd, dtype=dtype)
    if weight is not None:
        y = t.op("mul", y, t.cast(t.value(weight), dtype), dtype=dtype)
    if bias is not None:
        y = t.op("add", y, t.cast(t.value(bias), dtype), dtype=dtype)
    return y, t.cast(mean, mean_out.dtype), t.cast(rstd, rstd_out.dtype)
