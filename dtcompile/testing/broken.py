"""A deliberately broken executor, for testing ``check="eager"``: it must find the line."""

import torch

from ..core import BoundSymbol, Symbol
from ..executors import Executor


class MulAsAddExecutor(Executor):
    """Runs every multiplication as an addition."""

    name = "broken"

    def claims(self, bsym: BoundSymbol) -> bool:
        return bsym.op is torch.ops.aten.mul.Tensor

    def lower(self, bsym: BoundSymbol, index: int, context) -> list[BoundSymbol]:
        add = Symbol("torch.add", globals=(("torch", torch, "torch"),))
        return [BoundSymbol(add, bsym.args, bsym.kwargs, bsym.output, bsym.note, bsym.op)]
