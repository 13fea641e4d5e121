"""The torch executor: generated Python that calls each op directly.

Calling the public binding (``torch.mm``, ``t.view``) costs about half of calling the
OpOverload (``torch.ops.aten.mm.default``), so the hot ops whose public binding takes
exactly the aten schema's arguments are called that way; every other op is called
through its OpOverload. Either way the same kernel runs, so values and strides are
eager's.
"""

from __future__ import annotations

import torch

from ..core import BoundSymbol, Symbol
from ..core.op_classes import is_communication
from ..core.prims import READS, DataCheck, ShapeQuery, SizeExpression
from .base import Executor

aten = torch.ops.aten
_TORCH = (("torch", torch, "torch"),)

# aten op -> public function with the same arguments (printed as ``torch.<name>``).
_FUNCTIONS = {
    aten.mm.default: "mm",
    aten.bmm.default: "bmm",
    aten.addmm.default: "addmm",
    aten.baddbmm.default: "baddbmm",
    aten.t.default: "t",
    aten.transpose.int: "transpose",
    aten.permute.default: "permute",
    aten.unsqueeze.default: "unsqueeze",
    aten.squeeze.dim: "squeeze",
    aten.select.int: "select",
    aten.clone.default: "clone",
    aten.add.Tensor: "add",
    aten.sub.Tensor: "sub",
    aten.mul.Tensor: "mul",
    aten.div.Tensor: "div",
    aten.neg.default: "neg",
    aten.exp.default: "exp",
    aten.rsqrt.default: "rsqrt",
    aten.sqrt.default: "sqrt",
    aten.pow.Tensor_Scalar: "pow",
    aten.mean.dim: "mean",
    aten.sum.dim_IntList: "sum",
    aten.sum.default: "sum",
    aten.relu.default: "relu",
    aten.tanh.default: "tanh",
    aten.sigmoid.default: "sigmoid",
    aten._softmax.default: "_softmax",
    aten._log_softmax.default: "_log_softmax",
    aten.cat.default: "cat",
    aten.embedding.default: "embedding",
    aten.where.self: "where",
    aten.ones_like.default: "ones_like",
    aten.zeros_like.default: "zeros_like",
    aten.empty_like.default: "empty_like",
    aten.full_like.default: "full_like",
    aten.cos.default: "cos",
    aten.sin.default: "sin",
    aten.erf.default: "erf",
    aten.reciprocal.default: "reciprocal",
    aten.narrow.default: "narrow",
    aten.constant_pad_nd.default: "constant_pad_nd",
    aten.native_layer_norm.default: "native_layer_norm",
    aten.arange.default: "arange",
    aten.arange.start: "arange",
    aten.arange.start_step: "arange",
    aten.scalar_tensor.default: "scalar_tensor",
    aten.le.Tensor: "le",
    aten.lt.Tensor: "lt",
    aten.ge.Tensor: "ge",
    aten.gt.Tensor: "gt",
    aten.eq.Tensor: "eq",
    aten.ne.Tensor: "ne",
    aten.le.Scalar: "le",
    aten.lt.Scalar: "lt",
    aten.ge.Scalar: "ge",
    aten.gt.Scalar: "gt",
    aten.eq.Scalar: "eq",
    aten.ne.Scalar: "ne",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "_scaled_dot_product_flash_attention_for_cpu",
}
# aten op -> function of torch._C._nn (printed as ``torch._C._nn.<name>``).
_NN_FUNCTIONS = {aten.gelu.default: "gelu", aten.silu.default: "silu", aten.linear.default: "linear"}
# aten op -> Tensor method with the same arguments (printed as ``t0.<name>(...)``).
# ``_unsafe_view`` differs from ``view`` only in autograd's view tracking, and compiled
# programs run without autograd.
_METHODS = {
    aten.view.default: "view",
    aten._unsafe_view.default: "view",
    aten.split_with_sizes.default: "split_with_sizes",
    aten.expand.default: "expand",
    aten.add_.Tensor: "add_",
    aten.mul_.Tensor: "mul_",
    aten.copy_.default: "copy_",
    aten.index_copy_.default: "index_copy_",
}


def _fast_symbol(op) -> Symbol | None:
    if op in _FUNCTIONS:
        name = _FUNCTIONS[op]
        return Symbol(f"torch.{name}", globals=_TORCH)
    if op in _NN_FUNCTIONS:
        name = _NN_FUNCTIONS[op]
        return Symbol(f"torch._C._nn.{name}", globals=_TORCH)
    if op in _METHODS:
        name = _METHODS[op]
        return Symbol(name, method=True)
    return None


class TorchExecutor(Executor):
    """Runs the local ops. Collectives are left to the collectives executor; where no
    executor claims a symbol, ``lower`` runs it through its OpOverload."""

    name = "torch"

    def __init__(self):
        self._symbols: dict = {}

    def claims(self, bsym: BoundSymbol) -> bool:
        if bsym.op is None:
            return isinstance(bsym.symbol, (ShapeQuery, SizeExpression, DataCheck))
        return not is_communication(bsym.op)

    def lower(self, bsym: BoundSymbol, index: int, context) -> list[BoundSymbol]:
        if isinstance(bsym.symbol, ShapeQuery):
            return [bsym.but(symbol=READS[bsym.symbol.name])]
        if bsym.op is None:
            return [bsym]  # a size expression or a data check is plain Python already
        if bsym.op not in self._symbols:
            self._symbols[bsym.op] = _fast_symbol(bsym.op)
        fast = self._symbols[bsym.op]
        return [bsym if fast is None else bsym.but(symbol=fast)]
