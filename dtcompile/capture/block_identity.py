"""Whether a block's code could tell it from an equivalent block by identity: a global,
a class attribute or a container it reads holding one of the blocks' modules, the
objects and functions they hold, their tensors, or their ``id()``s; or code that makes
numbers from identity (``id()``, ``hash()``), keeps results by argument (a cached
function) or reads a context variable (``blocks.py`` records such a block each time)."""

from __future__ import annotations

import builtins
import collections
import contextvars
import functools
import types
import weakref

import torch

from .alike import SCALARS
from .block_checks import is_buffer
from .equivalence import TENSOR_TABLES
from .objects import slot_names
from .user_code import block_functions, code_names, is_library


def identity_read(
    module: torch.nn.Module, containers: list, traced: list[torch.nn.Module], tensors: frozenset[int] = frozenset()
) -> str | None:
    """Where the block's code could tell it from an equivalent block by identity
    (``REGISTRY[id(self)]``, ``self is LAST``, ``self in SKIP``): a global its classes'
    code names, a class attribute, or one of ``containers`` (what :func:`python_state`
    found; of the containers globals hold, those of the globals it names) holds a module of the ``traced`` tree of a class the block has, its ``id()``,
    or a set, list, tuple or dict of them. The block's modules' own attributes may hold
    the block's own submodules (the equivalence check maps them to the other block's), but
    no other such module. None where nothing does."""
    own_modules = list(module.modules())
    classes = {type(m) for m in own_modules}
    alike = [m for m in traced if type(m) in classes]
    # Besides the modules, the objects and functions they hold: the equivalence check
    # compares those by what they hold, so a table keyed by one (``BOOST[self.tag]``)
    # would tell them apart; and the hashes of all (``hash(self)``: an id, rotated).
    held = _distinct_held(alike)
    ids = {id(x) for x in (*alike, *held)} | tensors  # and the tensors the tree holds (``REG[self.w]``)
    ids |= {hash(x) for x in (*alike, *held) if type(x).__hash__ is object.__hash__}
    others = ids - {id(m) for m in own_modules} - {key for m in own_modules for key in _held_objects(m)}
    skipped = {id(t) for m in own_modules for t in (m._modules, *(getattr(m, n) for n in TENSOR_TABLES))}
    named, unnamed = set(), set()  # what globals the code names hold, and the other globals
    for sub in own_modules:
        skipped.add(id(vars(sub)))
        for name, value in vars(sub).items():
            if name not in _MODULE_ATTRIBUTES and _names_one(value, others):
                return f"its attribute {name!r} holds another block's module or its id"
    for fn in block_functions(own_modules):
        if id(fn.__globals__) not in skipped:  # globals the code does not name are not read
            skipped.add(id(fn.__globals__))
            unnamed.update(map(_held_id, fn.__globals__.values()))
        for name in _global_names(fn.__code__):
            named.add(_held_id(fn.__globals__.get(name)))
            if _names_one(fn.__globals__.get(name), ids):
                return f"the global {name!r} holds one of its modules or their ids"
            why = _identity_reader(name, fn.__globals__)
            if why is not None:
                return why
    skipped |= unnamed - named
    for container in containers:
        if id(container) not in skipped and not is_buffer(container):
            keyed = not isinstance(container, (list, collections.deque, set))  # a dict, a slots' or cells' view
            items = container.items() if keyed else enumerate(container)
            for key, value in items:
                if _names_one(key, ids) or _names_one(value, ids):
                    return f"a Python value it can read holds one of its modules or their ids (at {key!r})"
    return None


def _held_objects(module: torch.nn.Module) -> dict[int, object]:
    """The objects and functions a module's attributes hold, by id, levels down (through
    dicts, their keys too, sequences, sets, and user objects' attributes and slots), other
    than modules, tensors, classes and scalars."""
    found: dict[int, object] = {}
    seen: set[int] = set()
    for name, value in vars(module).items():
        if name not in _MODULE_ATTRIBUTES:
            _walk_held(value, _HELD_LEVELS, found, seen)
    return found


