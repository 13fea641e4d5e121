"""Translations of views (reshapes, permutes, squeezes, expands) and of matmuls, which the
executor fuses only when asked to."""

from __future__ import annotations

import torch

from ...core import BoundSymbol
from ...core.op_classes import MATMULS
from ...core.symbolic import as_constant
from .program_builder import (
    LOW_PRECISION,
    Translator,
    compute_dtype,
    handles,
    normalized_dims,
)

aten = torch.ops.aten

VIEWS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.expand.default,
    }
)
MATMUL_OPS = MATMULS


# --- views ---------------------------------------------------------------------------------


def _sizes_known(bsym: BoundSymbol) -> bool:
    """A -1 in a view's sizes is read from the traced result, so it must be a constant there."""
    out = bsym.output
    return all(s != -1 or isinstance(as_constant(out.shape[i]), int) for i, s in enumerate(bsym.args[1]))


@handles(aten.view.default, aten._unsafe_view.default, aten.reshape.default, check=_sizes_known)
def _reshape(t: Translator, bsym: BoundSymbol):
    out = bsym.output
    shape = [as_constant(out.shape[i]) if s == -1 else t.value(s) for i, s in enumerate(bsym.args[1])]
    return t.emit("reshape", t.value(bsym.args[0]), shape, dtype=out.dtype)


@handles(aten.permute.default, aten.transpose.int, aten.t.default)
def _permute(t: Translator, bsym: BoundSymbol):
    x = t.value(bsym.args[0])
    rank = t.rank(x)
    if rank == 0:  # a 0-d tensor's only "dim" (0 or -1) is itself
        return x
    if bsym.op is aten.permute.default:
        dims = [d % rank for d in bsym.args[1]]
    else:
        dims = list(range(rank))
        a, b = (bsym.args[1] % rank, bsym.args[2] % rank) if bsym.op is aten.transpose.int else (0, rank - 1)
        dims[a], dims[b] = dims[b], dims[a]
    return t.emit("permute", x, dims, dtype=bsym.output.dtype)


@handles(aten.unsqueeze.default)
def _unsqueeze(t: Translator, bsym: BoundSymbol):
    out = bsym.output
    dim = bsym.args[1] % out.dim()
    return t.emit("broadcast", t.value(bsym.args[0]), [d == dim for d in range(out.dim())], dtype=out.dtype)


@handles(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(t: Translator, bsym: BoundSymbol):
    source = bsym.args[0]
    x = t.value(source)
    rank = source.dim()
    asked = range(rank) if bsym.op is aten.squeeze.default else normalized_dims(bsym.args[1], rank)
    dims = [d for d in asked if as_constant(source.shape[d]) == 1]
    return x if not dims else t.emit("squeeze", x, dims, dtype=bsym.output.dtype)


@handles(aten.expand.default, check=lambda b: not b.kwargs)
def _expand(t: Translator, bsym: BoundSymbol):
    source, sizes = bsym.args[0], bsym.args[1]
    x = t.value(source)
    new = len(sizes) - source.dim()
    if new:
        x = t.emit("broadcast", x, [True] * new + [False] * source.dim(), dtype=source.dtype)
    shape = [t.size(t.values[source.label], i - new) if s == -1 else t.value(s) for i, s in enumerate(sizes)]
    return t.emit("expand", x, shape, dtype=source.dtype)


# --- matmuls (fused only when the executor is asked to) ------------------------------------


def _plain_addmm(bsym: BoundSymbol) -> bool:
    """beta = alpha = 1, in a dtype the product is not rounded in before the bias is added."""
    plain = as_constant(bsym.kwargs.get("beta", 1)) == 1 and as_constant(bsym.kwargs.get("alpha", 1)) == 1
    return plain and bsym.output.dtype not in LOW_PRECISION


@handles(aten.mm.default, aten.bmm.default)
def _matmul(t: Translator, bsym: BoundSymbol):
    a, b = (t.value(x) for x in bsym.args)
    return t.emit("matmul", a, b, dtype=bsym.output.dtype)


@handles(aten.addmm.default, check=_plain_addmm)
def _addmm(t: Translator, bsym: BoundSymbol):
    bias, a, b = (t.value(x) for x in bsym.args[:3])
    dtype = compute_dtype(bsym.output.dtype)
    product = t.emit("matmul", a, b, dtype=bsym.output.dtype)
    return t.math("add", product, bias, dtype=dtype)
