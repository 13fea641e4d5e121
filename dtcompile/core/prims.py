"""The trace's own symbols: what no aten op expresses.

Under symbolic values a trace reads the sizes it needs from tensors at run time
(``prims.shape``) and computes sizes derived from them (``n2 = n0 * n1``); aten ops then
take those numbers where the traced call passed SymInts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .errors import DataCheckFailed
from .printing import python_literal
from .proxy import TensorProxy
from .symbol import BoundSymbol, Symbol
from .symbolic import SOURCE_GLOBALS, is_symbolic, python_source, symbolic_expr


def shape(tensor, dim: int) -> int:
    """The size of ``tensor`` along ``dim`` (what ``prims.shape`` runs)."""
    return tensor.shape[dim]


def stride(tensor, dim: int) -> int:
    """The stride of ``tensor`` along ``dim`` (what ``prims.stride`` runs)."""
    return tensor.stride(dim)


def storage_offset(tensor) -> int:
    """Where ``tensor`` starts in its storage (what ``prims.storage_offset`` runs)."""
    return tensor.storage_offset()


@dataclass(frozen=True)
class ShapeQuery(Symbol):
    """``n0 = prims.shape(x, 1)``: a size (or a stride, ``prims.stride(x, 1)``, or the
    storage offset, ``prims.storage_offset(x)``) of a tensor the trace holds."""

    def lines(self, bsym: BoundSymbol) -> list[str]:
        args = ", ".join(a.label if isinstance(a, TensorProxy) else python_literal(a) for a in bsym.args)
        return [f"{bsym.output.label} = {self.name}({args})"]


@dataclass(frozen=True)
class ShapeRead(Symbol):
    """``n0 = x.shape[1]`` (``x.stride(1)``, ``x.storage_offset()``): a ``ShapeQuery`` as
    the execution trace runs it."""

    def lines(self, bsym: BoundSymbol) -> list[str]:
        tensor, *dim = bsym.args
        if self.name == "shape":
            return [f"{bsym.output.label} = {tensor.label}.shape[{python_literal(dim[0])}]"]
        return [f"{bsym.output.label} = {tensor.label}.{self.name}({', '.join(map(python_literal, dim))})"]


@dataclass(frozen=True)
class SizeExpression(Symbol):
    """``n2 = n0 * n1``: a size computed from others; ``symbols`` are the expression's
    free symbols, in the order of the call's arguments."""

    expr: object = None
    symbols: tuple = ()

    def lines(self, bsym: BoundSymbol) -> list[str]:
        names = {symbol: arg.label for symbol, arg in zip(self.symbols, bsym.args)}
        return [f"{bsym.output.label} = {python_source(self.expr, names)}"]


_PRIMS = (("prims", sys.modules[__name__], "from dtcompile.core import prims"),)
SHAPE = ShapeQuery("prims.shape", globals=_PRIMS, pure=True)
STRIDE = ShapeQuery("prims.stride", globals=_PRIMS, pure=True)
STORAGE_OFFSET = ShapeQuery("prims.storage_offset", globals=_PRIMS, pure=True)


def size_query(expr, tensors: list[TensorProxy]) -> tuple[object, tuple] | None:
    """The query (and its arguments) that reads ``expr`` from one of ``tensors``: a size
    first, else a stride or a storage offset (a non-contiguous input's stride is a symbol
    of its own); None when no tensor holds it."""
    for tensor in tensors:
        for dim, size in enumerate(tensor.shape):
            if is_symbolic(size) and symbolic_expr(size) == expr:
                return SHAPE, (tensor, dim)
    for tensor in tensors:
        for dim, step in enumerate(tensor.stride()):
            if is_symbolic(step) and symbolic_expr(step) == expr:
                return STRIDE, (tensor, dim)
        offset = tensor.storage_offset()
        if is_symbolic(offset) and symbolic_expr(offset) == expr:
            return STORAGE_OFFSET, (tensor,)
    return None


# What each query runs as in an execution trace.
READS = {
    SHAPE.name: ShapeRead("shape", pure=True),
    STRIDE.name: ShapeRead("stride", pure=True),
    STORAGE_OFFSET.name: ShapeRead("storage_offset", pure=True),
}


def size_expression(expr, symbols: tuple) -> SizeExpression:
    return SizeExpression("prims.size", globals=SOURCE_GLOBALS, pure=True, expr=expr, symbols=symbols)


@dataclass(frozen=True)
class DataCheck(Symbol):
    """``if not (t3 > 0.0): raise DataCheckFailed(...)``: a branch the traced code took on
    numbers read from tensor data (``symbols``, in the order of the call's arguments)."""

    expr: object = None
    symbols: tuple = ()

    def lines(self, bsym: BoundSymbol) -> list[str]:
        names = {symbol: arg.label for symbol, arg in zip(self.symbols, bsym.args)}
        condition = python_source(self.expr, names)
        return [f"if not ({condition}): raise DataCheckFailed({('traced with ' + condition)!r})"]


_CHECK_GLOBALS = (
    ("DataCheckFailed", DataCheckFailed, "from dtcompile.core.errors import DataCheckFailed"),
    *SOURCE_GLOBALS,
)


def data_check(expr, symbols: tuple) -> DataCheck:
    return DataCheck("prims.data_check", globals=_CHECK_GLOBALS, pure=False, expr=expr, symbols=symbols)
