"""Turning a call into a per-rank trace, below DTensor."""

from ..core import TracingError
from .autograd import BackwardCapture
from .global_state import GlobalState
from .input_nodes import (
    ConstantInput,
    DictInput,
    DTensorInput,
    InputNode,
    LocalTensorMeta,
    ObjectInput,
    PytreeInput,
    SameObjectInput,
    SequenceInput,
    TensorInput,
    iter_leaves,
)
from .inputs import UnsupportedInputError
from .live_collectives import ranks_meet_before_live_collectives
from .objects import AttributeUpdate, is_state_object, new_object
from .outputs import (
    ConstantOutput,
    DictOutput,
    DTensorOutput,
    HeldOutput,
    NewObjectOutput,
    NumberOutput,
    ObjectOutput,
    OutputNode,
    PytreeOutput,
    SequenceOutput,
    Slot,
    TensorOutput,
    with_plain_sizes,
)
from .placements import describe_placement, describe_placements
from .snapshots import DataSnapshot, LibrarySetUp
from .tracer import CallInputs, CapturedCall, capture_call, is_tracing

__all__ = [
    "AttributeUpdate",
    "LibrarySetUp",
    "ObjectInput",
    "ObjectOutput",
    "SameObjectInput",
    "CallInputs",
    "CapturedCall",
    "GlobalState",
    "ConstantInput",
    "ConstantOutput",
    "DTensorInput",
    "DTensorOutput",
    "HeldOutput",
    "NewObjectOutput",
    "new_object",
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
    "with_plain_sizes",
    "DataSnapshot",
    "is_state_object",
    "is_tracing",
    "ranks_meet_before_live_collectives",
    "describe_placement",
    "describe_placements",
    "iter_leaves",
]
