"""Describing what a traced call returned, so the epilogue can rebuild it.

The computation returns a flat tuple of local tensors; an :class:`OutputNode` tree says
how to rebuild the call's result from it: which leaves become DTensors (with the spec
DTensor's propagation gave them at trace time), which stay plain tensors, which are
constants, and the containers around them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ..core import TensorProxy


@dataclass
class OutputNode:
    pass


@dataclass
class ConstantOutput(OutputNode):
    value: object


@dataclass
class TensorOutput(OutputNode):
    index: int  # into the computation's flat result


@dataclass
class DTensorOutput(OutputNode):
    index: int
    spec: object
    requires_grad: bool
    # (placement index, slot of its mask): a row-sharded embedding's output is a
    # _MaskPartial whose reduction needs the mask of each call's indices.
    masks: tuple[tuple[int, int], ...] = ()


@dataclass
class SequenceOutput(OutputNode):
    type: type
    children: list[OutputNode]


@dataclass
class DictOutput(OutputNode):
    keys: tuple
    children: list[OutputNode]


@dataclass
class PytreeOutput(OutputNode):
    type: type
    context: object
    children: list[OutputNode]


class OutputCollector:
    """Collects the local proxies a call returned, in order, and describes the result."""

    def __init__(self):
        self.proxies: list[TensorProxy] = []  # the local tensor of each output slot
        self.values: list = []  # what each slot holds in the call's result: a DTensor or a proxy
        self.mask_buffers: list = []  # filled with proxies by tracing; emptied by release_masks

    def _slot(self, proxy: TensorProxy, value=None) -> int:
        self.proxies.append(proxy)
        self.values.append(proxy if value is None else value)
        return len(self.proxies) - 1

    def describe(self, value: object) -> OutputNode:
        if isinstance(value, DTensor) and isinstance(value._local_tensor, TensorProxy):
            slot = self._slot(value._local_tensor, value)
            masks = []
            for i, placement in enumerate(value.placements):
                buffer = getattr(placement, "mask_buffer", None)
                if buffer is not None and isinstance(buffer.data, TensorProxy):
                    masks.append((i, self._slot(buffer.data)))
                    self.mask_buffers.append(buffer)
            return DTensorOutput(slot, value._spec, value.requires_grad, tuple(masks))
        if isinstance(value, TensorProxy):
            return TensorOutput(self._slot(value))
        if isinstance(value, torch.Tensor):
            return ConstantOutput(value)  # a tensor the program closes over, returned as is
        if isinstance(value, torch.Size):
            return ConstantOutput(value)  # sizes are constants; pytree would rebuild a tuple
        if type(value) in (tuple, list):
            return SequenceOutput(type(value), [self.describe(v) for v in value])
        if type(value) is dict:
            return DictOutput(tuple(value.keys()), [self.describe(v) for v in value.values()])
        if type(value) in pytree.SUPPORTED_NODES:
            node = pytree.SUPPORTED_NODES[type(value)]
            children, context = node.flatten_fn(value)
            return PytreeOutput(type(value), context, [self.describe(v) for v in children])
        return ConstantOutput(value)

    def release_masks(self) -> None:
        """Empty the mask buffers tracing filled with proxies: at run time the epilogue
        fills them with each call's real mask, as eager DTensor does."""
        for buffer in self.mask_buffers:
            buffer.data, buffer.refcount = None, 0
