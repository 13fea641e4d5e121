"""Symbolic sizes the user's code turns into text or hashes, while a call is traced.

Under ``cache="symbolic values"`` the traced code sees sizes as SymInts. ``str``,
``repr`` and f-strings of one give the symbol's name (``"s0"``), and hashing one raises;
code that computes with such text (``len(str(n))``, a size as a dict key) would bake in
the name or fail, where eager sees the number; so would a number read from tensor data
(``str(x.sum().item())``, a SymFloat). While a call is traced, these methods of
``torch.SymInt``, ``SymFloat`` and ``SymBool``, called from the user's code, take the
value instead: ``int(size)``, which guards the program on that value (a call with
another size compiles again, as it must; a number read from data is checked at run
time, as a branch on it is). Called from library code (torch printing a shape, a
log line), they behave as they do.

Python arithmetic and comparisons of a float read from data (a SymFloat's ``k - k``,
``k != k``, ``0 * k``) are sympy's, which takes every number to be finite: ``k - k`` is
0 and ``k != k`` is False. Called from the user's code, they are followed here (see
``_exact``): where the float was NaN or infinite while tracing (the program then checks
that it is, ``data_branches.checks_first``), they are computed as Python computes them;
where a finite float was simplified away, it is noted (``folded``), and the program
checks that the float is finite at run time.
"""

from __future__ import annotations

import contextlib
import math
import operator
import sys

import sympy
import torch
from torch.fx.experimental.sym_node import SymNode
from torch.utils._sympy.functions import ToFloat
from torch.utils._sympy.symbol import SymT, symbol_is_type

from ..core import TracingError
from ..core.code_origin import library_code
from ..core.symbolic import as_constant, python_float
from ..core.torch_internals import symbol_values


def _from_user_code() -> bool:
    frame = sys._getframe(2)  # the caller of the SymInt method
    if frame.f_code in _PASSING:  # (``divmod`` of the user's: its ``//`` and ``%`` are the user's)
        frame = frame.f_back
    return not library_code(frame.f_globals.get("__name__", ""), frame.f_code.co_filename)


