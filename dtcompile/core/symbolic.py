"""Symbolic sizes, handled without adding guards.

Under ``cache="symbolic values"`` tensor sizes are SymInts of a ShapeEnv. Comparing two
SymInts with ``==`` and asking ``bool()`` of the result records a guard (an assumption
the compiled program then depends on). The compiler's own bookkeeping (printing strides,
spotting identity views) must not make such assumptions, so it asks the questions here:
answered from the expressions alone, never by guarding.
"""

from __future__ import annotations

import math
import operator

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._sympy.functions import IntTrueDiv, ToFloat, TruncToInt
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
    expr = symbolic_expr(value)
    return not (expr.is_Number or isinstance(expr, sympy.logic.boolalg.BooleanAtom))  # nan and oo are numbers


def symbolic_expr(value) -> sympy.Expr:
    """The simplified expression of a SymInt, or a sympy constant of a plain number."""
    if isinstance(value, SYMBOLIC_TYPES):
        node = value.node
        return _simplified(node.shape_env, node.expr) if node.shape_env is not None else node.expr
    return sympy.sympify(value)


def _simplified(shape_env, expr):
    """``shape_env.simplify(expr)``, but for ``math.trunc(a / b)``: the ShapeEnv rewrites it
    as ``a // b``, which floors where ``a / b`` is negative (a number read from data); kept
    as it is unless ``a`` and ``b`` are known to be non-negative."""
    hidden = {}
    if expr.has(TruncToInt):
        for atom in expr.atoms(TruncToInt):
            division = atom.args[0]
            if isinstance(division, IntTrueDiv) and not all(_non_negative(shape_env, a) for a in division.args):
                hidden[atom] = sympy.Dummy("trunc", integer=True)
    simplified = shape_env.simplify(expr.xreplace(hidden))
    return simplified.xreplace({dummy: atom for atom, dummy in hidden.items()}) if hidden else simplified


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


def _non_negative(shape_env, expr) -> bool:
    known = sympy.Ge(expr, 0)
    return known is sympy.true or (known is not sympy.false and shape_env._maybe_evaluate_static(known) is sympy.true)


def as_constant(value):
    """A plain int (float, bool) for a value whose expression is a constant; else the value."""
    if isinstance(value, SYMBOLIC_TYPES):
        expr = symbolic_expr(value)
        # By the value's own type: a float's ``k - k`` is simplified to the Integer 0.
        if isinstance(value, torch.SymFloat) and expr.is_Number:
            return float(expr)
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if isinstance(expr, sympy.Float):
            return float(expr)
        if isinstance(expr, sympy.logic.boolalg.BooleanAtom):
            return bool(expr)
    return value


def float_expr(value) -> sympy.Expr:
    """The expression of a symbolic value, computing a float where the value is a SymFloat
    (``float(n) + n`` may be simplified to the integer expression ``2*n``)."""
    expr = symbolic_expr(value)
    return ToFloat(expr) if isinstance(value, torch.SymFloat) and expr.is_integer else expr


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


class FloatIs(sympy.logic.boolalg.BooleanFunction):
    """``FloatIs(x, kind)``: what a float's run-time check asks beyond ``==``, which holds
    for -0.0 as for 0.0 and never for NaN: ``x`` is NaN, finite, +inf, -inf, or has the
    sign bit clear or set (``KINDS``). Never evaluated by sympy: printed as Python."""

    KINDS = ("math.isnan({})", "math.isfinite({})", "{} == math.inf", "{} == -math.inf")
    KINDS += ("math.copysign(1.0, {}) > 0.0", "math.copysign(1.0, {}) < 0.0")

    @classmethod
    def eval(cls, x, kind):
        return None


def exact_float_checks(symbol, value: float, sign: bool) -> list:
    """The checks that a float read from data is ``value`` as far as sympy cannot tell:
    NaN and infinities exactly, else finite (sympy takes ``x - x`` to be 0), and with
    ``sign``, a zero's sign (``x == 0.0`` holds for -0.0)."""
    if math.isnan(value):
        return [FloatIs(symbol, sympy.Integer(0))]
    if math.isinf(value):
        return [FloatIs(symbol, sympy.Integer(2 if value > 0 else 3))]
    checks = [FloatIs(symbol, sympy.Integer(1))]
    if sign:
        checks.append(FloatIs(symbol, sympy.Integer(4 if math.copysign(1.0, value) > 0 else 5)))
    return checks


