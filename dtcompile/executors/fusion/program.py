"""The fusion program: what one region of a per-rank trace computes, in a small set of
primitives that both fusion backends implement.

A program has inputs (tensors, described by dtype, rank, broadcast dims, contiguity and
stride order; and numbers, the sizes a symbolic trace computes), a list of primitive
ops over named values, and outputs, each with the dim order its memory must have. Its
text is its identity: two regions with the same text compute the same thing from inputs
of the same kind, so the backends cache compiled fusions by it.

The primitives are nvFuser's names (``fd.ops.<name>``):

- elementwise: ``UNARY``, ``BINARY``, ``where``, ``cast``;
- reductions over dims, with ``keepdim``: ``sum``, ``max``, ``min`` (no promotion: the
  translation casts first);
- shapes: ``broadcast`` (insert size-1 dims), ``reshape``, ``permute``, ``squeeze``,
  ``expand``, ``size`` (a dim's size, a number), ``full``;
- ``set``: a copy (for an output that would otherwise alias an input or another output);
- ``matmul``.

Arguments are :class:`Ref` (a value of the program) or constants: numbers, dtypes, and
lists of dims or of sizes (ints or :class:`Ref` to numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...core.proxy import DTYPE_ABBREVIATIONS

UNARY = (
    "neg",
    "abs",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "tanh",
    "sigmoid",
    "erf",
    "sin",
    "cos",
    "sign",
    "logical_not",
)
BINARY = (
    "add",
    "sub",
    "mul",
    "div",
    "pow",
    "maximum",
    "minimum",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
)


@dataclass(frozen=True)
class Ref:
    """A value of the program, by name."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class TensorInput:
    """A tensor the fusion reads. ``broadcast`` marks size-1 dims; ``contiguity`` and
    ``stride_order`` are nvFuser's description of its strides."""

    name: str
    dtype: torch.dtype
    broadcast: tuple[bool, ...]
    contiguity: tuple[bool | None, ...]
    stride_order: tuple[int, ...]

    @property
    def rank(self) -> int:
        return len(self.broadcast)

    def __str__(self) -> str:
        sizes = ", ".join("1" if b else "?" for b in self.broadcast)
        return (
            f"{self.name}: {_dtype(self.dtype)}[{sizes}] contiguity={self.contiguity} stride_order={self.stride_order}"
        )


@dataclass(frozen=True)
class NumberInput:
    """A number the trace computes at run time (a size under symbolic values, or a float
    made from sizes): ``kind`` is its Python type's name, ``int``, ``float`` or ``bool``."""

    name: str
    kind: str = "int"

    def __str__(self) -> str:
        return f"{self.name}: {self.kind}"


@dataclass(frozen=True)
class Op:
    """``out = primitive(*args)``; ``dtype`` is the result's (None for numbers)."""

    out: str
    primitive: str
    args: tuple
    dtype: torch.dtype | None

    def __str__(self) -> str:
        args = ", ".join(_text(a) for a in self.args)
        kind = "" if self.dtype is None else f"  # {_dtype(self.dtype)}"
        return f"{self.out} = {self.primitive}({args}){kind}"


@dataclass(frozen=True)
class Output:
    """A value the fusion returns, laid out densely in ``order`` (outermost dim first)."""

    value: str
    order: tuple[int, ...]


@dataclass
class FusionProgram:
    inputs: list = field(default_factory=list)  # TensorInput | NumberInput
    ops: list[Op] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)

    def text(self) -> str:
        lines = [f"input {i}" for i in self.inputs]
        lines += [str(op) for op in self.ops]
        lines += [f"output {o.value} order={o.order}" for o in self.outputs]
        return "\n".join(lines)

    __str__ = text


def _dtype(dtype: torch.dtype) -> str:
    return DTYPE_ABBREVIATIONS.get(dtype, str(dtype).removeprefix("torch."))


def _text(arg) -> str:
    if isinstance(arg, torch.dtype):
        return _dtype(arg)
    if isinstance(arg, (list, tuple)):
        return "[" + ", ".join(_text(a) for a in arg) + "]"
    return str(arg) if isinstance(arg, Ref) else repr(arg)
