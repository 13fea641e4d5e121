"""What a block's first call must not have done for its recording to be replayed, and the
Python state a replay must find unchanged (``blocks.py``)."""

from __future__ import annotations

import array
import collections
import functools
import sys
import types

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_flatten

from ..core.op_classes import draws_random_numbers
from ..core.torch_internals import dict_version
from .alike import SCALARS
from .equivalence import TENSOR_TABLES
from .objects import read_through, slot_names
from .python_reads import memory_copy, raw_memory
from .python_state import PythonState
from .user_code import block_functions, is_library


def recording_counts(recording) -> tuple:
    return (
        len(recording.captured),
        len(recording.read_by),
        len(recording.cones),
        recording.c10d_calls,
        recording.tensor_hooks,  # (a block's backward runs the hook it registered: its own Python)
    )


def python_state(module: torch.nn.Module) -> list:
    """The containers a block's code reads Python values from: its modules' tables and
    attributes; what these hold, levels down: plain objects (a config, and the objects it
    holds: ``self.config.attention.rope.theta``), modules outside the block (a parent held
    as a plain attribute), lists and dicts (and the objects in them); its classes' dicts
    and their functions' globals, and the dicts and small lists these hold (a global
    table). A first call that changes one is not replayed (a later block would have read
    the new value), nor is a later call after the code changed one."""
    found: dict[int, object] = {}
    tree = {id(m) for m in module.modules()}
    for sub in module.modules():
        for table in (*(getattr(sub, name) for name in TENSOR_TABLES), vars(sub)):
            found[id(table)] = table
        _reachable(vars(sub).values(), found, tree, _OBJECT_LEVELS)
        mro = type(sub).__mro__
        for klass in mro[: mro.index(torch.nn.Module)] + tuple(k for k in mro if not is_library(k)):
            found[id(klass)] = klass.__dict__  # (a user mixin after nn.Module's too)
    for fn in block_functions(list(module.modules())):  # its methods, and the helpers they call
        if id(fn.__globals__) not in found:
            found[id(fn.__globals__)] = fn.__globals__
            _reachable(fn.__globals__.values(), found, tree, 1)
    return list(found.values())


_OBJECT_LEVELS = 8  # objects followed down from a module's attributes


class _Slots:
    """An object's slots, as a container: what ``Held`` compares of an object without a
    ``__dict__`` (a ``dataclass(slots=True)`` of settings the layers share)."""

    __slots__ = ("value", "names")

    def __init__(self, value, names: tuple):
        self.value, self.names = value, names

    def items(self) -> list:
        return [(name, getattr(self.value, name, _ABSENT)) for name in self.names]


class _FunctionState:
    """What a function reads besides its globals: its closure cells and default values."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def items(self) -> list:
        fn = self.value
        cells = [(index, _cell_contents(cell)) for index, cell in enumerate(fn.__closure__ or ())]
        return [*cells, ("defaults", fn.__defaults__), ("kwdefaults", fn.__kwdefaults__), ("code", fn.__code__)]


_ABSENT = object()


def _cell_contents(cell) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # not assigned yet
        return _ABSENT


def is_buffer(value) -> bool:
    """A NumPy array, an ``array``, a bytearray, a memoryview or a ctypes object: compared
    by a copy, not item by item."""
    numpy = sys.modules.get("numpy")
    return (
        isinstance(value, (bytearray, array.array))
        or raw_memory(value)
        or (numpy is not None and isinstance(value, numpy.ndarray))
    )


def _reachable(values, found: dict[int, object], tree: set[int], levels: int) -> None:
    """Add what ``values`` hold that code can read through them, ``levels`` down: the
    attributes (or slots) of plain objects, their classes' dicts, modules outside the
    block (``tree``), dicts, lists, deques and buffers (a NumPy array), what tuples and
    sets hold, and functions' closure cells and defaults, with what they hold."""
    for value in values:
        if not levels or type(value) in SCALARS or isinstance(value, (torch.Tensor, type, types.ModuleType)):
            continue
        if isinstance(value, torch.nn.Module) and id(value) in tree:
            continue  # the block's own: its tables are watched
        if isinstance(value, (dict, list, collections.deque, set)) or is_buffer(value):
            if id(value) not in found:
                found[id(value)] = value
                if not is_buffer(value):
                    _reachable(value.values() if isinstance(value, dict) else value, found, tree, levels - 1)
        elif isinstance(value, (tuple, frozenset)):
            _reachable(value, found, tree, levels - 1)
        elif isinstance(value, types.FunctionType):
            if id(value) not in found:  # what its cells hold, as deep as the function itself
                found[id(value)] = _FunctionState(value)
                _reachable([v for _, v in found[id(value)].items()], found, tree, max(levels, 2) - 1)
        elif isinstance(value, functools.partial):
            _reachable((value.func, value.args, value.keywords, vars(value)), found, tree, levels - 1)
        elif isinstance(value, types.MethodType):
            _reachable((value.__func__, value.__self__), found, tree, levels)
        elif (owner := read_through(value)) is not None:  # ``settings.get``, ``settings.values()``
            _reachable((owner,), found, tree, levels)
        else:
            state = getattr(value, "__dict__", None)
            if isinstance(state, dict) and id(state) not in found:
                found[id(state)] = state
                _reachable(state.values(), found, tree, levels - 1)
            names = slot_names(type(value))
            if names and id(value) not in found:
                found[id(value)] = _Slots(value, names)
                _reachable([v for _, v in found[id(value)].items()], found, tree, levels - 1)
            klass = type(value)
            if not is_library(klass) and id(klass) not in found:
                found[id(klass)] = klass.__dict__  # a helper class's attributes (``Ctx.scale``)


