"""From aten ops of a per-rank trace to the primitives of a fusion program.

Each translated op computes in the precision eager computes in: low-precision floats
(float16, bfloat16) are cast to float32 before the math and the result cast back, as
aten's kernels do; composite ops (softmax, layer norm, GELU, their backwards) are written
out in primitives and keep their intermediates in float32. The result of every op has
the traced dtype, so the values a fusion returns are what the trace says they are.

``HANDLERS`` maps each aten op to its translation, and an optional check of its
arguments: an op whose arguments the translation does not cover is left to the next
executor, which makes it a region boundary.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...core import BoundSymbol, NumberProxy, TensorProxy
from ...core.symbolic import as_constant
from .layout import dense_order, tensor_descriptor
from .program import FusionProgram, NumberInput, Op, Output, Ref, TensorInput

aten = torch.ops.aten
LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = frozenset(
    {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.bool}
)
ALIASING = ("broadcast", "reshape", "permute", "squeeze", "expand")  # may return a view of their input
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not")


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
                broadcast = tuple(as_constant(s) == 1 for s in arg.shape)
                layout = tensor_descriptor(arg.shape, arg.stride())
                self.program.inputs.append(TensorInput(name, arg.dtype, broadcast, *layout))
                self.proxies[name] = arg
            else:
                self.program.inputs.append(NumberInput(name))
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
        tensors = [self.ranks[a.name] for a in op.args if isinstance(a, Ref) and self.dtypes[a.name] is not None]
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
        if not isinstance(value, Ref) or self.dtypes[value.name] == dtype:
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
        return self.emit(primitive, value, list(dims), keepdim, dtype=self.dtype(value))


# --- the op table -------------------------------------------------------------------------

Handler = Callable[[Translator, BoundSymbol], object]
HANDLERS: dict[object, tuple[Handler, Callable[[BoundSymbol], bool] | None]] = {}
VIEWS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.expand.default,
    }
)
MATMUL_OPS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default})


def handles(*ops, check: Callable[[BoundSymbol], bool] | None = None):
    def register(fn: Handler) -> Handler:
        for op in ops:
            HANDLERS[op] = (fn, check)
        return fn

    return register


def translatable(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` is an op the translation covers, with arguments it covers."""
    entry = HANDLERS.get(bsym.op)
    if entry is None:
        return False
    tensors = bsym.input_tensors() + bsym.output_tensors()
    if not bsym.output_tensors() or any(t.dtype not in SUPPORTED_DTYPES for t in tensors):
        return False
    _, check = entry
    return check is None or check(bsym)


def translate(region: list[BoundSymbol], outputs: list[TensorProxy]) -> tuple[FusionProgram, list[str]]:
    """The fusion program of ``region`` returning ``outputs``, and the labels of the trace
    values it takes as inputs, in order."""
    t = Translator()
    for bsym in region:
        fn, _ = HANDLERS[bsym.op]
        results = fn(t, bsym)
        proxies = bsym.output if isinstance(bsym.output, (tuple, list)) else (bsym.output,)
        results = results if isinstance(results, (tuple, list)) else (results,)
        for proxy, ref in zip(proxies, results):
            if isinstance(proxy, TensorProxy) and ref is not None:
                t.bind(proxy, ref)
    for proxy in outputs:
        t.output(proxy)
    return t.program, t.input_labels


def _kw(bsym: BoundSymbol, name: str, position: int, default=None):
    if name in bsym.kwargs:
        return bsym.kwargs[name]
    return bsym.args[position] if len(bsym.args) > position else default


