"""How a ShapeEnv decides questions on numbers read from tensor data: not by its static
analysis where that is made for sizes and wrong for them (a private method of torch's, so
it sits here, beside ``torch_internals.py``)."""

from __future__ import annotations

import sympy
from torch.utils._sympy.symbol import SymT, symbol_is_type


def decided_by_values(shape_env):
    """``shape_env``, deciding no question on a float read from data, or on a bitwise op of
    an int read from data, but by the values (then checked at run time): its static
    analysis, made for sizes, took ``v > v`` to be True and ``n & -3`` to be non-negative.
    ``_maybe_evaluate_static`` is where it decides (no public API)."""
    static = shape_env._maybe_evaluate_static

    def maybe_evaluate_static(expr, *, unbacked_only: bool = False, **kwargs):
        if _data_floats_or_bits(expr):
            return expr if unbacked_only else None  # (``unbacked_only``: nothing eliminated)
        return static(expr, unbacked_only=unbacked_only, **kwargs)

    maybe_evaluate_static.cache_clear = static.cache_clear  # (the ShapeEnv clears its cache of answers)
    shape_env._maybe_evaluate_static = maybe_evaluate_static
    return shape_env


def _data_floats_or_bits(expr) -> bool:
    """A float read from data, or a bitwise op of an int read from data (``n & -3``: its
    ranges are a non-negative int's) in ``expr``."""
    symbols = getattr(expr, "free_symbols", ())
    if any(symbol_is_type(s, SymT.UNBACKED_FLOAT) for s in symbols):
        return True
    bits = [a for a in expr.atoms(sympy.Function) if type(a).__name__.startswith("BitwiseFn_")] if symbols else ()
    return any(symbol_is_type(s, SymT.UNBACKED_INT) for a in bits for s in a.free_symbols)
