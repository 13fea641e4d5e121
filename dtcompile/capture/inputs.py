"""Turning the values of a call into proxies, and describing what was seen.

Each argument becomes what the traced program receives: a TensorProxy for a tensor, a
DTensor wrapped around a TensorProxy for a DTensor, the value itself for a Python
constant. Beside it, an :class:`InputNode` tree records what the trace assumed about
the argument; the prologue's guards are generated from that tree.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import keyword
import re

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.utils import _pytree as pytree

from ..core import InputPath, TensorProxy, TracingError
from ..core.proxy import contiguous_strides
from ..core.symbol import TORCH_OP_NAMESPACES
from ..core.symbolic import is_symbolic
from ..core.torch_internals import DTensorSpec, TensorMeta, make_dtensor
from .grad_checks import HeldFlags
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
)
from .objects import (
    TORCH_USER_STATE,
    WEAK_PROXIES,
    StateObjects,
    is_state_object,
    new_stand_in,
    optimizer_table,
    referent,
)
from .placements import same_spec
from .recorder import Recording
from .snapshots import LibrarySetUp
from .tensor_attributes import carry_attributes
from .user_code import is_library

# Inputs guarded as the very object the call got (a ``dist.ReduceOp.MAX`` by value: its kind).
IDENTITY_CONSTANTS = (enum.Enum, DeviceMesh, torch.nn.Module, dist.ProcessGroup, dist.ReduceOp, dist.ReduceOp.RedOpType)
CONSTANT_TYPES = (
    bool,
    int,
    float,
    complex,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    type(Ellipsis),
)
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _constant_slice(value: object) -> bool:
    """A slice of constants (``slice(1, 3)``, ``slice(None, None, 2)``): guarded as a constant."""
    return type(value) is slice and all(
        part is None or type(part) is int for part in (value.start, value.stop, value.step)
    )


class UnsupportedInputError(TypeError):
    """An argument dtcompile cannot take as an input."""


def _tensor_held(value, tensors: dict, depth: int = 3) -> str | None:
    """Where ``value`` (a container) holds, ``depth`` levels down, one of ``tensors`` (by id)."""
    if depth <= 0 or not isinstance(value, (dict, list, tuple, set, frozenset, collections.deque)):
        return None  # (a buffer of numbers: a NumPy array, a memoryview, a ctypes object)
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
    for key, item in items:
        for x in (key, item) if isinstance(value, dict) else (item,):
            if isinstance(x, torch.Tensor) and id(x) in tensors:
                return str(tensors[id(x)][1].path)
            if isinstance(x, (dict, list, tuple, set, frozenset)):
                found = _tensor_held(x, tensors, depth - 1)
                if found is not None:
                    return found
    return None


_GENERATED_NAMES = re.compile(r"(t|cotangent|captured|block_grad|block_cotangent|fusion)\d+|(block|ops)_\w*")
_RESERVED_NAMES = frozenset(
    {"torch", "aten", "prims", "math", "dist", "made", "inputs", "stolen", "process_group", "allreduce_options"}
    | {"allgather_into", "DataCheckFailed", "float", "complex", "int", "bool", "max", "min", "abs", "round", "len"}
    | TORCH_OP_NAMESPACES
)


def identifier(text: str, taken: set[str]) -> str:
    """A fresh Python identifier that reads like ``text``, none of the programs' own
    names (``_RESERVED_NAMES``)."""
    name = re.sub(r"\W+", "_", text).strip("_") or "x"
    if name[0].isdigit() or keyword.iskeyword(name) or name in _RESERVED_NAMES or _GENERATED_NAMES.fullmatch(name):
        name = "in_" + name
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    taken.add(candidate)
    return candidate


class InputProxifier:
    """Makes the traced program's view of each input, with its provenance and node."""

    def __init__(self, recording: Recording, symbolic: bool = False):
        self.recording = recording
        self.symbolic = symbolic  # sizes of the call's tensors (not the module's) are symbolic
        self.taken: set[str] = recording.used_names
        self.dtensor_inputs: list[DTensorInput] = []
        self.traced_dtensors: list[tuple[DTensor, DTensorInput]] = []  # what the traced code gets for each
        # (proxy of a computation input, the traced value to differentiate with respect to):
        # the proxy itself for a tensor, the DTensor around it for a DTensor.
        self.differentiable: list[tuple[TensorProxy, object]] = []
        self.objects = StateObjects()
        self._stand_ins: dict[int, tuple[object, InputNode]] = {}  # id of a real object or container -> its stand-in
        # Tensors met so far, so that one met again is the same input (``f(z, z)``, tied
        # weights, a DTensor's local tensor passed too): id of the real tensor (a plain
        # tensor, a DTensor or a DTensor's local) -> (what the program got, its node, the
        # node's local tensor is meant). The values stay alive: they are the call's.
        self._tensors: dict[int, tuple[object, InputNode, bool]] = {}

    def _seen(self, value: torch.Tensor, path: InputPath) -> tuple[object, InputNode] | None:
        seen = self._tensors.get(id(value))
        if seen is None:
            return None
        traced, first, local = seen
        return traced, SameObjectInput(path, first, local)

    def refuse_other_paths(self, reads: list, python_state) -> None:
        """An object of the call reached another way too (``objects.py``), or a tensor of
        the call (a module's parameter) held in a container the code reads (``REG[self.w]``,
        ``w in ACTIVE``): the traced code gets the tensor's stand-in, which no lookup or
        ``is`` finds. Refused. Not where the container is an attribute of a user's module
        (no library class's code reads it) that no code loads by name (``self.pair =
        (self.a,)`` stored by an earlier call, to be read outside): as for the attributes the
        forward assigns (``python_guards.forget_assigned``)."""
        self.objects.refuse_other_paths(reads)
        module_dicts = {id(vars(m)) for _, m in python_state.modules if not _library_class_in(type(m))}
        for read in reads:
            if optimizer_table(read.holder, read.key):  # (as code outside the optimizer does not look them up)
                continue
            if id(read.holder) in module_dicts and read.key not in python_state._attribute_loads:
                continue
            held = _tensor_held(read.value, self._tensors) if read.contents else None
            if held is not None and read.key == "_flat_weights":  # (``nn.RNNBase``'s)
                raise TracingError(
                    f"dtcompile.jit: {read.where} holds the layer's weights in a list "
                    "besides its parameter table, which tracing cannot give stand-ins: nn.LSTM, nn.GRU and nn.RNN "
                    "are not supported yet"
                )
            if held is not None:
                raise TracingError(
                    f"dtcompile.jit: {read.where} holds {held}, a tensor of the call, which the code can reach that "
                    "way too (a default argument, a global, a table): it gets a stand-in for the argument, which a "
                    "lookup by the tensor, `is`, or a write through the other would not meet. Pass it one way only, "
                    "or key a table by name"
                )

    def traced_tensors(self) -> list[tuple[torch.Tensor, dict]]:
        """Each tensor of the call as the traced code got it, with the attributes it was given
        (a DTensor's local tensor: none)."""
        return [(traced, {} if local else node.attributes) for traced, node, local in self._tensors.values()]

    def proxify(self, value: object, path: InputPath, name_hint: str) -> tuple[object, InputNode]:
        dynamic = self.symbolic and path.root in ("args", "kwargs")
        if type(value) in WEAK_PROXIES:  # guarded as that very proxy; its object read as any the code reaches
            if issubclass(type(referent(value)), torch.Tensor):
                raise UnsupportedInputError(f"dtcompile.jit: {path} is a weak proxy to a tensor; pass the tensor")
            return value, ConstantInput(path, value)
        if isinstance(value, torch.Tensor) and id(value) in self._tensors:
            return self._seen(value, path)
        if isinstance(value, DTensor):
            return self._dtensor(value, path, name_hint, dynamic)
        if isinstance(value, torch.Tensor):
            if torch.nn.parameter.is_lazy(value):  # (a lazy module's first call sets it, and removes its hook)
                raise LibrarySetUp(
                    f"the call's first run sets {path}, a lazy module's parameter, once, as eager's does"
                )
            if type(value) not in PLAIN_TENSOR_TYPES:
                raise UnsupportedInputError(
                    f"dtcompile.jit: {path} is a {type(value).__name__}; tensor subclasses other "
                    "than DTensor and nn.Parameter are not supported"
                )
            if value.layout is not torch.strided:
                # Sparse and other layouts are plain Tensors by type, but FakeTensor metadata,
                # the prologue's stride guards and the executors all assume strided tensors.
                raise UnsupportedInputError(
                    f"dtcompile.jit: {path} is a tensor with layout {value.layout}; only strided tensors are supported"
                )
            proxy = self.recording.input_proxy(value, identifier(name_hint, self.taken), path, dynamic)
            if value.requires_grad:
                self.differentiable.append((proxy, proxy))
            node = TensorInput(
                path, proxy, LocalTensorMeta.of(value), carry_attributes(value, proxy, path), len(vars(value))
            )
            self._tensors[id(value)] = (proxy, node, False)
            return proxy, node
        if isinstance(value, CONSTANT_TYPES) or type(value) is torch.Size or _constant_slice(value):
            return value, ConstantInput(path, value)
        if isinstance(value, IDENTITY_CONSTANTS):  # guarded as that very object
            return value, ConstantInput(path, value)  # (a module's tensors: closed over, read at each call)
        if isinstance(value, Placement):  # (``Shard(0)``: guarded by value, as DTensor compares them)
            return value, ConstantInput(path, value)
        container = type(value) in (tuple, list, dict) or pytree.is_namedtuple_instance(value)
        if container and path.steps and id(value) in self._stand_ins:  # (``f(l, l)``: one list, seen twice)
            seen = self._stand_ins[id(value)]
            return seen[0], SameObjectInput(path, seen[1])
        if type(value) in (tuple, list) or pytree.is_namedtuple_instance(value):
            pairs = [self.proxify(v, path.index(i), f"{name_hint}_{i}") for i, v in enumerate(value)]
            items = [p for p, _ in pairs]
            values = type(value)._make(items) if pytree.is_namedtuple_instance(value) else type(value)(items)
            node = SequenceInput(path, type(value), [n for _, n in pairs])
            if path.steps:  # (not ``args`` itself)
                self.objects.add_container(path, values, node)
                self._stand_ins[id(value)] = (values, node)
            return values, node
        if type(value) is dict:
            pairs = [self.proxify(v, path.key(k), f"{name_hint}_{k}") for k, v in value.items()]
            values = dict(zip(value.keys(), (p for p, _ in pairs)))
            node = DictInput(path, tuple(value.keys()), [n for _, n in pairs])
            self.objects.add_container(path, values, node)
            if path.steps:
                self._stand_ins[id(value)] = (values, node)
            return values, node
        if type(value) in pytree.SUPPORTED_NODES:
            node = pytree.SUPPORTED_NODES[type(value)]
            children, context = node.flatten_fn(value)
            pairs = [self.proxify(v, path.index(i), f"{name_hint}_{i}") for i, v in enumerate(children)]
            rebuilt = node.unflatten_fn([p for p, _ in pairs], context)
            return rebuilt, PytreeInput(path, type(value), context, [n for _, n in pairs])
        if is_state_object(value):
            return self._object(value, path, name_hint)
        if isinstance(value, TORCH_USER_STATE):  # (its tables are keyed by tensors: not taken apart)
            raise UnsupportedInputError(
                f"dtcompile.jit: {path} is a {type(value).__name__} (a torch optimizer, LR scheduler, GradScaler or "
                "distribution), which is not taken as an argument. Close over it instead (a global or a "
                "closure's variable): what the code reads of it is then guarded"
            )
        raise UnsupportedInputError(
            f"dtcompile.jit: {path} is a {type(value).__name__}; inputs must be tensors, DTensors, "
            "numbers, strings, None, dtypes, devices, tuples, lists and dicts of those, or objects "
            "holding them in their __dict__ (none in __slots__)"
        )

    def held_flags(self) -> HeldFlags:
        """The requires_grad of each tensor input so far, to tell a flag the traced code
        changes (``grad_checks.py``)."""
        return HeldFlags.of([(traced, node.path) for traced, node, _ in self._tensors.values()])

    def written_dtensors(self, recording) -> list[tuple[object, int]]:
        """``(a DTensor input's node, or the index of a closed-over DTensor, writes)`` for each
        the traced code wrote in place: DTensor counts such writes on its own version counter,
        which the program's writes to the local tensor do not move, so the prologue counts
        them (an eager graph that saved the DTensor then refuses its backward, as eager's)."""
        with torch._C.DisableTorchFunction():
            found: list[tuple[object, int]] = [(n, _writes(w)) for w, n in self.traced_dtensors if _writes(w)]
            for index, held in enumerate(recording.captured_held):
                traced = recording.captured_dtensors.get(id(held)) if isinstance(held, DTensor) else None
                if traced is not None and _writes(traced):
                    found.append((index, _writes(traced)))
        return found

    def respecced(self) -> InputPath | None:
        """The path of a DTensor input whose spec the traced code changed in place
        (``squeeze_`` re-indexing a ``Shard``, an ``out=`` of other placements); None."""
        return next(
            (node.path for traced, node in self.traced_dtensors if not same_spec(traced._spec, node.traced_spec)), None
        )

    def _object(self, value: object, path: InputPath, name_hint: str) -> tuple[object, InputNode]:
        seen = self._stand_ins.get(id(value))
        if seen is not None:
            return seen[0], SameObjectInput(path, seen[1])
        node = ObjectInput(path, type(value), tuple(vars(value)), [])
        stand_in = new_stand_in(value)
        self._stand_ins[id(value)] = (stand_in, node)  # before the attributes: they may refer back
        attributes = {}
        for name, attribute in vars(value).items():
            proxied, child = self.proxify(attribute, path.attr(name), f"{name_hint}_{name}")
            attributes[name] = proxied
            node.children.append(child)
        stand_in.__dict__.update(attributes)
        self.objects.add(node, stand_in, attributes, value)
        return stand_in, node

    def _dtensor(self, value: DTensor, path: InputPath, name_hint: str, dynamic: bool) -> tuple[DTensor, DTensorInput]:
        mesh = value.device_mesh
        if mesh.get_coordinate() is None:
            raise UnsupportedInputError(
                f"dtcompile.jit: {path} is a DTensor on {mesh}, which does not include this "
                f"process (rank {torch.distributed.get_rank()})"
            )
        local = value._local_tensor
        local_path = path.attr("_local_tensor")
        shared = self._tensors.get(id(local))
        if shared is not None and not value.requires_grad and not _requires_grad(shared[1]):
            # A second DTensor around a local tensor met before: the same input. (Not where a
            # gradient flows: each DTensor would then be a leaf of its own.)
            first = shared[1]
            proxy = first.proxy
            dynamic = any(is_symbolic(size) for size in proxy.shape) and _evenly_sharded(value)
        else:
            first = None
            dynamic = dynamic and _evenly_sharded(value)
            proxy = self.recording.input_proxy(local, identifier(name_hint, self.taken), local_path, dynamic)
            self.recording.dtensor_of[proxy.label] = value
        spec = _symbolic_spec(value, proxy) if dynamic else value._spec
        wrapped = make_dtensor(proxy, spec, requires_grad=value.requires_grad)
        node = DTensorInput(path, proxy, value._spec, LocalTensorMeta.of(local), value.requires_grad, spec, first)
        node.attributes, node.held_attributes = carry_attributes(value, wrapped, path), len(vars(value))
        self._tensors[id(value)] = (wrapped, node, False)
        if first is None:
            self._tensors[id(local)] = (proxy, node, True)
        self.dtensor_inputs.append(node)
        self.traced_dtensors.append((wrapped, node))
        if value.requires_grad:
            self.differentiable.append((proxy, wrapped))
        return wrapped, node


