"""Symbolic sizes, handled without adding guards.

Under ``cache="symbolic values"`` tensor sizes are SymInts of a ShapeEnv. Comparing two
SymInts with ``==`` and asking ``bool()`` of the result records a guard (an assumption
the compiled program then depends on). The compiler's own bookkeeping (printing strides,
spotting identity views) must not make such assumptions, so it asks the questions here:
answered from the expressions alone, never by guarding.
"""

from __future__ import annotations

import math

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._sympy.printers import PythonPrinter

from .torch_internals import symbol_values

SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)
# The largest size a symbol stands for. torch simplifies size expressions that go through
# floats (``int(n / 3)`` to ``n // 3``), which is exact only where floats hold every integer;
# a larger size is traced as a constant.
LARGEST_SYMBOLIC_SIZE = 2**53


def is_symbolic(value: object) -> bool:
    """A SymInt (SymFloat, SymBool) whose value is not a known constant."""
    if not isinstance(value, SYMBOLIC_TYPES):
        return False
    return not isinstance(symbolic_expr(value), (sympy.Integer, sympy.Float, sympy.logic.boolalg.BooleanAtom))


def symbolic_expr(value) -> sympy.Expr:
    """The simplified expression of a SymInt, or a sympy constant of a plain number."""
    if isinstance(value, SYMBOLIC_TYPES):
        node = value.node
        return node.shape_env.simplify(node.expr) if node.shape_env is not None else node.expr
    return sympy.sympify(value)


def known_equal(a, b) -> bool:
    """True when ``a == b`` holds for every value of the symbols (no guard is recorded)."""
    if not isinstance(a, SYMBOLIC_TYPES) and not isinstance(b, SYMBOLIC_TYPES):
        return a == b
    if isinstance(a, _SIZES) and isinstance(b, _SIZES) and _expression(a) == _expression(b):
        return True  # the same expression (the usual answer, without a symbolic comparison)
    return statically_known_true(a == b)


_SIZES = (int, torch.SymInt)


def _expression(size):
    return size.node.expr if isinstance(size, torch.SymInt) else size


def known_shape_equal(a, b) -> bool:
    return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))


def as_constant(value):
    """A plain int (float, bool) for a value whose expression is a constant; else the value."""
    if isinstance(value, SYMBOLIC_TYPES):
        expr = symbolic_expr(value)
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if isinstance(expr, sympy.Float):
            return float(expr)
        if isinstance(expr, sympy.logic.boolalg.BooleanAtom):
            return bool(expr)
    return value


def size_hint(value, unknown: int | None = None) -> int | None:
    """The value a size had in the traced call. A size that depends on numbers read from
    tensor data had none: it is computed with ``unknown`` standing for each such number
    (None: the size is None)."""
    if not isinstance(value, SYMBOLIC_TYPES):
        return value
    node = value.node
    if node.hint is not None:  # sizes derived from the inputs' carry their traced values
        return node.hint
    if unknown is None:
        return None
    known = symbol_values(node.shape_env)
    values = {s: known.get(s, unknown) for s in node.expr.free_symbols}
    return int(node.expr.xreplace(values))


_printer = PythonPrinter()
# The names ``python_source`` may print (``math.ceil``, ``torch.sym_float``), as a
# Symbol's globals: (name, object, how a printed trace imports it).
SOURCE_GLOBALS = (("math", math, "import math"), ("torch", torch, "import torch"))


def python_source(expr, names: dict) -> str:
    """Python source for ``expr``, each free symbol written as ``names[symbol]``."""
    # Renamed with the symbol's own assumptions: a float read from data is not an integer.
    renamed = expr.xreplace(
        {symbol: sympy.Symbol(names[symbol], **symbol.assumptions0) for symbol in expr.free_symbols}
    )
    return _printer.doprint(renamed)