class Then(sympy.logic.boolalg.BooleanFunction):
    """``Then(a, b)``: ``a and b`` in Python's order, ``b`` asked only where ``a`` holds
    (``k != 0 and n // k == 4``): sympy's ``And`` orders its arguments as it likes."""

    @classmethod
    def eval(cls, first, second):
        return None


_OPERATIONS = {"+": operator.add, "*": operator.mul, "/": operator.truediv, "**": operator.pow, "%": operator.mod}
_OPERATIONS["//"] = operator.floordiv


class _PythonFloat(sympy.Function):
    """One of Python's float operations on a float that has symbols (a SymFloat's ``k +
    1e16``), kept as one operation: sympy would regroup ``(k + 1e16) - 1e16`` as ``k``, as
    exact real arithmetic. Folded, with Python's floats, only where both are numbers; torch's
    analyses take it as their ``_torch_handler_name``."""

    is_real = True
    python: str = ""

    @classmethod
    def eval(cls, a, b):
        if a.is_Number and b.is_Number:
            return sympy.sympify(_OPERATIONS[cls.python](float(a), float(b)))
        return None


class PythonAdd(_PythonFloat):
    _torch_handler_name, python = "add", "+"


class PythonMul(_PythonFloat):
    _torch_handler_name, python = "mul", "*"


class PythonTrueDiv(_PythonFloat):
    _torch_handler_name, python = "truediv", "/"


class PythonFloatMod(_PythonFloat):
    """``a % b`` of floats, as Python computes it: torch's ``PythonMod`` is an integer's
    (sympy took ``Eq(v % 1.0, 0.75)`` to be False, and its ranges ``v % 1.0`` to be 0).
    No analysis of torch's has ranges for it: asked for some, it raises, never guesses."""

    _torch_handler_name, python = "python_float_mod", "%"


class PythonFloatFloorDiv(_PythonFloat):
    """``a // b`` of floats, as Python computes it (``2.5 // 0.1`` is 24.0, where torch's
    ``floor(a / b)`` is 25)."""

    _torch_handler_name, python = "python_float_floordiv", "//"


class PythonPow(_PythonFloat):
    """``a ** k`` of a float, ``k`` a whole number: defined for a negative ``a`` too, as in
    Python (torch's own asks ``a >= 0``, for a fractional ``k`` would make it complex)."""

    _torch_handler_name, python = "pow", "**"


PYTHON_FLOAT_OPERATIONS = (PythonAdd, PythonMul, PythonTrueDiv, PythonFloatMod, PythonFloatFloorDiv, PythonPow)


def python_float(op: str, a, b):
    """``a op b`` (``op``: add, sub, mul, truediv, mod, floordiv, pow by a whole number) on sympy
    expressions, as Python's floats compute it; ``a - b`` is ``a + (-b)``, which is exact in
    floats too."""
    if op == "sub":
        op, b = "add", -b
    made = {"add": PythonAdd, "mul": PythonMul, "truediv": PythonTrueDiv, "pow": PythonPow, "mod": PythonFloatMod}
    made["floordiv"] = PythonFloatFloorDiv
    return made[op](a, b)


class _Printer(PythonPrinter):
    def _print__PythonFloat(self, expr) -> str:
        a, b = (self._print(arg) for arg in expr.args)
        return f"(({a}) {expr.python} ({b}))"  # (each side whole: ``w / -v`` printed ``w / (-1)*v`` was ``-w * v``)

    _print_PythonAdd = _print_PythonMul = _print_PythonTrueDiv = _print_PythonPow = _print__PythonFloat
    _print_PythonFloatMod = _print_PythonFloatFloorDiv = _print__PythonFloat

    def _print_Then(self, expr) -> str:
        return "(" + " and ".join(f"({self._print(a)})" for a in expr.args) + ")"

    def _print_FloatIs(self, expr) -> str:
        return "(" + FloatIs.KINDS[int(expr.args[1])].format(self._print(expr.args[0])) + ")"


_printer = _Printer()
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
