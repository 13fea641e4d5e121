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

from collections.abc import Callable
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


def result_rank(op: Op, rank_of: Callable[[str], int | None]) -> int:
    """The rank of ``op``'s result (0 for a number), from its operands' ranks
    (``rank_of(name)``: a value's rank, None for a number)."""
    tensors = [rank_of(a.name) for a in op.args if isinstance(a, Ref) and rank_of(a.name) is not None]
    if op.dtype is None:
        return 0
    if op.primitive in ("sum", "max", "min"):
        return tensors[0] if op.args[2] else tensors[0] - len(op.args[1])
    if op.primitive in ("broadcast", "reshape", "expand"):
        return len(op.args[1])
    if op.primitive == "full":
        return len(op.args[0])
    if op.primitive == "squeeze":
        return tensors[0] - len(op.args[1])
    return max(tensors, default=0)


def value_kinds(program: FusionProgram) -> dict[str, tuple[torch.dtype | None, int]]:
    """``(dtype, rank)`` of every value of the program (dtype None and rank 0: a number)."""
    kinds: dict[str, tuple[torch.dtype | None, int]] = {}
    for i in program.inputs:
        kinds[i.name] = (i.dtype, i.rank) if isinstance(i, TensorInput) else (None, 0)

    def rank_of(name: str) -> int | None:
        dtype, rank = kinds[name]
        return None if dtype is None else rank

    for op in program.ops:
        kinds[op.out] = (op.dtype, result_rank(op, rank_of))
    return kinds


# --- as data: programs cross between Python environments as JSON, never as pickles ------


def _arg_data(arg):
    if isinstance(arg, Ref):
        return {"ref": arg.name}
    if isinstance(arg, torch.dtype):
        return {"dtype": str(arg).removeprefix("torch.")}
    if isinstance(arg, (list, tuple)):
        return [_arg_data(a) for a in arg]
    return arg


def _arg_from_data(data):
    if isinstance(data, dict):
        return Ref(data["ref"]) if "ref" in data else getattr(torch, data["dtype"])
    if isinstance(data, list):
        return [_arg_from_data(d) for d in data]
    return data


def _dtype_data(dtype: torch.dtype | None):
    return None if dtype is None else str(dtype).removeprefix("torch.")


def program_to_data(program: FusionProgram) -> dict:
    """The program as JSON-able data (``program_from_data`` reads it back)."""
    inputs = []
    for i in program.inputs:
        if isinstance(i, TensorInput):
            inputs.append(
                {
                    "tensor": i.name,
                    "dtype": _dtype_data(i.dtype),
                    "broadcast": list(i.broadcast),
                    "contiguity": list(i.contiguity),
                    "stride_order": list(i.stride_order),
                }
            )
        else:
            inputs.append({"number": i.name, "kind": i.kind})
    ops = [
        {"out": op.out, "primitive": op.primitive, "args": _arg_data(list(op.args)), "dtype": _dtype_data(op.dtype)}
        for op in program.ops
    ]
    outputs = [{"value": o.value, "order": list(o.order)} for o in program.outputs]
    return {"inputs": inputs, "ops": ops, "outputs": outputs}


def program_from_data(data: dict) -> FusionProgram:
    inputs = []
    for i in data["inputs"]:
        if "tensor" in i:
            dtype = getattr(torch, i["dtype"])
            inputs.append(
                TensorInput(i["tensor"], dtype, tuple(i["broadcast"]), tuple(i["contiguity"]), tuple(i["stride_order"]))
            )
        else:
            inputs.append(NumberInput(i["number"], i["kind"]))
    ops = [
        Op(
            o["out"],
            o["primitive"],
            tuple(_arg_from_data(o["args"])),
            None if o["dtype"] is None else getattr(torch, o["dtype"]),
        )
        for o in data["ops"]
    ]
    outputs = [Output(o["value"], tuple(o["order"])) for o in data["outputs"]]
    return FusionProgram(inputs, ops, outputs)