def contents(container) -> tuple:
    """What a container holds now, to tell later whether it changed (:func:`changed`): a
    dict's version, a buffer's copy, or its items themselves (held: an object freed
    meanwhile could leave its address to a new one)."""
    if isinstance(container, dict) and dict_version is not None:
        return ("version", dict_version(container))
    if raw_memory(container):
        return ("bytes", memory_copy(container))
    if is_buffer(container):
        return ("copy", container.copy() if hasattr(container, "copy") else container[:])
    if isinstance(container, (list, collections.deque)):
        return ("items", list(container))
    if isinstance(container, set):
        return ("set", set(container))
    return ("items", list(container.items()))


class Held:
    """What some containers hold now, to tell later whether any changed: the dicts by
    their versions, read in one pass; the others by :func:`contents`. And, where a
    module is given, each value its guards would read (``python_state.PythonState``:
    ``CFG["attn"]["scale"]``, another module's global, the environment), compared as the
    guards compare it: a parent may change one between its layers."""

    def __init__(self, containers: list, module: torch.nn.Module | None = None):
        reads = PythonState.of_module(module).reads if module is not None else []
        # A scalar or object read from a dict (a globals dict, an instance's or a class's
        # ``__dict__``) is unchanged where the dict is: its version tells, in one pass.
        by_version = [r for r in reads if dict_version is not None and r.key is not None and not r.contents]
        self._reads = [r for r in reads if not (dict_version is not None and r.key is not None and not r.contents)]
        held = {id(c): c for c in containers}
        held.update((id(r.holder), r.holder) for r in by_version if isinstance(r.holder, dict))
        self._reads += [r for r in by_version if not isinstance(r.holder, dict)]
        containers = list(held.values())
        self.containers = containers
        versioned = [dict_version is not None and isinstance(c, dict) for c in containers]
        self._dicts = [c for c, v in zip(containers, versioned) if v]
        self._versions = list(map(dict_version, self._dicts)) if self._dicts else []
        self._others = [(c, contents(c)) for c, v in zip(containers, versioned) if not v]

    def changed(self) -> bool:
        return (
            list(map(dict_version, self._dicts)) != self._versions
            or any(changed(c, before) for c, before in self._others)
            or not all(read.unchanged() for read in self._reads)
        )


def changed(container, before: tuple) -> bool:
    """Whether ``container`` changed since :func:`contents` gave ``before``: keys by
    value, values by identity."""
    kind, held = before
    if kind == "version":
        return dict_version(container) != held
    if kind == "set":
        return container != held
    if kind == "bytes":
        return held is None or memory_copy(container) != held
    if kind == "copy":
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(held, numpy.ndarray):
            return not numpy.array_equal(container, held)
        return container != held
    if isinstance(container, (list, collections.deque)):
        return len(container) != len(held) or any(a is not b for a, b in zip(container, held))
    now = list(container.items())
    return len(now) != len(held) or any(k != j or v is not w for (k, v), (j, w) in zip(now, held))


def arguments_changed(args: tuple, kwargs: dict, flat_before: list, treespec) -> bool:
    """Whether the call changed the containers it received (a list it wrote into)."""
    flat, spec = tree_flatten((args, kwargs))
    return spec != treespec or any(a is not b for a, b in zip(flat, flat_before))


def unreplayable(symbols: list) -> str | None:
    for bsym in symbols:
        if bsym.op is None:
            return f"it records {bsym.symbol.name}, which is not an aten op"
        if draws_random_numbers(bsym):  # (DTensor's random ops on shards take offsets from Python state)
            return f"it draws random numbers ({bsym.op})"
        if any(free_unbacked_symbols(p.meta.shape) for p in bsym.output_tensors()):
            return f"its sizes come from data ({bsym.op}): each block has its own"
    return None


_GRAPH_NODES = 2000  # the most autograd nodes walked back from a block's inputs


def inputs_depend(values: list) -> bool:
    """Whether one of a block's inputs that need gradients was computed from another (an
    argument ``x + 1`` beside ``x``, an argument made from the block's own parameter), or
    that cannot be told in a bounded walk of their autograd graphs: a block's recorded
    backward gives each input's gradient as if the others were independent."""
    # Nodes are held while compared by id: a node's Python object lives only while held
    # (torch 2.10 makes a new one at each access), and a freed one's id is given to the
    # next, which read as a dependency that is not there, or hid one that is.
    leaves = {id(v): v for v in values if v.grad_fn is None}
    computed = {id(node): node for node in (v.grad_fn for v in values) if node is not None}
    for value in values:
        if value.grad_fn is None:
            continue
        stack, seen = [n for n, _ in value.grad_fn.next_functions if n is not None], {}
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            variable = getattr(node, "variable", None)
            if id(node) in computed or (variable is not None and id(variable) in leaves):
                return True
            if len(seen) > _GRAPH_NODES:
                return True
            stack += [n for n, _ in node.next_functions if n is not None]
    return False
