"""Python source for the values that appear in traces."""

from __future__ import annotations

import math

import torch

from .proxy import is_proxy
from .symbolic import SYMBOLIC_TYPES, as_constant, symbolic_expr


class Unprintable(TypeError):
    """A trace value that has no Python literal (an object the program must be given)."""


class NamedConstant:
    """An argument with no literal (a ``torch.Generator``): the trace names it, and the
    compiled program is given the object under that name."""

    __slots__ = ("label", "value")

    def __init__(self, label: str, value: object):
        self.label = label
        self.value = value

    def __repr__(self) -> str:
        return f"NamedConstant({self.label} = {self.value!r})"


def python_literal(value: object) -> str:
    """The source text that evaluates to ``value`` in a trace's globals."""
    if is_proxy(value) or isinstance(value, NamedConstant):
        return value.label
    if isinstance(value, SYMBOLIC_TYPES):
        # A size of a trace recorded under symbolic values, before its sizes are computed
        # in the trace (``materialize_sizes``): printed as its expression (``2*s26``), so
        # that the recorded trace prints; it only runs once numbers of the trace replace it.
        constant = as_constant(value)
        return str(symbolic_expr(value)) if constant is value else python_literal(constant)
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        if math.isnan(value):  # with its sign (``inf - inf`` has it set; ``copysign`` reads it)
            return "-float('nan')" if math.copysign(1.0, value) < 0 else "float('nan')"
        if math.isinf(value):
            return f"float('{value}')"
        return repr(value)
    if isinstance(value, complex):
        return f"complex({python_literal(value.real)}, {python_literal(value.imag)})"
    if isinstance(value, torch.Size):
        # A torch.Size, not a list: a returned or guarded Size must stay a Size.
        return "torch.Size([" + ", ".join(python_literal(v) for v in value) + "])"
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(python_literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)  # torch.float32, torch.strided, torch.contiguous_format
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    raise Unprintable(f"no Python literal for {type(value).__name__} {value!r}")


def call_source(callee: str, args: tuple, kwargs: dict) -> str:
    """``callee(a, b, key=c)`` with every argument printed as a literal."""
    parts = [python_literal(a) for a in args]
    parts += [f"{k}={python_literal(v)}" for k, v in kwargs.items()]
    return f"{callee}({', '.join(parts)})"


def output_target(output: object) -> str:
    """The left-hand side that binds an op's output: ``t3`` or ``t3, t4``; ``_`` for none."""
    if is_proxy(output):
        return output.label
    if isinstance(output, (tuple, list)):
        names = [o.label if is_proxy(o) else "_" for o in output]
        if not names:
            return "_"
        return names[0] + "," if len(names) == 1 else ", ".join(names)
    return "_"
