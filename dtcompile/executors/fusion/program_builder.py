"""Building one fusion program, op by op (the ``Translator``), and the registry of op
translations (``handles``) that the ``ops_*`` modules fill; ``translate.py`` uses them.

Each translated op computes in the precision eager computes in: low-precision floats
(float16, bfloat16) are cast to float32 before the math and the result cast back, as
aten's kernels do; composite ops (softmax, layer norm, GELU, their backwards) are written
out in primitives and keep their intermediates in float32. The result of every op has
the traced dtype, so the values a fusion returns are what the trace says they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core import BoundSymbol, NumberProxy, TensorProxy
from ...core.symbolic import as_constant
from .layout import dense_order, tensor_descriptor
from .program import FusionProgram, NumberInput, Op, Output, Ref, TensorInput, result_rank

aten = torch.ops.aten
LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = frozenset(
    {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.bool}
)
ALIASING = ("broadcast", "reshape", "permute", "squeeze", "expand")  # may return a view of their input
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not")


def _is_one(size) -> bool:
    size = as_constant(size)
    return isinstance(size, int) and size == 1


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype eager's kernels do the math in for a result of ``dtype``."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


class Translator:
    """Builds the fusion program of one region, op by op."""

    def __init__(self):
        self.program = FusionProgram()
        self.values: dict[str, Ref] = {}  # trace label -> program value
        self.dtypes: dict[str, torch.dtype | None] = {}  # program value -> dtype (None: a number)
        self.ranks: dict[str, int] = {}  # program value -> rank (0: a number)
        self.proxies: dict[str, TensorProxy] = {}  # program value -> the traced tensor it is
        self.input_labels: list[str] = []  # the trace's values the program reads, in input order

    def value(self, arg):
        """The program value of a trace argument (a new input on first sight), or the
        argument itself for a constant."""
        if isinstance(arg, (list, tuple)):
            return [self.value(a) for a in arg]
        if not isinstance(arg, (TensorProxy, NumberProxy)):
            return as_constant(arg)
        if arg.label not in self.values:
            name = f"in{len(self.program.inputs)}"
            if isinstance(arg, TensorProxy):
                # A symbolic size is never 1 (sizes 0 and 1 are specialized): plain bools,
                # not SymBools, which would ask the ShapeEnv at every use.
                broadcast = tuple(_is_one(s) for s in arg.shape)
                layout = tensor_descriptor(arg.shape, arg.stride())
                self.program.inputs.append(TensorInput(name, arg.dtype, broadcast, *layout))
                self.proxies[name] = arg
            else:
                self.program.inputs.append(NumberInput(name, number_kind(arg.expr)))
            self.input_labels.append(arg.label)
            self.values[arg.label] = Ref(name)
            self.dtypes[name] = arg.dtype if isinstance(arg, TensorProxy) else None
            self.ranks[name] = arg.dim() if isinstance(arg, TensorProxy) else 0
        return self.values[arg.label]

    def emit(self, primitive: str, *args, dtype: torch.dtype | None) -> Ref:
        ref = Ref(f"v{len(self.program.ops)}")
        op = Op(ref.name, primitive, args, dtype)
        self.program.ops.append(op)
        self.dtypes[ref.name] = dtype
        self.ranks[ref.name] = self._result_rank(op)
        return ref

    def _result_rank(self, op: Op) -> int:
        return result_rank(op, lambda name: None if self.dtypes[name] is None else self.ranks[name])

    def bind(self, proxy: TensorProxy, ref: Ref) -> None:
        """``ref`` is the traced ``proxy`` (cast to its dtype if it is not yet)."""
        ref = self.cast(ref, proxy.dtype)
        self.values[proxy.label] = ref
        self.proxies[ref.name] = proxy

    def output(self, proxy: TensorProxy) -> None:
        """Return the traced ``proxy`` from the fusion, in its traced layout, in memory of
        its own: a value that may view an input, or the memory of a value returned
        already, is copied first."""
        order = dense_order(proxy.shape, proxy.stride())
        assert order is not None, f"{proxy.label} has no dense layout; its op should not have been fused"
        ref = self.values[proxy.label]
        root = self._memory_of(ref)
        returned = {self._memory_of(Ref(o.value)) for o in self.program.outputs}
        if root in returned or any(i.name == root for i in self.program.inputs):
            ref = self.emit("set", ref, dtype=self.dtype(ref))
        self.program.outputs.append(Output(ref.name, order))

    def _memory_of(self, ref: Ref) -> str:
        """The value whose memory ``ref`` may be a view of (itself if none)."""
        producers = {op.out: op for op in self.program.ops}
        while ref.name in producers and producers[ref.name].primitive in ALIASING:
            ref = producers[ref.name].args[0]
        return ref.name

    # --- helpers for the handlers ------------------------------------------------------------

    def dtype(self, value) -> torch.dtype | None:
        return self.dtypes[value.name] if isinstance(value, Ref) else None

    def rank(self, value: Ref) -> int:
        return self.ranks[value.name]

    def cast(self, value, dtype: torch.dtype):
        """``value`` as a tensor of ``dtype``. Numbers (constants, and sizes the fusion
        reads) stay numbers: eager combines a Python number with a tensor in the tensor's
        dtype, so casting one would only make it a tensor of the wrong rank."""
        if not isinstance(value, Ref) or self.dtypes[value.name] in (dtype, None):
            return value
        cast = self.emit("cast", value, dtype, dtype=dtype)
        if value.name in self.proxies:  # the same sizes: ``size`` may read them from the cast
            self.proxies[cast.name] = self.proxies[value.name]
        return cast

    def size(self, value: Ref, dim: int):
        """A size of a traced value: an int when it is constant, else a number the fusion
        reads from the tensor at run time."""
        size = as_constant(self.proxies[value.name].shape[dim])
        return size if isinstance(size, int) else self.emit("size", value, dim, dtype=None)

    def sizes(self, value: Ref) -> list:
        return [self.size(value, d) for d in range(self.rank(value))]

    def numel(self, value: Ref, dims) -> object:
        """The number of elements ``dims`` of a traced value span: an int or a number."""
        count = None
        for d in dims:
            size = self.size(value, d)
            if count is None:
                count = size
            elif isinstance(size, int) and isinstance(count, int):
                count *= size
            else:
                count = self.emit("mul", count, size, dtype=None)
        return 1 if count is None else count

    def op(self, primitive: str, *args, dtype: torch.dtype) -> Ref:
        """An elementwise primitive whose result has ``dtype`` (bool for comparisons);
        operands of lower rank get leading broadcast dims, as eager broadcasts them."""
        top = max(self.rank(a) if isinstance(a, Ref) else 0 for a in args)
        args = tuple(self._to_rank(a, top) for a in args)
        return self.emit(primitive, *args, dtype=torch.bool if primitive in COMPARISONS else dtype)

    def _to_rank(self, value, rank: int):
        if not isinstance(value, Ref) or self.dtypes[value.name] is None or self.rank(value) == rank:
            return value
        have = self.rank(value)
        return self.emit("broadcast", value, [True] * (rank - have) + [False] * have, dtype=self.dtype(value))

    def math(self, primitive: str, *args, dtype: torch.dtype) -> Ref:
        """``primitive`` on ``args`` cast to ``dtype`` (tensors only; constants stay)."""
        return self.op(primitive, *(self.cast(a, dtype) for a in args), dtype=dtype)

    def reduce(self, primitive: str, value: Ref, dims, keepdim: bool) -> Ref:
        """A reduction over ``dims``; over none (a 0-d tensor), the value itself."""
        if not dims:
            return value
        return self.emit(primitive, value, list(dims), keepdim, dtype=self.dtype(value))


def number_kind(expr) -> str:
    """``int``, ``float`` or ``bool``: the Python type of a number the trace computes,
    from its symbolic expression (sizes are integers; ``s0 ** 0.5`` is a float)."""
    if getattr(expr, "is_Boolean", False):
        return "bool"
    return "int" if getattr(expr, "is_integer", False) else "float"


# --- the registry ---------------------------------------------------------------------------

Handler = Callable[[Translator, BoundSymbol], object]
HANDLERS: dict[object, tuple[Handler, Callable[[BoundSymbol], bool] | None]] = {}


def handles(*ops, check: Callable[[BoundSymbol], bool] | None = None):
    """Register the decorated function as the translation of ``ops``; ``check`` says
    whether a call's arguments are ones the translation covers."""

    def register(fn: Handler) -> Handler:
        for op in ops:
            HANDLERS[op] = (fn, check)
        return fn

    return register


def argument(bsym: BoundSymbol, name: str, position: int, default=None):
    """An argument of a call, given by keyword or at ``position``."""
    if name in bsym.kwargs:
        return bsym.kwargs[name]
    return bsym.args[position] if len(bsym.args) > position else default


def normalized_dims(dims, rank: int) -> list[int]:
    """Reduction dims as sorted non-negative ints (None or [] meaning all)."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return sorted(d % rank for d in dims) if rank else []  # a 0-d tensor has no dim to reduce


def operand_dtype(bsym: BoundSymbol) -> torch.dtype:
    """The dtype the operands of a comparison meet in (type promotion, as eager)."""
    fakes = [a.fake if isinstance(a, TensorProxy) else a for a in bsym.args[:2]]
    return torch.result_type(*fakes) if len(fakes) == 2 else fakes[0].dtype