def _writes(traced: DTensor) -> int:
    return 0 if traced.is_inference() else traced._version  # (an inference tensor counts none)


def _requires_grad(node: InputNode) -> bool:
    return node.requires_grad if isinstance(node, DTensorInput) else node.meta.requires_grad


def _shard_factors(value: DTensor) -> list[int]:
    """For each tensor dim, how many pieces the mesh cuts it into."""
    factors = [1] * value.dim()
    for mesh_dim, placement in enumerate(value.placements):
        if type(placement) is Shard:
            factors[placement.dim] *= value.device_mesh.size(mesh_dim)
    return factors


def _evenly_sharded(value: DTensor) -> bool:
    """Whether a DTensor can be traced with symbolic sizes: plain placements, contiguous,
    and every sharded dim divided evenly (the global size is the local one times the
    shards). Others are traced with their sizes as they are."""
    if any(type(p) not in (Shard, Replicate, Partial) for p in value.placements):
        return False
    local = value._local_tensor
    if not local.is_contiguous() or tuple(value.stride()) != contiguous_strides(value.shape):
        return False
    return all(g == n * f for g, n, f in zip(value.shape, local.shape, _shard_factors(value)))


def _symbolic_spec(value: DTensor, proxy: TensorProxy) -> DTensorSpec:
    """The DTensor's spec with its global sizes in terms of its local tensor's symbols."""
    shape = [size * factor for size, factor in zip(proxy.shape, _shard_factors(value))]
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), value.dtype)
    return dataclasses.replace(value._spec, tensor_meta=meta)


def _library_class_in(cls: type) -> bool:
    """Whether a library class (``nn.LSTM``) is among ``cls`` and its bases up to ``nn.Module``."""
    mro = cls.__mro__
    return any(is_library(klass) for klass in mro[: mro.index(torch.nn.Module)])
