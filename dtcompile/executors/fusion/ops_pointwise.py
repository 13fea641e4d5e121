"""Translations of pointwise ops: arithmetic, comparisons, activations and their backwards,
copies and fills."""

from __future__ import annotations

import math

import torch

from ...core import BoundSymbol
from ...core.symbolic import as_constant
from .program import Ref
from .program_builder import (
    Translator,
    argument,
    compute_dtype,
    handles,
    operand_dtype,
)

aten = torch.ops.aten


# --- elementwise ----------------------------------------------------------------------------

_UNARY = {
    aten.neg.default: "neg",
    aten.abs.default: "abs",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.reciprocal.default: "reciprocal",
    aten.tanh.default: "tanh",
    aten.sigmoid.default: "sigmoid",
    aten.erf.default: "erf",
    aten.sin.default: "sin",
    aten.cos.default: "cos",
    aten.sgn.default: "sign",
    aten.sign.default: "sign",
}
_BINARY = {
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.div.Tensor: "div",
    aten.div.Scalar: "div",
    aten.pow.Tensor_Scalar: "pow",
    aten.pow.Tensor_Tensor: "pow",
    aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
}
_COMPARE = {
    **{getattr(aten, n).Tensor: n for n in ("eq", "ne", "lt", "le", "gt", "ge")},
    **{getattr(aten, n).Scalar: n for n in ("eq", "ne", "lt", "le", "gt", "ge")},
}
_LOGICAL = {aten.logical_and.default: "logical_and", aten.logical_or.default: "logical_or"}


def _no_kwargs(bsym: BoundSymbol) -> bool:
    return not bsym.kwargs


def _arithmetic(bsym: BoundSymbol) -> bool:
    """Not arithmetic on booleans (``b + True``, ``b * b``): torch keeps bool where
    nvFuser computes an integer."""
    return bsym.output.dtype is not torch.bool


@handles(*_UNARY, check=_no_kwargs)
def _unary(t: Translator, bsym: BoundSymbol):
    out = bsym.output
    return t.math(_UNARY[bsym.op], t.value(bsym.args[0]), dtype=compute_dtype(out.dtype))


@handles(*_BINARY, check=lambda b: _no_kwargs(b) and _arithmetic(b))
def _binary(t: Translator, bsym: BoundSymbol):
    a, b = (t.value(x) for x in bsym.args[:2])
    return t.math(_BINARY[bsym.op], a, b, dtype=compute_dtype(bsym.output.dtype))


@handles(*_COMPARE)
def _compare(t: Translator, bsym: BoundSymbol):
    a, b = (t.value(x) for x in bsym.args[:2])
    # In the operands' common dtype, not in float32: a scalar is rounded to it, as eager does.
    return t.math(_COMPARE[bsym.op], a, b, dtype=operand_dtype(bsym))


@handles(*_LOGICAL)
def _logical(t: Translator, bsym: BoundSymbol):
    a, b = (t.cast(t.value(x), torch.bool) for x in bsym.args[:2])
    return t.op(_LOGICAL[bsym.op], a, b, dtype=torch.bool)


@handles(aten.logical_not.default)
def _logical_not(t: Translator, bsym: BoundSymbol):
    return t.op("logical_not", t.cast(t.value(bsym.args[0]), torch.bool), dtype=torch.bool)


def _scaled(t: Translator, value, alpha, dtype):
    if alpha == 1:
        return value
    return value * alpha if not isinstance(value, Ref) else t.math("mul", value, alpha, dtype=dtype)