def _divmod_of(self, other):
    return (self // other, self % other)


def _rdivmod_of(self, other):
    return (other // self, other % self)


_PASSING = frozenset({_divmod_of.__code__, _rdivmod_of.__code__})


@contextlib.contextmanager
def sizes_as_values_in_user_text():
    """Inside, ``repr``/``str``/``format``/``hash`` of a SymInt (a SymFloat, a SymBool:
    numbers read from data) called from the user's code use its value (see the module
    docstring)."""
    with contextlib.ExitStack() as stack:
        for cls, kind in ((torch.SymInt, int), (torch.SymFloat, float), (torch.SymBool, bool)):
            stack.enter_context(_values_in_user_text(cls, kind))
        for cls in (torch.SymInt, torch.SymFloat):
            stack.enter_context(_divmod(cls))
        stack.enter_context(_comparisons_as_bools(torch.SymInt))
        stack.enter_context(_exact_float_arithmetic())
        yield


_SIZE_COMPARISONS = ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__")


@contextlib.contextmanager
def _comparisons_as_bools(cls: type):
    """A comparison of sizes in the user's code (``keepdim=x.shape[1] > 4``, ``is_causal=n >
    1``): Python's bool, as eager's code gets, a guard on the sizes (as a branch on it is),
    where a SymBool is refused by torch's ops' argument parsing (a TypeError) and is not
    ``isinstance(.., bool)``. torch's own code keeps its SymBools (it asks without guards)."""
    saved = {name: vars(cls)[name] for name in _SIZE_COMPARISONS}

    def as_bool(name):
        compare = saved[name]

        def compared(self, other):
            result = compare(self, other)
            return bool(result) if isinstance(result, torch.SymBool) and _from_user_code() else result

        return compared

    for name in _SIZE_COMPARISONS:
        setattr(cls, name, as_bool(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(cls, name, method)


@contextlib.contextmanager
def _divmod(cls: type):
    """``divmod`` of a size or a number read from data: torch's SymInt and SymFloat have
    none (a TypeError, where eager's numbers give ``(a // b, a % b)``)."""
    saved = {name: vars(cls)[name] for name in ("__divmod__", "__rdivmod__") if name in vars(cls)}
    cls.__divmod__, cls.__rdivmod__ = _divmod_of, _rdivmod_of
    try:
        yield
    finally:
        for name in ("__divmod__", "__rdivmod__"):
            if name in saved:
                setattr(cls, name, saved[name])
            else:
                delattr(cls, name)


@contextlib.contextmanager
def _values_in_user_text(cls: type, kind: type):
    saved = {name: vars(cls)[name] for name in ("__repr__", "__format__", "__hash__") if name in vars(cls)}
    original_repr, original_hash = cls.__repr__, cls.__hash__

    def __repr__(self):
        return repr(kind(self)) if _from_user_code() else original_repr(self)

    def __format__(self, spec):
        if _from_user_code():
            return format(kind(self), spec)
        return object.__format__(self, spec)

    def __hash__(self):
        return hash(kind(self)) if _from_user_code() else original_hash(self)

    cls.__repr__, cls.__format__, cls.__hash__ = __repr__, __format__, __hash__
    try:
        yield
    finally:
        for name in ("__repr__", "__format__", "__hash__"):
            if name in saved:
                setattr(cls, name, saved[name])
            else:
                delattr(cls, name)


_BINARY = {name: getattr(operator, name) for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow")}
_COMPARISONS = {name: getattr(operator, name) for name in ("eq", "ne", "lt", "le", "gt", "ge")}
_RELATIONS = {"eq": sympy.Eq, "ne": sympy.Ne, "lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge}


def negative_zeros(shape_env) -> set:
    """The floats read from data that were -0.0 while tracing (noted by ``data_branches.value_now``):
    the ShapeEnv holds their values as sympy numbers, which have no sign of zero."""
    if not hasattr(shape_env, "_dtcompile_negative_zeros"):
        shape_env._dtcompile_negative_zeros = set()
    return shape_env._dtcompile_negative_zeros


def folded(shape_env) -> set:
    """The floats read from data that sympy simplified away while tracing (``k - k``)."""
    if not hasattr(shape_env, "_dtcompile_folded"):
        shape_env._dtcompile_folded = set()
    return shape_env._dtcompile_folded


@contextlib.contextmanager
def _exact_float_arithmetic():
    """Inside, a SymFloat's arithmetic and comparisons called from the user's code are
    followed by ``_exact`` (see the module docstring)."""
    cls = torch.SymFloat
    methods = {f"__{name}__": (op, False) for name, op in {**_BINARY, **_COMPARISONS}.items()}
    methods.update({f"__r{name}__": (op, True) for name, op in _BINARY.items()})
    saved = {name: vars(cls)[name] for name in methods if name in vars(cls)}
    for name, original in saved.items():
        setattr(cls, name, _exact(original, *methods[name]))
    int_methods = {name: vars(torch.SymInt)[name] for name in _INT_METHODS}
    for name, original in int_methods.items():
        setattr(torch.SymInt, name, _INT_METHODS[name](original))
    guards = {name: vars(SymNode)[name] for name in ("guard_int", "guard_bool", "guard_float", "expect_true")}
    for name, original in guards.items():
        setattr(SymNode, name, _nonzero(_signed(original) if name == "guard_float" else original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(cls, name, original)
        for name, original in int_methods.items():
            setattr(torch.SymInt, name, original)
        for name, original in guards.items():
            setattr(SymNode, name, original)


def _exact(original, op, reflected: bool):
    def method(self, other):
        if not _from_user_code():
            return original(self, other)
        a, b = (other, self) if reflected else (self, other)
        shape_env = self.node.shape_env
        data = _data_floats(a) | _data_floats(b)
        values = symbol_values(shape_env) if data else {}
        unknown = _free_symbols(a) | _free_symbols(b)
        if data and all(s in data and s in values and not math.isfinite(float(values[s])) for s in unknown):
            return op(_real(a, values), _real(b, values))  # NaN, inf: as Python computes it
        result = _in_python_order(self, op, a, b)
        result = original(self, other) if result is None else result
        lost = data - _free_symbols(result)
        if op.__name__ in _RELATIONS and _decided_for_finite(op, a, b):
            lost = data  # (``k >= k``, ``k + 1 > k``: sympy's answer, wrong for a NaN or an infinity)
        if any(not math.isfinite(float(values.get(s, 0.0))) for s in lost):
            raise TracingError(
                f"dtcompile.jit: {a} {op.__name__} {b}, on floats read from tensor data, one of them NaN or "
                "infinite, is simplified as if they were finite: it cannot be compiled exactly"
            )
        folded(shape_env).update(lost)
        return result

    return method


def _decided_for_finite(op, a, b) -> bool:
    """Whether sympy decides ``a op b`` from the expressions alone, as it may for finite
    numbers only (``k >= k`` is True, False for a NaN; ``k + 1 > k``, False for inf)."""
    exprs = [_float_expr(x) if isinstance(x, _SYMBOLIC) or type(x) in (int, float) else None for x in (a, b)]
    if None in exprs:
        return False
    finite = {s: sympy.Dummy(finite=True, real=True) for e in exprs for s in e.free_symbols}
    return _RELATIONS[op.__name__](*(e.xreplace(finite) for e in exprs)) in (sympy.true, sympy.false)


def _negative_power(original):
    """A SymInt to a negative whole power, from the user's code: a float, as Python computes
    it, for a negative base too (torch's own asks that the base is not negative)."""

    def method(self, other):
        if type(other) is int and other < 0 and _from_user_code():
            return _in_python_order(self, operator.pow, self, other)
        return original(self, other)

    return method


def _by_a_float(original, op, reflected: bool):
    """A SymInt's ``//`` or ``%`` with a float, from the user's code: Python's float
    operation (torch's ``//`` is ``floor(n / f)``: 10.0 for ``1 // 0.1``, where Python's is
    9.0; its ``%`` an integer's)."""

    def method(self, other):
        if type(other) is float and _from_user_code():
            a, b = (other, self) if reflected else (self, other)
            found = _in_python_order(self, op, a, b)
            if found is not None:
                return found
        return original(self, other)

    return method


def _rounded(original):
    """``round(n, k)`` of a SymInt with ``k < 0``, from the user's code: Python's, on its
    value (torch's returns ``n`` itself whatever ``k``); ``int(n)`` guards on it."""

    def method(self, ndigits=None):
        if ndigits is not None and ndigits < 0 and _from_user_code():
            return round(int(self), ndigits)
        return original(self, ndigits)

    return method


def _shift(original, reflected: bool):
    """A SymInt's ``<<`` or ``>>`` from the user's code: a negative count raises Python's
    ``ValueError`` (torch's computes ``n * 2 ** m``, a float). The count's sign is a branch
    on its value: traced as taken, checked at each call."""

    def method(self, other):
        count = self if reflected else other
        if isinstance(count, torch.SymInt) and _from_user_code() and count < 0:
            raise ValueError("negative shift count")
        return original(self, other)

    return method


_INT_METHODS = {
    "__pow__": _negative_power,
    "__floordiv__": lambda original: _by_a_float(original, operator.floordiv, False),
    "__rfloordiv__": lambda original: _by_a_float(original, operator.floordiv, True),
    "__mod__": lambda original: _by_a_float(original, operator.mod, False),
    "__rmod__": lambda original: _by_a_float(original, operator.mod, True),
    "__round__": _rounded,
    "__lshift__": lambda original: _shift(original, False),
    "__rshift__": lambda original: _shift(original, False),
    "__rlshift__": lambda original: _shift(original, True),
    "__rrshift__": lambda original: _shift(original, True),
}


class DataZeroDivisionError(RuntimeError, ZeroDivisionError):
    """A size or branch that divides by a number read from tensor data that is zero
    (``x.split(k)`` with ``k == 0``): eager raises too, in the op or in Python."""


def _nonzero(original):
    def guard(node, *args):
        try:
            return original(node, *args)
        except ZeroDivisionError as error:
            raise DataZeroDivisionError(
                f"dtcompile.jit: {node.expr} divides by a number read from tensor data that is zero in this "
                "call; eager raises here too (in the op that asked, or in Python)"
            ) from error

    return guard


def _signed(original):  # float(k), and torch.tensor(k) from C++: -0.0 read from data kept
    def guard_float(node, *args):
        negative = node.shape_env is not None and node._expr in negative_zeros(node.shape_env)  # not replaced
        value = original(node, *args)  # guards on the value, as it does
        return -0.0 if negative and value == 0.0 else value

    return guard_float


def _in_python_order(self, op, a, b):
    """``a op b`` as one float operation (``symbolic.python_float``) where it has symbols;
    None where sympy's own is kept (comparisons, ``//`` and ``%`` but of a data float, ``**`` but
    a data float's to a whole number, a literal 0 divisor)."""
    names = ("add", "sub", "mul", "truediv", "pow", "mod", "floordiv")
    if op.__name__ not in names:
        return None
    if not (_free_symbols(a) or _free_symbols(b)):  # (specialized: its value, as Python computes with it)
        return op(*map(as_constant, (a, b))) if {type(a), type(b)} & set(_SYMBOLIC) else None
    floats = _data_floats(a) or _data_floats(b) or {float, torch.SymFloat} & {type(a), type(b)}
    if op in (operator.mod, operator.floordiv) and (not floats or (not isinstance(b, _SYMBOLIC) and b == 0)):
        return None  # (an int's is sympy's; by a literal zero: eager's ZeroDivisionError)
    data_base = _data_floats(a) or (isinstance(a, torch.SymInt) and type(b) is int and b < 0)  # (``n ** -1``)
    if op is operator.pow and not (data_base and type(b) in (int, float) and float(b).is_integer()):
        return None  # (a fractional power of a negative float is complex: torch's own, which asks a >= 0)
    if op is operator.truediv and not isinstance(b, _SYMBOLIC) and b == 0:
        return None  # sympy's own error, as eager raises ZeroDivisionError
    if not all(isinstance(x, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(x, bool) for x in (a, b)):
        return None
    expr = python_float(op.__name__, *(_float_expr(x) for x in (a, b)))
    hints = [x.node.hint if isinstance(x, _SYMBOLIC) else x for x in (a, b)]
    hint = None if any(h is None for h in hints) else op(float(hints[0]), float(hints[1]))
    return torch.SymFloat(SymNode(expr, self.node.shape_env, float, hint))


def _float_expr(x):
    if isinstance(x, torch.SymFloat):
        return x.node.expr
    if isinstance(x, torch.SymInt):
        return ToFloat(x.node.expr)
    return sympy.Float(float(x))


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _free_symbols(x) -> set:
    return set(x.node.expr.free_symbols) if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) else set()


def _data_floats(x) -> set:
    return {s for s in _free_symbols(x) if symbol_is_type(s, SymT.UNBACKED_FLOAT)}


def _real(x, values):
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        value = x.node.expr.xreplace(values)
        kind = float if isinstance(x, torch.SymFloat) else int if isinstance(x, torch.SymInt) else bool
        return kind(value)
    return x
