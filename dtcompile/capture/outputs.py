"""Describing what a traced call returned, so the epilogue can rebuild it.

The computation returns a flat tuple of local tensors; an :class:`OutputNode` tree says how
to rebuild the call's result from it: which leaves become DTensors (with the spec DTensor's
propagation gave them at trace time), which stay plain tensors, which are constants, and
the containers around them."""

from __future__ import annotations

import array
import collections.abc
import dataclasses
import enum
import functools
import types
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ..core import InputPath, TensorProxy, TracingError
from ..core.symbolic import SYMBOLIC_TYPES, as_constant, is_symbolic
from ..core.torch_internals import TensorMeta, mask_buffer
from .made_callables import check_remakable, made_in_call
from .made_copies import kept_in
from .model_outputs import refuse_unrebuildable_record
from .objects import MODULES_MADE, StateObjects, holds_proxies, is_rebuildable_object, object_state, plain_object
from .user_code import is_library


@dataclass
class OutputNode:
    pass


@dataclass
class ConstantOutput(OutputNode):
    value: object
    copied: bool = False  # a container holding no tensor the call made (a set): a copy at each call
    kept: tuple = ()  # (copied) what it holds that was there before the call: not copied
    remade: bool = False  # a function or partial the call made, keeping none of its state: made anew


@dataclass
class HeldOutput(OutputNode):
    """What ``getattr(module, table)[key]`` holds when the call's computation is done,
    read before the call's module updates: a parameter the forward assigned to another
    module attribute is the Parameter object itself, as in eager."""

    module: object
    table: str
    key: str


@dataclass
class TensorOutput(OutputNode):
    index: int  # into the computation's flat result
    parameter: bool | None = None  # an ``nn.Parameter`` the call made: whether it requires grad
    marked_parameter: bool = False  # a Tensor marked ``_is_param``: a DTensor parameter's ``to_local()``


@dataclass
class NumberOutput(OutputNode):
    index: int  # a size the computation returns (symbolic values)


@dataclass(frozen=True)
class Slot:
    """A size, in a DTensor output's global shape or stride, that the computation returns."""

    index: int


@dataclass
class DTensorOutput(OutputNode):
    index: int
    spec: object
    requires_grad: bool
    # (placement index, slot of its mask): a row-sharded embedding's output is a
    # _MaskPartial whose reduction needs the mask of each call's indices.
    masks: tuple[tuple[int, int], ...] = ()
    # Under symbolic values, the global shape and stride: ints and Slots; None: the spec's.
    shape: tuple | None = None
    stride: tuple | None = None
    # Whether eager's local tensor requires grad (``from_local`` of a tensor that does).
    local_requires_grad: bool = False
    # Whether it is a DTensor input of the call itself (not a new DTensor around its local
    # tensor, as a redistribute to the same placements makes).
    given: bool = False
    # Eager's is an autograd view of (``x[:, 1:]``; ``link_views``): another DTensor output,
    # a DTensor of the call (its index in the epilogue's objects, without gradients), or a
    # DTensor input of a training step (its local tensor's label).
    view_of_output: DTensorOutput | None = None
    view_of_object: int | None = None
    view_of_input: str | None = None


@dataclass
class ObjectOutput(OutputNode):
    """An object of the call (its stand-in was returned): the real one, as the epilogue received it."""

    index: int


@dataclass
class SequenceOutput(OutputNode):
    type: type  # tuple, list, torch.Size or a namedtuple class
    children: list[OutputNode]


@dataclass
class NewObjectOutput(OutputNode):
    """An object the call made (a dataclass holding tensors): made anew after each call
    from its class and attributes, as eager's call makes a new one."""

    type: type
    names: tuple[str, ...]
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


# Mutable containers holding no tensor, made anew at each call by a copy of the traced one.
_COPIED = (list, dict, set, collections.deque, bytearray, array.array, collections.UserList, collections.UserDict)


_PREEXISTING = (tuple, list, dict, collections.deque)  # containers otherwise made anew at each call


def _mutable_kind(value: object) -> bool:
    """Whether ``value`` is of a kind a call makes anew (a container, an object of a user's
    class), not one a library hands out (a logger, a process group)."""
    if isinstance(value, (_COPIED, collections.ChainMap)):
        return True
    kind = type(value)
    if isinstance(value, (type, types.ModuleType, enum.Enum, torch.nn.Module)) or callable(value):
        return False
    return kind is types.SimpleNamespace or not is_library(kind)