def _dims(dims, rank: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return sorted(d % rank for d in dims) if rank else []  # a 0-d tensor has no dim to reduce


def _operand_dtype(bsym: BoundSymbol) -> torch.dtype:
    """The dtype the operands of a comparison meet in (type promotion, as eager)."""
    fakes = [a.fake if isinstance(a, TensorProxy) else a for a in bsym.args[:2]]
    return torch.result_type(*fakes) if len(fakes) == 2 else fakes[0].dtype


# --- elementwise ----------------------------------------------------------------------------

_UNARY = {
    aten.neg.default: "neg",
    aten.abs.default: "abs",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.reciprocal.default: "reciprocal",
    aten.tanh.default: "tanh",
    aten.sigmoid.default: "sigmoid",
    aten.erf.default: "erf",
    aten.sin.default: "sin",
    aten.cos.default: "cos",
    aten.sgn.default: "sign",
    aten.sign.default: "sign",
}
_BINARY = {
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.div.Tensor: "div",
    aten.div.Scalar: "div",
    aten.pow.Tensor_Scalar: "pow",
    aten.pow.Tensor_Tensor: "pow",
    aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
}
_COMPARE = {
    **{getattr(aten, n).Tensor: n for n in ("eq", "ne", "lt", "le", "gt", "ge")},
    **{getattr(aten, n).Scalar: n for n in ("eq", "ne", "lt", "le", "gt", "ge")},
}
_LOGICAL = {aten.logical_and.default: "logical_and", aten.logical_or.default: "logical_or"}


def _no_kwargs(bsym: BoundSymbol) -> bool:
    return not bsym.kwargs


@handles(*_UNARY, check=_no_kwargs)
def _unary(t: Translator, bsym: BoundSymbol):
    out = bsym.output
    return t.math(_UNARY[bsym.op], t.value(bsym.args[0]), dtype=compute_dtype(out.dtype))


@handles(*_BINARY, check=_no_kwargs)
def _binary(t: Translator, bsym: BoundSymbol):
    a, b = (t.value(x) for x in bsym.args[:2])
    return t.math(_BINARY[bsym.op], a, b, dtype=compute_dtype(bsym.output.dtype))


@handles(*_COMPARE)
def _compare(t: Translator, bsym: BoundSymbol):
    a, b = (t.value(x) for x in bsym.args[:2])
    # In the operands' common dtype, not in float32: a scalar is rounded to it, as eager does.
    return t.math(_COMPARE[bsym.op], a, b, dtype=_operand_dtype(bsym))


@handles(*_LOGICAL)
def _logical(t: Translator, bsym: BoundSymbol):
    a, b = (t.cast(t.value(x), torch.bool) for x in bsym.args[:2])
    return t.op(_LOGICAL[bsym.op], a, b, dtype=torch.bool)


@handles(aten.logical_not.default)
def _logical_not(t: Translator, bsym: BoundSymbol):
    return t.op("logical_not", t.cast(t.value(bsym.args[0]), torch.bool), dtype=torch.bool)


def _scaled(t: Translator, value, alpha, dtype):
    if alpha == 1:
        return value
    return value * alpha if not isinstance(value, Ref) else t.math("mul", value, alpha, dtype=dtype)


@handles(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar)
def _add_sub(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    a, b = (t.value(x) for x in bsym.args[:2])
    b = _scaled(t, t.cast(b, dtype), as_constant(_kw(bsym, "alpha", 2, 1)), dtype)
    primitive = "add" if bsym.op in (aten.add.Tensor, aten.add.Scalar) else "sub"
    return t.math(primitive, a, b, dtype=dtype)


@handles(aten.rsub.Scalar)
def _rsub(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    a = _scaled(t, t.cast(t.value(bsym.args[0]), dtype), as_constant(_kw(bsym, "alpha", 2, 1)), dtype)
    return t.math("sub", as_constant(bsym.args[1]), a, dtype=dtype)


@handles(aten.relu.default)
def _relu(t: Translator, bsym: BoundSymbol):
    return t.math("maximum", t.value(bsym.args[0]), 0, dtype=compute_dtype(bsym.output.dtype))


@handles(aten.clamp.default)
def _clamp(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(t.value(bsym.args[0]), dtype)
    low, high = _kw(bsym, "min", 1), _kw(bsym, "max", 2)
    if low is not None:
        x = t.op("maximum", x, low, dtype=dtype)
    if high is not None:
        x = t.op("minimum", x, high, dtype=dtype)
    return x


@handles(aten.where.self)
def _where(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    condition = t.cast(t.value(bsym.args[0]), torch.bool)
    a, b = (t.cast(t.value(x), dtype) for x in bsym.args[1:3])
    return t.op("where", condition, a, b, dtype=dtype)


@handles(aten.masked_fill.Scalar)
def _masked_fill(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(t.value(bsym.args[0]), dtype)
    mask = t.cast(t.value(bsym.args[1]), torch.bool)
    return t.op("where", mask, as_constant(bsym.args[2]), x, dtype=dtype)


@handles(aten.gelu.default)
def _gelu(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(t.value(bsym.args[0]), dtype)
    if bsym.kwargs.get("approximate", "none") == "tanh":
        cube = t.op("mul", t.op("mul", x, x, dtype=dtype), x, dtype=dtype)
        inner = t.op(
            "mul",
            t.op("add", x, t.op("mul", cube, 0.044715, dtype=dtype), dtype=dtype),
            math.sqrt(2 / math.pi),
            dtype=dtype,
        )
        cdf = t.op("mul", t.op("add", t.op("tanh", inner, dtype=dtype), 1.0, dtype=dtype), 0.5, dtype=dtype)
    else:
        cdf = t.op(
            "mul",
            t.op("add", t.op("erf", t.op("mul", x, math.sqrt(0.5), dtype=dtype), dtype=dtype), 1.0, dtype=dtype),
            0.5,
            dtype=dtype,
        )
    return t.op("mul", x, cdf, dtype=dtype)


@handles(aten.gelu_backward.default, check=lambda b: b.kwargs.get("approximate", "none") == "none")
def _gelu_backward(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    grad, x = (t.cast(t.value(a), dtype) for a in bsym.args[:2])
    cdf = t.op(
        "mul",
        t.op("add", t.op("erf", t.op("mul", x, math.sqrt(0.5), dtype=dtype), dtype=dtype), 1.0, dtype=dtype),
        0.5,
        dtype=dtype,
    )
    square = t.op("mul", x, x, dtype=dtype)
    pdf = t.op(
        "mul", t.op("exp", t.op("mul", square, -0.5, dtype=dtype), dtype=dtype), 1 / math.sqrt(2 * math.pi), dtype=dtype
    )
    return t.op("mul", grad, t.op("add", cdf, t.op("mul", x, pdf, dtype=dtype), dtype=dtype), dtype=dtype)


@handles(aten.silu.default)
def _silu(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(t.value(bsym.args[0]), dtype)
    return t.op("mul", x, t.op("sigmoid", x, dtype=dtype), dtype=dtype)


@handles(aten.silu_backward.default)
def _silu_backward(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    grad, x = (t.cast(t.value(a), dtype) for a in bsym.args[:2])
    s = t.op("sigmoid", x, dtype=dtype)
    slope = t.op("add", t.op("mul", x, t.op("sub", 1.0, s, dtype=dtype), dtype=dtype), 1.0, dtype=dtype)
    return t.op("mul", t.op("mul", grad, s, dtype=dtype), slope, dtype=dtype)


@handles(aten.sigmoid_backward.default)
def _sigmoid_backward(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    grad, out = (t.cast(t.value(a), dtype) for a in bsym.args[:2])
    return t.op("mul", t.op("mul", grad, out, dtype=dtype), t.op("sub", 1.0, out, dtype=dtype), dtype=dtype)


@handles(aten.tanh_backward.default)
def _tanh_backward(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    grad, out = (t.cast(t.value(a), dtype) for a in bsym.args[:2])
    return t.op("mul", grad, t.op("sub", 1.0, t.op("mul", out, out, dtype=dtype), dtype=dtype), dtype=dtype)


@handles(aten.threshold_backward.default)
def _threshold_backward(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    grad = t.cast(t.value(bsym.args[0]), dtype)
    x = t.value(bsym.args[1])  # compared in its own dtype, as eager does
    return t.op("where", t.op("le", x, as_constant(bsym.args[2]), dtype=t.dtype(x)), 0.0, grad, dtype=dtype)


def _same_device(bsym: BoundSymbol) -> bool:
    source = bsym.args[0]
    allowed = {"dtype", "layout", "device", "memory_format", "non_blocking", "pin_memory"}
    return set(bsym.kwargs) <= allowed and bsym.output.device == source.device


@handles(aten._to_copy.default, aten.clone.default, check=_same_device)
def _copy(t: Translator, bsym: BoundSymbol):
    return t.cast(t.value(bsym.args[0]), bsym.output.dtype)


_FILL = {aten.ones_like.default: 1, aten.zeros_like.default: 0, aten.empty_like.default: 0}


@handles(*_FILL, aten.full_like.default, check=_same_device)
def _full_like(t: Translator, bsym: BoundSymbol):
    out = bsym.output
    value = _FILL[bsym.op] if bsym.op in _FILL else as_constant(bsym.args[1])
    x = t.value(bsym.args[0])
    return t.emit("full", t.sizes(x), value, out.dtype, str(out.device), dtype=out.dtype)


# --- reductions -----------------------------------------------------------------------------


def _plain_reduction(bsym: BoundSymbol) -> bool:
    return set(bsym.kwargs) <= {"dtype", "keepdim"}


@handles(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, check=_plain_reduction)
def _sum_mean(t: Translator, bsym: BoundSymbol):
    out = bsym.output
    x = t.value(bsym.args[0])
    default = bsym.op in (aten.sum.default, aten.mean.default)
    dims = _dims(None if default else bsym.args[1], t.rank(x))
    keepdim = False if default else bool(_kw(bsym, "keepdim", 2, False))
    dtype = compute_dtype(out.dtype)
    total = t.reduce("sum", t.cast(x, dtype), dims, keepdim)
    if bsym.op in (aten.mean.dim, aten.mean.default):
        total = t.op("div", total, t.numel(x, dims), dtype=dtype)
    return total


@handles(aten.amax.default, aten.amin.default)
def _amax_amin(t: Translator, bsym: BoundSymbol):
    x = t.value(bsym.args[0])
    dims = _dims(_kw(bsym, "dim", 1, []), t.rank(x))
    primitive = "max" if bsym.op is aten.amax.default else "min"
    return t.reduce(primitive, x, dims, bool(_kw(bsym, "keepdim", 2, False)))


@handles(aten.var.correction, check=lambda b: set(b.kwargs) <= {"correction", "keepdim"})
def _var(t: Translator, bsym: BoundSymbol):
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(t.value(bsym.args[0]), dtype)
    dims = _dims(_kw(bsym, "dim", 1, None), t.rank(x))
    correction = as_constant(bsym.kwargs.get("correction", 1))
    correction = 1 if correction is None else correction
    count = t.numel(x, dims)
    mean = t.op("div", t.reduce("sum", x, dims, True), count, dtype=dtype)
    centered = t.op("sub", x, mean, dtype=dtype)
    squares = t.reduce(
        "sum", t.op("mul", centered, centered, dtype=dtype), dims, bool(bsym.kwargs.get("keepdim", False))
    )
    divisor = count - correction if isinstance(count, int) else t.emit("sub", count, correction, dtype=None)
    return t.op("div", squares, divisor, dtype=dtype)


def _softmax_parts(t: Translator, x: Ref, dim: int, dtype):
    """``(x - max, exp of it, its sum)`` along ``dim``, kept as size-1 dims."""
    shifted = t.op("sub", x, t.reduce("max", x, [dim], True), dtype=dtype)
    exps = t.op("exp", shifted, dtype=dtype)
    return shifted, exps, t.reduce("sum", exps, [dim], True)


@handles(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def _softmax(t: Translator, bsym: BoundSymbol):
    x = t.value(bsym.args[0])
    dim = _dims(bsym.args[1], t.rank(x))[0]
    dtype = compute_dtype(bsym.output.dtype)
    x = t.cast(x, dtype)
    shifted, exps, total = _softmax_parts(t, x, dim, dtype)
    if bsym.op is aten._log_softmax.default:
        return t.op("sub", shifted, t.op("log", total, dtype=dtype), dtype=dtype)
    result = t.op("div", exps, total, dtype=dtype)
    if bsym.op is aten._safe_softmax.default:  # rows that are all -inf give 0, not NaN
        all_masked = t.op("eq", t.reduce("max", x, [dim], True), float("-inf"), dtype=dtype)
        result = t.op("where", all_masked, 0.0, result, dtype=dtype)
    return result


@handles(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward(t: Translator, bsym: BoundSymbol):
    grad, out = (t.value(a) for a in bsym.args[:2])
    dim = _dims(bsym.args[2], t.rank(grad))[0]
    dtype = compute_dtype(bsym.output.dtype)
    grad, out = t.cast(grad, dtype), t.cast(out, dtype)
    if bsym.op is aten._log_softmax_backward_data.default:
        total = t.reduce("sum", grad, [dim], True)
        return t.op("sub", grad, t.op("mul", t.op("exp", out, dtype=dtype), total, dtype=dtype), dtype=dtype)
    total = t.reduce("sum", t.op("mul", grad, out, dtype=dtype), [dim], True)
    return t.op("mul", out, t.op("sub", grad, total, dtype=dtype), dtype=dtype)


@handles(aten.native_layer_norm.default)
def _layer_norm(t: Translator, bsym: BoundSymbol):
    out, mean_out, rstd_out = bsym.output
    x, _, weight, bias, eps = bsym.args
    x = t.value(x)
    rank = t.rank(x)
    dims = list(range(rank - len(bsym.args[1]), rank))
    dtype = compute_dtype(out.dtype)
    x = t.cast(x, dtype)
    count = t.numel(x, dims)
    mean = t.op("div", t.reduce("sum", x, dims, True), count, dtype=dtype)
    centered = t.op("sub", x, mean, dtype=dtype)
    var = t.op("div", t.reduce("sum", t.op("mul", centered, centered, dtype=dtype), dims, True), count, dtype=dtype)
    rstd = t.op("rsqrt", t.op("add", var, as_constant(eps), dtype=dtype), dtype=dtype)
    y = t.op("mul", centered, rstd, dtype=dtype)
    if weight is not None:
        y = t.op("mul", y, t.cast(t.value(weight), dtype), dtype=dtype)
    if bias is not None:
        y = t.op("add", y, t.cast(t.value(bias), dtype), dtype=dtype)
    return y, t.cast(mean, mean_out.dtype), t.cast(rstd, rstd_out.dtype)


# --- views ---------------------------------------------------------------------------------


def _sizes_known(bsym: BoundSymbol) -> bool:
    """A -1 in a view's sizes is read from the traced result, so it must be a constant there."""
    out = bsym.output
    return all(s != -1 or isinstance(as_constant(out.shape[i]), int) for i, s in enumerate(bsym.args[1]))


@handles(aten.view.default, aten._unsafe_view.default, aten.reshape.default, check=_sizes_known)
def _reshape(t: Translator, bsym: BoundSymbol):
    out = bsym.output
    shape = [as_constant(out.shape[i]) if s == -1 else t.value(s) for i, s in enumerate(bsym.args[1])]
    return t.emit("reshape", t.value(bsym.args[0]), shape, dtype=out.dtype)


@handles(aten.permute.default, aten.transpose.int, aten.t.default)
def _permute(t: Translator, bsym: BoundSymbol):
    x = t.value(bsym.args[0])
    rank = t.rank(x)
    if bsym.op is aten.permute.default:
        dims = [d % rank for d in bsym.args[1]]
    else:
        dims = list(range(rank))
        a, b = (bsym.args[1] % rank, bsym.args[2] % rank) if bsym.op is aten.transpose.int else (0, rank - 1)
        dims[a], dims[b] = dims[b], dims[a]
    return t.emit("permute", x, dims, dtype=bsym.output.dtype)


@handles(aten.unsqueeze.default)
def _unsqueeze(t: Translator, bsym: BoundSymbol):
    out = bsym.output
    dim = bsym.args[1] % out.dim()
    return t.emit("broadcast", t.value(bsym.args[0]), [d == dim for d in range(out.dim())], dtype=out.dtype)


@handles(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(t: Translator, bsym: BoundSymbol):
    source = bsym.args[0]
    x = t.value(source)
    rank = source.dim()
    asked = range(rank) if bsym.op is aten.squeeze.default else _dims(bsym.args[1], rank)
    dims = [d for d in asked if as_constant(source.shape[d]) == 1]
    return x if not dims else t.emit("squeeze", x, dims, dtype=bsym.output.dtype)


@handles(aten.expand.default, check=lambda b: not b.kwargs)
def _expand(t: Translator, bsym: BoundSymbol):
    source, sizes = bsym.args[0], bsym.args[1]
    x = t.value(source)
    new = len(sizes) - source.dim()
    if new:
        x = t.emit("broadcast", x, [True] * new + [False] * source.dim(), dtype=source.dtype)
    shape = [t.size(t.values[source.label], i - new) if s == -1 else t.value(s) for i, s in enumerate(sizes)]
    return t.emit("expand", x, shape, dtype=source.dtype)


# --- matmuls (fused only when the executor is asked to) ------------------------------------


def _plain_addmm(bsym: BoundSymbol) -> bool:
    """beta = alpha = 1, in a dtype the product is not rounded in before the bias is added."""
    plain = as_constant(bsym.kwargs.get("beta", 1)) == 1 and as_constant(bsym.kwargs.get("alpha", 1)) == 1
    return plain and bsym.output.dtype not in LOW_PRECISION


@handles(aten.mm.default, aten.bmm.default)
def _matmul(t: Translator, bsym: BoundSymbol):
    a, b = (t.value(x) for x in bsym.args)
    return t.emit("matmul", a, b, dtype=bsym.output.dtype)


@handles(aten.addmm.default, check=_plain_addmm)
def _addmm(t: Translator, bsym: BoundSymbol):
    bias, a, b = (t.value(x) for x in bsym.args[:3])
    dtype = compute_dtype(bsym.output.dtype)
    product = t.emit("matmul", a, b, dtype=bsym.output.dtype)
    return t.math("add", product, bias, dtype=dtype)