@handles(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, check=_arithmetic)
def _add_sub(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    a, b = (t.value(x) for x in bsym.args[:2])
    b = _scaled(t, t.cast(b, dtype), as_constant(argument(bsym, "alpha", 2, 1)), dtype)
    primitive = "add" if bsym.op in (aten.add.Tensor, aten.add.Scalar) else "sub"
    return t.math(primitive, a, b, dtype=dtype)


@handles(aten.rsub.Scalar)
def _rsub(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    a = _scaled(t, t.cast(t.value(bsym.args[0]), dtype), as_constant(argument(bsym, "alpha", 2, 1)), dtype)
    return t.math("sub", as_constant(bsym.args[1]), a, dtype=dtype)


@handles(aten.relu.default)
def _relu(t: Translator, bsym: BoundSymbol):
    return t.math("maximum", t.value(bsym.args[0]), 0, dtype=compute_dtype(bsym.output.dtype))


@handles(aten.clamp.default)
def _clamp(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(t.value(bsym.args[0]), dtype)
    low, high = argument(bsym, "min", 1), argument(bsym, "max", 2)
    if low is not None:
        x = t.op("maximum", x, low, dtype=dtype)
    if high is not None:
        x = t.op("minimum", x, high, dtype=dtype)
    return x


@handles(aten.where.self)
def _where(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    condition = t.cast(t.value(bsym.args[0]), torch.bool)
    a, b = (t.cast(t.value(x), dtype) for x in bsym.args[1:3])
    return t.op("where", condition, a, b, dtype=dtype)


@handles(aten.masked_fill.Scalar)
def _masked_fill(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(t.value(bsym.args[0]), dtype)
    mask = t.cast(t.value(bsym.args[1]), torch.bool)
    return t.op("where", mask, as_constant(bsym.args[2]), x, dtype=dtype)


@handles(aten.gelu.default)
def _gelu(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(t.value(bsym.args[0]), dtype)
    if bsym.kwargs.get("approximate", "none") == "tanh":
        cube = t.op("mul", t.op("mul", x, x, dtype=dtype), x, dtype=dtype)
        inner = t.op(
            "mul",
            t.op("add", x, t.op("mul", cube, 0.044715, dtype=dtype), dtype=dtype),
            math.sqrt(2 / math.pi),
            dtype=dtype,
        )
        cdf = t.op("mul", t.op("add", t.op("tanh", inner, dtype=dtype), 1.0, dtype=dtype), 0.5, dtype=dtype)
    else:
        cdf = t.op(
            "mul",
            t.op("add", t.op("erf", t.op("mul", x, math.sqrt(0.5), dtype=dtype), dtype=dtype), 1.0, dtype=dtype),
            0.5,
            dtype=dtype,
        )
    return t.op("mul", x, cdf, dtype=dtype)


@handles(aten.gelu_backward.default, check=lambda b: b.kwargs.get("approximate", "none") == "none")
def _gelu_backward(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    grad, x = (t.cast(t.value(a), dtype) for a in bsym.args[:2])
    cdf = t.op(
        "mul",
        t.op("add", t.op("erf", t.op("mul", x, math.sqrt(0.5), dtype=dtype), dtype=dtype), 1.0, dtype=dtype),
        0.5,
        dtype=dtype,
    )
    square = t.op("mul", x, x, dtype=dtype)
    pdf = t.op(
        "mul", t.op("exp", t.op("mul", square, -0.5, dtype=dtype), dtype=dtype), 1 / math.sqrt(2 * math.pi), dtype=dtype
    )
    return t.op("mul", grad, t.op("add", cdf, t.op("mul", x, pdf, dtype=dtype), dtype=dtype), dtype=dtype)


@handles(aten.silu.default)
def _silu(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(t.value(bsym.args[0]), dtype)
    return t.op("mul", x, t.op("sigmoid", x, dtype=dtype), dtype=dtype)


@handles(aten.silu_backward.default)
def _silu_backward(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    grad, x = (t.cast(t.value(a), dtype) for a in bsym.args[:2])
    s = t.op("sigmoid", x, dtype=dtype)
    slope = t.op("add", t.op("mul", x, t.op("sub", 1.0, s, dtype=dtype), dtype=dtype), 1.0, dtype=dtype)
    return t.op("mul", t.op("mul", grad, s, dtype=dtype), slope, dtype=dtype)


@handles(aten.sigmoid_backward.default)
def _sigmoid_backward(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    grad, out = (t.cast(t.value(a), dtype) for a in bsym.args[:2])
    return t.op("mul", t.op("mul", grad, out, dtype=dtype), t.op("sub", 1.0, out, dtype=dtype), dtype=dtype)


@handles(aten.tanh_backward.default)
def _tanh_backward(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    grad, out = (t.cast(t.value(a), dtype) for a in bsym.args[:2])
    return t.op("mul", grad, t.op("sub", 1.0, t.op("mul", out, out, dtype=dtype), dtype=dtype), dtype=dtype)


@handles(aten.threshold_backward.default)
def _threshold_backward(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    grad = t.cast(t.value(bsym.args[0]), dtype)
    x = t.value(bsym.args[1])  # compared in its own dtype, as eager does
    return t.op("where", t.op("le", x, as_constant(bsym.args[2]), dtype=t.dtype(x)), 0.0, grad, dtype=dtype)


def _same_device(bsym: BoundSymbol) -> bool:
    source = bsym.args[0]
    allowed = {"dtype", "layout", "device", "memory_format", "non_blocking", "pin_memory"}
    return set(bsym.kwargs) <= allowed and bsym.output.device == source.device


@handles(aten._to_copy.default, aten.clone.default, check=_same_device)
def _copy(t: Translator, bsym: BoundSymbol):
    return t.cast(t.value(bsym.args[0]), bsym.output.dtype)


_FILL = {aten.ones_like.default: 1, aten.zeros_like.default: 0, aten.empty_like.default: 0}


@handles(*_FILL, aten.full_like.default, check=_same_device)
def _full_like(t: Translator, bsym: BoundSymbol):
    out = bsym.output
    value = _FILL[bsym.op] if bsym.op in _FILL else as_constant(bsym.args[1])
    x = t.value(bsym.args[0])
    return t.emit("full", t.sizes(x), value, out.dtype, str(out.device), dtype=out.dtype)
