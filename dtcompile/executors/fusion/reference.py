"""The reference backend: a fusion program run op by op with torch.

It runs anywhere torch runs, so the region forming, the op translation, the layouts and
the symbolic sizes of the nvFuser executor are tested on CPU. The program becomes a
Python function (printable, like every program dtcompile runs); each primitive is the
torch op with nvFuser's meaning.
"""

from __future__ import annotations

import torch

from ...core.codegen import compile_function
from .program import BINARY, UNARY, FusionProgram, Op, Ref

name = "reference"

# Binary primitives whose operands may be Python numbers on either side: Python's operators.
_OPERATORS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**"}
_COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def available() -> tuple[bool, str]:
    return True, "runs the fusions op by op with torch"


def supports_device(device) -> bool:
    return True


def _arg(value) -> str:
    if isinstance(value, Ref):
        return value.name
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_arg(v) for v in value) + "]"
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return f"float({str(value)!r})"
    return repr(value)


def _statement(op: Op) -> str:
    p, args = op.primitive, op.args
    a = [_arg(x) for x in args]
    if p in UNARY:
        return f"torch.{p}({a[0]})"
    if p in _OPERATORS:
        return f"({a[0]} {_OPERATORS[p]} {a[1]})"
    if p in _COMPARISONS:
        return f"({a[0]} {_COMPARISONS[p]} {a[1]})"
    if p in ("maximum", "minimum"):
        tensor, other = (args[0], args[1]) if isinstance(args[0], Ref) else (args[1], args[0])
        if isinstance(other, Ref):
            return f"torch.{p}({a[0]}, {a[1]})"
        bound = "min" if p == "maximum" else "max"
        return f"torch.clamp({_arg(tensor)}, {bound}={_arg(other)})"
    if p in BINARY:
        return f"torch.{p}({a[0]}, {a[1]})"
    if p == "where":
        return f"torch.where({a[0]}, {a[1]}, {a[2]})"
    if p == "cast":
        return f"{a[0]}.to({args[1]})"
    if p == "sum":
        return f"torch.sum({a[0]}, {a[1]}, keepdim={args[2]}, dtype={op.dtype})"
    if p in ("max", "min"):
        return f"extreme(torch.a{p}, {a[0]}, {a[1]}, {args[2]})"
    if p == "broadcast":
        index = ", ".join("None" if new else ":" for new in args[1])
        return f"{a[0]}[{index}]"
    if p == "reshape":
        return f"torch.reshape({a[0]}, {a[1]})"
    if p == "permute":
        return f"{a[0]}.permute({a[1]})"
    if p == "squeeze":
        return f"{a[0]}.squeeze({tuple(args[1])!r})"
    if p == "expand":
        return f"{a[0]}.expand({a[1]})"
    if p == "size":
        return f"{a[0]}.shape[{a[1]}]"
    if p == "full":
        return f"torch.full({a[0]}, {a[1]}, dtype={args[2]}, device={a[3]})"
    if p == "set":
        return f"{a[0]}.clone()"
    if p == "matmul":
        return f"torch.matmul({a[0]}, {a[1]})"
    raise NotImplementedError(f"reference backend: no primitive {p}")


def _extreme(amax_or_amin, x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """A max or min reduction as nvFuser's: over no element, the reduction's identity
    (a softmax over an empty dim is empty), where torch's raises."""
    if all(x.shape[d] for d in dims):
        return amax_or_amin(x, dims, keepdim=keepdim)
    shape = [1 if d in dims else n for d, n in enumerate(x.shape) if keepdim or d not in dims]
    maximum = amax_or_amin is torch.amax
    if x.dtype.is_floating_point:
        identity = -float("inf") if maximum else float("inf")
    else:
        identity = torch.iinfo(x.dtype).min if maximum else torch.iinfo(x.dtype).max
    return torch.full(shape, identity, dtype=x.dtype, device=x.device)


def source(program: FusionProgram, fn_name: str = "fusion") -> str:
    """The Python function that runs ``program``."""
    lines = [f"def {fn_name}({', '.join(i.name for i in program.inputs)}):"]
    lines += [f"    {op.out} = {_statement(op)}" for op in program.ops]
    outputs = "".join(f"{o.value}, " for o in program.outputs)
    lines.append(f"    return ({outputs})")
    return "\n".join(lines) + "\n"


class ReferenceFusion:
    """A compiled program: call it with the inputs, get the outputs (unrestrided)."""

    def __init__(self, program: FusionProgram):
        self.source = source(program)
        self.fn = compile_function(self.source, "fusion", {"torch": torch, "extreme": _extreme})

    def __call__(self, inputs):
        return self.fn(*inputs)


def compile(program: FusionProgram) -> ReferenceFusion:
    return ReferenceFusion(program)