def _walk_held(value, levels: int, found: dict, seen: set) -> None:
    if not levels or id(value) in seen or type(value) in SCALARS or isinstance(value, _NOT_HELD):
        return
    seen.add(id(value))
    if isinstance(value, dict):
        for key, item in value.items():
            _walk_held(key, levels - 1, found, seen)
            _walk_held(item, levels - 1, found, seen)
    elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        for item in value:
            _walk_held(item, levels - 1, found, seen)
    elif hasattr(value, "__dict__") and not is_buffer(value):
        found[id(value)] = value
        if not is_library(type(value)):  # a library's object: itself, not what it holds
            for item in vars(value).values():
                _walk_held(item, levels - 1, found, seen)
    elif slot_names(type(value)) and not is_library(type(value)):
        for name in slot_names(type(value)):
            _walk_held(getattr(value, name, None), levels - 1, found, seen)


def _distinct_held(modules: list) -> list:
    """What modules of a class hold that not all of them hold: a table keyed by one (or
    by its id) tells them apart; an object they all hold (a shared config) tells nothing."""
    by_class: dict[type, list[dict]] = collections.defaultdict(list)
    for module in modules:
        by_class[type(module)].append(_held_objects(module))
    found = []
    for held in by_class.values():
        shared = set.intersection(*map(set, held))
        found += [x for objects in held for key, x in objects.items() if key not in shared]
    return found


_HELD_LEVELS = 4
_NOT_HELD = (torch.nn.Module, torch.Tensor, type, types.ModuleType)


def _identity_reader(name: str, namespace: dict) -> str | None:
    """Why the global ``name`` lets the code tell blocks apart where their state is alike:
    ``id()`` and ``hash()`` give numbers made from identity (``REG[str(id(self))]``), a
    cached user function keeps results by argument (``lru_cache`` of the layer), a context
    variable holds what the parent set for this layer; None for any other name."""
    value = namespace.get(name, getattr(builtins, name, None))
    if value is id or value is hash:
        return f"its code calls {name}(), a number from identity"
    if isinstance(value, functools._lru_cache_wrapper) and not is_library(getattr(value, "__wrapped__", value)):
        return f"its code calls {name}, a cached function (its results are kept by argument)"
    if isinstance(value, contextvars.ContextVar):
        return f"its code reads the context variable {name}"
    return None


def _held_id(value) -> int:
    """The id of the container :func:`python_state` keeps for a global's value: the value
    (a dict, a list) or an object's ``__dict__``."""
    state = getattr(value, "__dict__", None)
    return id(state) if type(state) is dict and not isinstance(value, type) else id(value)


_MODULE_ATTRIBUTES = frozenset(vars(torch.nn.Module()))  # nn.Module's own: tables, flags


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> frozenset[str]:
    return frozenset(code_names(code)[0])


def _names_one(value, ids: set[int]) -> bool:
    """Whether ``value`` is one of the modules ``ids`` names or one of those ids, or a
    container (weak ones too) holding one, one level down (two for a dict's values), at
    any size (an id is looked up, not compared)."""
    if _one(value, ids):
        return True
    if isinstance(value, weakref.ref):
        return id(value()) in ids
    if isinstance(value, weakref.WeakValueDictionary):
        value = dict(value.items())
    if isinstance(value, (dict, weakref.WeakKeyDictionary)):
        return any(_one(k, ids) or _names_one(v, ids) for k, v in value.items() if not isinstance(v, dict))
    if isinstance(value, (set, frozenset, list, tuple, collections.deque, weakref.WeakSet)):
        return any(_one(x, ids) for x in value)
    return False


def _one(value, ids: set[int]) -> bool:
    if isinstance(value, types.MethodType):  # a bound method: its object (``REG[self.body]``)
        value = value.__self__
    return id(value) in ids or (type(value) is int and value in ids)
