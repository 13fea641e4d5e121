"""Whether two values play the same part in two blocks (``equivalence.py`` compares
the blocks' modules attribute by attribute, and their hooks and other objects here): the
same object, equal scalars and placements, corresponding modules, functions of the same
code over equivalent closures, partials and bound methods of such, and plain objects
whose attributes are equivalent, a few levels down. How two values of a class are
compared is decided once per class (:func:`_category`).
"""

from __future__ import annotations

import functools
import types

import torch
from torch.distributed.tensor.placement_types import Placement

from .objects import slot_names
from .python_reads import value_key

SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout)
_EQUIVALENCE_DEPTH = 8


class Equivalence:
    """Whether two values play the same part in two blocks: the same object, equal
    scalars and placements, corresponding modules, functions of the same code over
    equivalent closures, partials and bound methods of such, and plain objects whose
    attributes are equivalent (a few levels down)."""

    def __init__(self, modules: dict[int, torch.nn.Module]):
        self.modules = modules  # id of a module of the first block -> the module in the same place
        self._alike: set[tuple[int, int]] = set()  # ids of plain objects found equivalent

    def __call__(self, a, b, depth: int = 0) -> bool:
        if a is b:  # a module of the first block is not itself: it maps to one of the other's
            return self.modules.get(id(a), a) is b
        kind = type(a)
        if kind is not type(b):  # (modules map to modules of their own class)
            return False
        if kind in SCALARS:
            return value_key(a) == value_key(b)
        category = _category(kind)
        if category is _MODULE:
            mapped = self.modules.get(id(a))
            return mapped is not None and mapped is b
        if category is _PLACEMENT:
            return a == b
        if category is _NUMBER:  # a subclass of int, float, str or bytes: its value, then its attributes
            base = next(t for t in kind.__mro__ if t in _NUMBER_BASES)
            return value_key(base(a)) == value_key(base(b)) and (
                not hasattr(a, "__dict__") or self(vars(a), vars(b), depth + 1)
            )
        if depth > _EQUIVALENCE_DEPTH:
            return False
        depth += 1
        if (
            category in _CONTAINERS
            and kind not in _BUILTIN_CONTAINERS
            and not self(_own_state(a), _own_state(b), depth)
        ):
            return False  # a subclass's own state differs (a defaultdict's factory, a list's attributes)
        if category is _SET:
            # (in order: code iterating one meets its items in that order)
            return all(type(x) in SCALARS for x in (*a, *b)) and list(map(value_key, a)) == list(map(value_key, b))
        if category is _SEQUENCE:
            return len(a) == len(b) and all(self(x, y, depth) for x, y in zip(a, b))
        if category is _DICT:
            if not a and not b:  # a function's attributes, most often
                return True
            return (
                len(a) == len(b)
                and all(self(k, j, depth) for k, j in zip(a, b))
                and all(self(v, w, depth) for v, w in zip(a.values(), b.values()))
            )
        if category is _FUNCTION:
            return (
                a.__code__ is b.__code__
                and a.__globals__ is b.__globals__
                and self(a.__defaults__, b.__defaults__, depth)
                and self(a.__kwdefaults__, b.__kwdefaults__, depth)
                and self._cells(a.__closure__ or (), b.__closure__ or (), depth - 1)
                and self(vars(a), vars(b), depth)  # its own attributes (``f.alpha``)
                and all(self(getattr(a, n), getattr(b, n), depth) for n in _FUNCTION_SLOTS)  # (``f.__name__``)
            )
        if category is _METHOD:
            return a.__func__ is b.__func__ and self(a.__self__, b.__self__, depth)
        if category is _PARTIAL:
            return (
                self(a.func, b.func, depth)
                and self(a.args, b.args, depth)
                and self(a.keywords, b.keywords, depth)
                and self(vars(a), vars(b), depth)  # its own attributes (``act.k``)
            )
        if category is _IDENTITY or not hasattr(a, "__dict__"):
            return False  # by identity only
        pair = (id(a), id(b))  # a style object both hooks of a module hold, compared once
        if pair in self._alike:
            return True
        alike = self(vars(a), vars(b), depth)
        if alike:
            self._alike.add(pair)
        return alike

    def _cells(self, a: tuple, b: tuple, depth: int) -> bool:
        if len(a) != len(b):
            return False
        for x, y in zip(a, b):
            try:
                xv = x.cell_contents
            except ValueError:
                xv = _EMPTY
            try:
                yv = y.cell_contents
            except ValueError:
                yv = _EMPTY
            if not self(xv, yv, depth + 1):
                return False
        return True


_EMPTY = object()


def _own_state(container) -> tuple:
    """What a subclass of a built-in container holds beside its items."""
    return (getattr(container, "default_factory", None), dict(getattr(container, "__dict__", None) or {}))


_MODULE, _PLACEMENT, _SET, _SEQUENCE, _DICT, _FUNCTION, _METHOD, _PARTIAL, _IDENTITY, _OBJECT = (
    "module",
    "placement",
    "set",
    "sequence",
    "dict",
    "function",
    "method",
    "partial",
    "identity",
    "object",
)
_NUMBER = "number"  # a subclass of int, float, complex, str or bytes
_CONTAINERS = (_SET, _SEQUENCE, _DICT)
_FUNCTION_SLOTS = ("__name__", "__qualname__", "__module__", "__doc__")  # (set apart from ``vars(f)``)
_BUILTIN_CONTAINERS = (set, frozenset, tuple, list, dict)
_NUMBER_BASES = (int, float, complex, str, bytes)


@functools.lru_cache(maxsize=1024)
def _category(kind: type) -> str:
    """How :class:`Equivalence` compares two values of class ``kind`` (not a scalar's),
    decided once per class."""
    for category, bases in (
        (_MODULE, torch.nn.Module),
        (_PLACEMENT, Placement),
        (_NUMBER, _NUMBER_BASES),
        (_SET, (set, frozenset)),
        (_SEQUENCE, (tuple, list)),
        (_DICT, dict),
        (_FUNCTION, types.FunctionType),
        (_METHOD, types.MethodType),
        (_PARTIAL, functools.partial),
        (_IDENTITY, (torch.Tensor, type, types.ModuleType, types.BuiltinFunctionType)),
    ):
        if issubclass(kind, bases):
            return category
    if kind.__module__ == "builtins" or slot_names(kind) or _c_base(kind):
        return _IDENTITY  # compared by identity only
    return _OBJECT


_PLAIN_SIZE = type("_PlainClass", (), {}).__basicsize__  # an instance of a class statement's, without slots


def _c_base(kind: type) -> bool:
    """Whether ``kind``'s instances hold state in C beside their ``__dict__`` (a subclass
    of a deque, an array, a NumPy array, a Decimal, an exception)."""
    return kind.__basicsize__ > _PLAIN_SIZE
