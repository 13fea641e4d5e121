"""The trace's own symbols: what no aten op expresses.

Under symbolic values a trace reads the sizes it needs from tensors at run time
(``prims.shape``) and computes sizes derived from them (``n2 = n0 * n1``); aten ops then
take those numbers where the traced call passed SymInts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .printing import python_literal
from .symbol import BoundSymbol, Symbol
from .symbolic import python_source


def shape(tensor, dim: int) -> int:
    """The size of ``tensor`` along ``dim`` (what ``prims.shape`` runs)."""
    return tensor.shape[dim]


@dataclass(frozen=True)
class ShapeQuery(Symbol):
    """``n0 = prims.shape(x, 1)``: a size of a tensor the trace holds."""

    def lines(self, bsym: BoundSymbol) -> list[str]:
        tensor, dim = bsym.args
        return [f"{bsym.output.label} = prims.shape({tensor.label}, {python_literal(dim)})"]


@dataclass(frozen=True)
class ShapeRead(Symbol):
    """``n0 = x.shape[1]``: ``prims.shape`` as the execution trace runs it."""

    def lines(self, bsym: BoundSymbol) -> list[str]:
        tensor, dim = bsym.args
        return [f"{bsym.output.label} = {tensor.label}.shape[{python_literal(dim)}]"]


@dataclass(frozen=True)
class SizeExpression(Symbol):
    """``n2 = n0 * n1``: a size computed from others; ``symbols`` are the expression's
    free symbols, in the order of the call's arguments."""

    expr: object = None
    symbols: tuple = ()

    def lines(self, bsym: BoundSymbol) -> list[str]:
        names = {symbol: arg.label for symbol, arg in zip(self.symbols, bsym.args)}
        return [f"{bsym.output.label} = {python_source(self.expr, names)}"]


SHAPE = ShapeQuery(
    "prims.shape", shape, globals=(("prims", sys.modules[__name__], "from dtcompile.core import prims"),), pure=True
)
SHAPE_READ = ShapeRead("shape", shape, pure=True)


def size_expression(expr, symbols: tuple) -> SizeExpression:
    return SizeExpression("prims.size", None, pure=True, expr=expr, symbols=symbols)
