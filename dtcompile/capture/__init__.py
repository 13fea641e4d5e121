"""Turning a call into a per-rank trace, below DTensor."""

from .autograd import BackwardCapture
from .inputs import (
    ConstantInput,
    DictInput,
    DTensorInput,
    InputNode,
    LocalTensorMeta,
    PytreeInput,
    SequenceInput,
    TensorInput,
    UnsupportedInputError,
    iter_leaves,
)
from .outputs import (
    ConstantOutput,
    DictOutput,
    DTensorOutput,
    NumberOutput,
    OutputNode,
    PytreeOutput,
    SequenceOutput,
    Slot,
    TensorOutput,
)
from .placements import describe_placement, describe_placements
from .recorder import TracingError
from .tracer import CallInputs, CapturedCall, capture_call

__all__ = [
    "CallInputs",
    "CapturedCall",
    "ConstantInput",
    "ConstantOutput",
    "DTensorInput",
    "DTensorOutput",
    "NumberOutput",
    "Slot",
    "DictInput",
    "DictOutput",
    "InputNode",
    "OutputNode",
    "PytreeInput",
    "PytreeOutput",
    "SequenceInput",
    "SequenceOutput",
    "TensorInput",
    "LocalTensorMeta",
    "TensorOutput",
    "TracingError",
    "BackwardCapture",
    "UnsupportedInputError",
    "capture_call",
    "describe_placement",
    "describe_placements",
    "iter_leaves",
]
