"""What a trace assumed about each value of the call: the nodes of the input tree (a
tensor's local metadata, a DTensor's spec, a constant, containers and objects of them),
from which the prologue's guards are generated (``inputs.py`` makes them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..core import InputPath, TensorProxy


@dataclass(frozen=True)
class LocalTensorMeta:
    """The local metadata a trace assumed of a tensor."""

    type: type
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    # The conjugate and negative bits (``x.conj()`` of a complex tensor, its ``.imag``):
    # ops and ``is_conj()`` answer by them, so a program traced with one differs.
    conj: bool = False
    neg: bool = False
    # Made under ``inference_mode``: the code can ask (``is_inference()``), and eager
    # refuses some ops on such a tensor outside the mode.
    inference: bool = False
    leaf: bool = True  # guarded where it requires grad: code may ask ``is_leaf``

    @staticmethod
    def leaf_of(t: torch.Tensor) -> bool:
        """``t.is_leaf``; True for a view made under no_grad whose base was written since,
        of which autograd refuses to say (it was made with no grad_fn; eager's code runs)."""
        try:
            return t.is_leaf
        except RuntimeError:
            return True

    @staticmethod
    def of(t: torch.Tensor) -> LocalTensorMeta:
        return LocalTensorMeta(
            type(t),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
            t.device,
            t.requires_grad,
            t.is_conj(),
            t.is_neg(),
            t.is_inference(),
            LocalTensorMeta.leaf_of(t),
        )

    def bits_check(self, var: str) -> str:
        """A condition true when the tensor ``var`` has other conjugate, negative or
        inference bits (or, requiring grad, is a leaf where it was not)."""
        conj = f" or {var}.is_conj() is not {self.conj}" if self.dtype.is_complex else ""
        leaf = f" or LEAF({var}) is not {self.leaf}" if self.requires_grad else ""
        return f"{var}.is_neg() is not {self.neg}{conj} or {var}.is_inference() is not {self.inference}{leaf}"


@dataclass
class InputNode:
    """What the trace assumed about one value of the call, at ``path``."""

    path: InputPath


@dataclass
class ConstantInput(InputNode):
    value: object


@dataclass
class TensorInput(InputNode):
    proxy: TensorProxy
    meta: LocalTensorMeta
    attributes: dict = dataclasses.field(default_factory=dict)  # Python attributes guarded
    held_attributes: int = 0  # how many the tensor held (torch's marks too)


@dataclass
class DTensorInput(InputNode):
    proxy: TensorProxy  # the local tensor's proxy, at ``path._local_tensor``
    spec: object  # the DTensorSpec (mesh, placements, global shape and stride)
    meta: LocalTensorMeta  # of the local tensor
    requires_grad: bool
    traced_spec: object = None  # the spec traced with: ``spec``, or with symbolic sizes
    # The input whose tensor is this DTensor's local tensor too (two DTensors made from one
    # local tensor): the local is then that input, not a new one.
    local_of: InputNode | None = None
    attributes: dict = dataclasses.field(default_factory=dict)  # Python attributes guarded
    held_attributes: int = 0  # how many the tensor held (torch's marks too)


@dataclass
class SequenceInput(InputNode):
    type: type
    children: list[InputNode]


@dataclass
class DictInput(InputNode):
    keys: tuple
    children: list[InputNode]


@dataclass
class PytreeInput(InputNode):
    """A container registered with torch's pytree (namedtuple, dataclass, ModelOutput)."""

    type: type
    context: object
    children: list[InputNode]


@dataclass
class ObjectInput(InputNode):
    """An object taken apart by its ``__dict__`` (see ``objects.py``): its class and its
    attributes, in order."""

    type: type
    names: tuple[str, ...]
    children: list[InputNode]


@dataclass
class SameObjectInput(InputNode):
    """An object, tensor or DTensor met a second time in the call: the very object at
    ``first`` (with ``local``: the local tensor of the DTensor at ``first``)."""

    first: InputNode
    local: bool = False


def brings_proxy(node: InputNode) -> bool:
    """Whether the node gives the computation an input of its own (a tensor, or a
    DTensor's local tensor met for the first time)."""
    if isinstance(node, DTensorInput):
        return node.local_of is None
    return isinstance(node, TensorInput)


# Names the programs give to their own values and helpers: the values the recorder makes
# (``t3``, ``cotangent0``, ``captured0``), the block programs, fusions, collectives' and
# checks' helpers, the list a function that steals its inputs takes (``inputs``, ``stolen``)
# and the builtins printed sizes and constants call, op namespaces (``aten``,
# ``ops_mylib``). An input named so would shadow one.


def iter_leaves(node: InputNode):
    """The tensor and constant nodes of a tree, in order."""
    children = getattr(node, "children", None)
    if children is None:
        yield node
        return
    for child in children:
        yield from iter_leaves(child)


def iter_nodes(node: InputNode):
    """Every node of a tree, containers too, parents first."""
    yield node
    for child in getattr(node, "children", ()):
        yield from iter_nodes(child)