_VIEWS = (collections.abc.KeysView, collections.abc.ValuesView, collections.abc.ItemsView)


class OutputCollector:
    """Collects the local proxies a call returned, in order, and describes the result."""

    def __init__(self, objects: StateObjects | None = None, call_dtensors: list = ()):
        self.objects = objects if objects is not None else StateObjects()
        self._call_dtensors = {id(d): d for d in call_dtensors}  # what the traced code got for each DTensor input
        self.proxies: list[TensorProxy] = []  # the local tensor of each output slot
        self.values: list = []  # what each slot holds in the call's result: a DTensor or a proxy
        self.mask_buffers: list = []  # filled with proxies by tracing; emptied by release_masks
        self._describing: set[int] = set()  # objects being described now (a cycle is an error)
        self._dtensors: dict[int, tuple] = {}  # id -> (a DTensor, its node): returned twice, one output
        self._shared: dict[int, tuple] = {}  # id -> (a container or object, its node)
        # What the call's code reads from Python state (a global, a module's attribute:
        # ``python_reads.Read``): objects there before the call, returned as they are.
        self.reads: list = []
        self._existing_ids: set[int] | None = None
        self._views: list[tuple[DTensorOutput, DTensor]] = []  # (a DTensor output, the DTensor it views)
        self._keys: set[int] = set()  # ids of objects the epilogue holds as constants (dict keys, in copies)

    def _slot(self, proxy: TensorProxy, value=None) -> int:
        self.proxies.append(proxy)
        self.values.append(proxy if value is None else value)
        return len(self.proxies) - 1

    def describe(self, value: object, where: object = "the result") -> OutputNode:
        """The node that rebuilds ``value``; ``where`` names it in errors. A container or
        object met twice (``ns, ns``) is one node: the epilogue makes it once."""
        shared = self._shared.get(id(value))
        if shared is not None and shared[0] is value:
            return shared[1]
        node = self._describe(value, where)
        made_anew = isinstance(node, ConstantOutput) and (node.copied or node.remade)  # (``s, [s]``: one object)
        made_anew = made_anew or (isinstance(node, TensorOutput) and node.parameter is not None)
        if isinstance(node, (SequenceOutput, DictOutput, PytreeOutput, NewObjectOutput)) or made_anew:
            self._shared[id(value)] = (value, node)
        return node

    def _describe(self, value: object, where: object) -> OutputNode:
        if isinstance(value, DTensor) and isinstance(value._local_tensor, TensorProxy):
            index = self.objects.index_of(value)
            if index is not None:
                return ObjectOutput(index)  # a DTensor of the call, returned unchanged: the caller's
            if id(value) not in self._dtensors:  # (``y, y``: one object, as in eager)
                self._dtensors[id(value)] = (value, self._dtensor(value))
            return self._dtensors[id(value)][1]
        if isinstance(value, TensorProxy):
            made_here = not isinstance(value.provenance, InputPath)  # (an input's: the caller's own, as it is)
            if made_here and value.is_inference() and not torch.is_inference_mode_enabled():
                raise TracingError(
                    f"dtcompile.jit: {where} holds a tensor made under torch.inference_mode() inside the call: "
                    "eager's is an inference tensor, the compiled call's would not be. Enter inference_mode "
                    "around the call instead"
                )
            marked = made_here and vars(value).get("_is_param", False)  # ``nn.Parameter(t)``: t detached
            if marked and getattr(value.provenance, "made_by", None) != "aten.detach.default":
                return TensorOutput(self._slot(value), marked_parameter=True)  # a DTensor parameter's ``to_local()``
            return TensorOutput(self._slot(value), value.requires_grad if marked else None)
        if isinstance(value, torch.Tensor):
            return ConstantOutput(value)  # a tensor the program closes over, returned as is
        if is_symbolic(value):
            return NumberOutput(self._slot(value))
        if isinstance(value, SYMBOLIC_TYPES):  # a size the code made a number (``int(n)``): eager's int
            return ConstantOutput(as_constant(value))
        if isinstance(value, torch.Size):
            if any(is_symbolic(x) for x in value):
                return SequenceOutput(torch.Size, [self.describe(x) for x in value])
            return ConstantOutput(value)  # sizes are constants; pytree would rebuild a tuple
        if isinstance(value, (tuple, list, dict)) and (index := self.objects.index_of(value)) is not None:
            return ObjectOutput(index)  # a container of the call, returned: the caller's own
        if isinstance(value, _PREEXISTING) and not holds_proxies(value) and id(value) in self._existing():
            return ConstantOutput(value)  # one there before the call (a global's list), returned as itself
        if type(value) in (tuple, list) or pytree.is_namedtuple_instance(value):
            return SequenceOutput(type(value), [self.describe(v, where) for v in value])
        if isinstance(value, dict) and any(isinstance(key, torch.Tensor) or holds_proxies(key) for key in value):
            raise TracingError(
                f"dtcompile.jit: {where} is a dict keyed by a tensor, which the compiled call cannot rebuild "
                "(its key would be the traced stand-in); key it by a name instead"
            )
        if type(value) is dict:
            self._keys.update(map(id, value))  # (constants of the epilogue: a function there is not made anew)
            return DictOutput(tuple(value.keys()), [self.describe(v, where) for v in value.values()])
        if type(value) in pytree.SUPPORTED_NODES:
            refuse_unrebuildable_record(value, where)
            node = pytree.SUPPORTED_NODES[type(value)]
            children, context = node.flatten_fn(value)
            return PytreeOutput(type(value), context, [self.describe(v, where) for v in children])
        index = self.objects.index_of(value)
        if index is not None:
            return ObjectOutput(index)
        if isinstance(value, torch.nn.Module) and value in MODULES_MADE:
            raise TracingError(
                f"dtcompile.jit: {where} holds a {type(value).__name__} module made inside the call: the compiled "
                "call would give the object made while tracing (its tensors traced ones), the same at every "
                "call; make the module outside the compiled function (and pass it in, or jit it)"
            )
        if isinstance(value, torch._C.Future) and value.done() and holds_proxies(value.value()):
            raise TracingError(
                f"dtcompile.jit: {where} holds the Future of a collective of the call (work.get_future()), whose "
                "value would be the traced stand-ins; wait for it inside the call and return its value instead"
            )
        if holds_proxies(value):
            if not (is_rebuildable_object(value) or type(value) is types.SimpleNamespace):
                raise TracingError(
                    f"dtcompile.jit: {where} holds traced tensors inside a {type(value).__name__}, which "
                    "dtcompile cannot make anew after each call (a set, a function, a container subclass or a "
                    "class with its own __new__); return a tuple, list, dict, namedtuple, dataclass or plain object instead"
                )
            return self._new_object(value, where)
        if isinstance(value, (types.CoroutineType, types.AsyncGeneratorType)):
            if isinstance(value, types.CoroutineType):
                value.close()  # (never awaited: no warning)
            raise TracingError(
                f"dtcompile.jit: {where} holds a {type(value).__name__} (an async def's call), whose code runs when "
                "it is awaited, after the compiled call; compile the function it awaits, not the async one"
            )
        if hasattr(type(value), "__next__") or isinstance(value, _VIEWS):
            raise TracingError(
                f"dtcompile.jit: {where} holds a {type(value).__name__} (an iterator, a generator, a dict's view), "
                "whose items the compiled call cannot tell without running it; return a list or a dict instead"
            )
        if made_in_call(value, self._existing()):  # (a closure, a partial): made anew, or refused
            check_remakable(value, self._existing(), where)
            return ConstantOutput(value, remade=True)
        # Made by the call (not reached from what it read of Python state), holding no
        # tensor: made anew at each call, as eager's.
        if _mutable_kind(value) and id(value) not in self._existing():
            if plain_object(value) and (type(value) is types.SimpleNamespace or not is_library(type(value))):
                return self._new_object(value, where)
            kept = kept_in(value, self._existing())
            self._keys.update(id(k) for k in _held_functions(value))  # (a copy holds them as they are)
            return ConstantOutput(value, copied=True, kept=kept)
        return ConstantOutput(value)

    def existed(self, value) -> bool:
        """Whether ``value`` was there before the call, reached from what it read."""
        return id(value) in self._existing()

    def _existing(self) -> set[int]:
        """The ids of the objects reached from what the call read of Python state (a global,
        a module's attribute, the items and attributes they hold), there before the call."""
        if self._existing_ids is None:
            self._existing_ids = set()
            stack = [(read.value, 0) for read in self.reads]
            while stack and len(self._existing_ids) < 100_000:
                value, depth = stack.pop()
                if id(value) in self._existing_ids or isinstance(value, (str, bytes, int, float, torch.Tensor)):
                    continue
                self._existing_ids.add(id(value))
                if hasattr(value, "__array_interface__") and getattr(value, "base", None) is not None:
                    stack.append((value.base, depth))  # (the array owning a view's memory: views of it are over it)
                if depth < 6:
                    if isinstance(value, dict):
                        items = list(value.values())
                    elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
                        items = list(value)
                    else:
                        items = list(getattr(value, "__dict__", {}).values()) if plain_object(value) else []
                    stack += [(item, depth + 1) for item in items]
        return self._existing_ids

    def _dtensor(self, value: DTensor) -> DTensorOutput:
        slot = self._slot(value._local_tensor, value)
        masks = []
        for i, placement in enumerate(value.placements):
            buffer = mask_buffer(placement)
            if buffer is not None and isinstance(buffer.data, TensorProxy):
                masks.append((i, self._slot(buffer.data)))
                self.mask_buffers.append(buffer)
        meta = value._spec.tensor_meta
        base = value._base
        flag = {
            "local_requires_grad": value._local_tensor.requires_grad,
            "given": self._call_dtensors.get(id(value)) is value,
        }
        if not any(is_symbolic(x) for x in (*meta.shape, *meta.stride)):
            node = DTensorOutput(slot, with_plain_sizes(value._spec), value.requires_grad, tuple(masks), **flag)
        else:
            shape = tuple(self._size(x) for x in meta.shape)
            stride = tuple(self._size(x) for x in meta.stride)
            node = DTensorOutput(slot, value._spec, value.requires_grad, tuple(masks), shape, stride, **flag)
        if isinstance(base, DTensor) and not node.given:
            self._views.append((node, base))
        return node

    def link_views(self) -> None:
        """Each DTensor output eager makes a view of a DTensor output or a DTensor of the
        call (``x[:, 1:]``, ``y.t()``) names it (the program's local tensor is a view of the
        base's; the epilogue makes the DTensor one too, sharing its version counter, and
        within a training step autograd then refuses writes through it, as through a plain
        tensor's). Called once the result and the updates are described."""
        for value, node in self._shared.values():  # (a function made anew but held as a key: the traced one)
            if isinstance(node, ConstantOutput) and node.remade and id(value) in self._keys:
                node.remade = False
        for node, base in self._views:
            returned = self._dtensors.get(id(base))
            if self._call_dtensors.get(id(base)) is base:  # (returned too, it is the caller's: ``w, w.t()``)
                node.view_of_object = self.objects.index_of(base)
                node.view_of_input = base._local_tensor.label if node.view_of_object is None else None
            elif returned is not None and returned[0] is base:
                node.view_of_output = returned[1]
        self._views.clear()

    def _new_object(self, value: object, where: object) -> NewObjectOutput:
        if id(value) in self._describing:
            raise TracingError(f"dtcompile.jit: {where} holds a {type(value).__name__} that refers to itself")
        self._describing.add(id(value))
        try:
            state = object_state(value)
            children = [self.describe(v, where) for v in state.values()]
        finally:
            self._describing.discard(id(value))
        return NewObjectOutput(type(value), tuple(state), children)

    def _size(self, value):
        """An int, or the Slot of a symbolic size the computation will return."""
        value = as_constant(value)
        return Slot(self._slot(value)) if is_symbolic(value) else value

    def release_masks(self) -> None:
        """Empty the mask buffers tracing filled (the epilogue fills them at each call, as DTensor)."""
        for buffer in self.mask_buffers:
            buffer.data, buffer.refcount = None, 0


def _held_functions(value, depth: int = 3) -> list:
    """The functions and partials a container holds, a few levels down."""
    if isinstance(value, (types.FunctionType, functools.partial)):
        return [value]
    if depth and isinstance(value, (list, tuple, set, frozenset, dict, collections.deque)):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
        return [f for item in items for f in _held_functions(item, depth - 1)]
    return []


def with_plain_sizes(spec):
    """``spec`` with ints for sizes that are SymInts of a known value (an ``out=`` DTensor's
    spec, set by DTensor from the traced op's): a spec holding SymInts cannot be hashed,
    and DTensor hashes the specs of the caller's DTensors when it redistributes them."""
    meta = spec.tensor_meta
    if all(type(x) is int for x in (*meta.shape, *meta.stride)):
        return spec
    plain = TensorMeta(
        torch.Size([as_constant(x) for x in meta.shape]), tuple(as_constant(x) for x in meta.stride), meta.dtype
    )
    return dataclasses.replace(spec, tensor_meta=plain)
