"""How a ShapeEnv decides questions on numbers read from tensor data: not by its static
analysis where that is made for sizes and wrong for them (a private method of torch's, so
it sits here, beside ``torch_internals.py``)."""

from __future__ import annotations

import sympy
from torch.utils._sympy.symbol import SymT, prefix_str, symbol_is_type

from .symbolic import PYTHON_FLOAT_OPERATIONS

_FLOAT, _INT = prefix_str[SymT.UNBACKED_FLOAT], prefix_str[SymT.UNBACKED_INT]  # (how their names start)


def decided_by_values(shape_env):
    """``shape_env``, deciding no question on a float read from data, on a bitwise op of an
    int read from data, or on one of Python's float operations (``symbolic.python_float``:
    ``float(n // 2.5)`` of a size), but by the values (then checked at run time): its
    static analysis, made for sizes, took ``v > v`` to be True and ``n & -3`` to be
    non-negative, and has no ranges for Python's float operations (it raised).
    ``_maybe_evaluate_static`` is where it decides (no public API)."""
    static = shape_env._maybe_evaluate_static

    def maybe_evaluate_static(expr, *, unbacked_only: bool = False, **kwargs):
        if _data_floats_or_bits(expr):
            return expr if unbacked_only else None  # (``unbacked_only``: nothing eliminated)
        return static(expr, unbacked_only=unbacked_only, **kwargs)

    maybe_evaluate_static.cache_clear = static.cache_clear  # (the ShapeEnv clears its cache of answers)
    shape_env._maybe_evaluate_static = maybe_evaluate_static
    guard_rel = shape_env._maybe_guard_rel

    def maybe_guard_rel(expr) -> None:
        guard_rel(expr)
        _replaced_where_decided(shape_env, expr)

    shape_env._maybe_guard_rel = maybe_guard_rel
    return shape_env


def _replaced_where_decided(shape_env, expr) -> None:
    """A size read from data found equal to a number (``if len(sel) == 1``, ``bool(n == 1)``
    checked at run time, ``torch._check(n == 1)``) is that number from then on, also where
    torch's ops reason "size-obliviously" (a ``nonzero``'s count taken to be 2 or more:
    ``squeeze``, ``unbind``, broadcasting would keep a dim of 1 that eager's drops).
    ``_maybe_guard_rel`` skips such a replacement for a size-like symbol; here the symbol
    stops being size-like, since the entry holds only where it has this value."""
    if not isinstance(expr, sympy.Eq):
        return
    for symbol, number in ((expr.lhs, expr.rhs), (expr.rhs, expr.lhs)):
        if (
            isinstance(symbol, sympy.Symbol)
            and symbol_is_type(symbol, SymT.UNBACKED_INT)
            and number.is_Integer
            and symbol not in shape_env.replacements
        ):
            shape_env.size_like.discard(symbol)
            shape_env._set_replacement(symbol, number, "a size read from data, decided")


def _data_floats_or_bits(expr) -> bool:
    """A float read from data, or a bitwise op of an int read from data (``n & -3``: its
    ranges are a non-negative int's) in ``expr``. (Asked at each question, sizes' too: the
    names first, which cost least.)"""
    names = [s.name.lower() for s in getattr(expr, "free_symbols", ())]
    if any(name.startswith(_FLOAT) for name in names):
        return True
    if names and expr.atoms(*PYTHON_FLOAT_OPERATIONS):
        return True
    if not any(name.startswith(_INT) for name in names):
        return False
    bits = [a for a in expr.atoms(sympy.Function) if type(a).__name__.startswith("BitwiseFn_")]
    return any(symbol_is_type(s, SymT.UNBACKED_INT) for a in bits for s in a.free_symbols)
