"""One Python value the program can read (:class:`Read`), and how reads are guarded:
by exact type and value, by contents, or by identity, gathered into the prepared lists
the prologue checks in C-level passes (:class:`PythonGuards`). What is read is found by
``python_state.py``.
"""

from __future__ import annotations

import array
import collections
import ctypes
import decimal
import fractions
import math
import struct
import sys
import types
from dataclasses import dataclass, field

import torch

from ..core.torch_internals import dict_version
from .objects import WEAK_PROXIES, attribute_or_none

ABSENT = object()  # what a read of a missing name gives
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def by_value(value: object) -> bool:
    """Whether ``value`` is guarded by value (a scalar or a tuple of them), not identity."""
    if type(value) is tuple:
        return all(map(by_value, value))
    return type(value) in _SCALARS


def value_key(value: object) -> object:
    """What a value guarded by value must stay equal to: its exact type and value, floats
    by ``repr`` (so that ``-0.0`` differs from ``0.0``) and a NaN by its bits (it equals
    itself; ``inf - inf`` has its sign set, which ``copysign`` reads), tuples item by item
    (``(1,)`` differs from ``(1.0,)``), containers by what they hold now (a copy, so that a
    change in place shows)."""
    kind = type(value)
    if kind is float or kind is complex:
        if value != value:
            return (kind, struct.pack("<dd", value.real, value.imag))
        return (kind, repr(value))
    if kind in _SCALARS:
        return (kind, value)
    if id(value) in _KEYING:  # a container holding itself (a tree's parent links): by identity there
        return (kind, _Same(value))
    _KEYING.add(id(value))
    try:
        if kind is tuple or kind is list:
            return (kind, tuple(map(value_key, value)))
        if kind is dict:
            return (dict, tuple((value_key(k), value_key(v)) for k, v in value.items()))
        return _container_key(value)
    finally:
        _KEYING.discard(id(value))


_KEYING: set[int] = set()  # the ids of the values being keyed, outermost first


def _container_key(value: object) -> object:
    """:func:`value_key` of sets, deques, NumPy arrays, bytearrays and arrays, and of
    subclasses of the built-in containers (an ``OrderedDict``, a ``defaultdict`` with its
    factory, a namedtuple), with a subclass's own attributes; tensors and other arrays by
    identity (their contents are read at run time, not baked in); anything else by
    identity (its attributes are guarded apart), but dtypes, devices and the like."""
    kind = type(value)
    if isinstance(value, (set, frozenset)):  # in the order code iterating it meets them
        key = (kind, tuple(map(value_key, value)))
    elif isinstance(value, collections.deque):
        key = (kind, tuple(map(value_key, value)), value.maxlen)
    elif isinstance(value, (list, tuple)):
        key = (kind, tuple(map(value_key, value)))
    elif isinstance(value, (dict, types.MappingProxyType)):  # (a proxy shows its dict's changes)
        items = tuple((value_key(k), value_key(v)) for k, v in value.items())
        key = (kind, items, _Same(attribute_or_none(value, "default_factory")))
    elif isinstance(value, (bytearray, array.array)):
        return (kind, attribute_or_none(value, "typecode"), bytes(value))
    elif raw_memory(value) and (held := memory_copy(value)) is not None:
        return (kind, _Same(value), held)
    elif _numeric_array(value):
        return (kind, str(value.dtype), value.shape, value.tobytes())
    elif hasattr(value, "__array__"):  # a tensor (``==`` would compare its elements)
        return (kind, _Same(value))
    elif kind in _EQUAL_IS_SAME:
        return (kind, value)
    elif kind in _BY_TEXT:  # (``Decimal("-0") == Decimal("0")``)
        return (kind, repr(value))
    else:  # by identity: one that compares equal may still differ (a dataclass field with compare=False)
        return (kind, _Same(value))
    own = attribute_or_none(value, "__dict__")  # a subclass's attributes (a list with a ``.scale``)
    return key + (value_key(dict(own)),) if own else key


_EQUAL_IS_SAME = frozenset({torch.dtype, torch.device, torch.layout, torch.memory_format, range})
_BY_TEXT = frozenset({decimal.Decimal, fractions.Fraction, slice})


class _Same:
    """A key equal only to one for the very same object."""

    __slots__ = ("held",)

    def __init__(self, held: object):
        self.held = held

    def __eq__(self, other: object) -> bool:
        return type(other) is _Same and other.held is self.held

    def __hash__(self) -> int:
        return id(self.held)


_CTYPES_DATA = (ctypes._SimpleCData, ctypes.Structure, ctypes.Union, ctypes.Array)


def raw_memory(value: object) -> bool:
    """A memoryview or a ctypes object (``c_double``, a ``Structure``): memory that code
    changes in place (``knob.value = 3``), guarded by a copy of its bytes."""
    return isinstance(value, memoryview) or isinstance(value, _CTYPES_DATA)


def memory_copy(value: object) -> bytes | None:
    """The bytes a :func:`raw_memory` object holds now; None where they cannot be read (a
    released memoryview)."""
    try:
        return value.tobytes() if isinstance(value, memoryview) else bytes(memoryview(value))
    except (ValueError, TypeError):
        return None


def _numeric_array(value: object) -> bool:
    """A NumPy array of numbers (``np.ones(3)``, a global table of scales)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and type(value) is numpy.ndarray and value.dtype.kind in "biufc"


def contents_guarded(value: object) -> bool:
    """Whether the contents of ``value`` are guarded beside its identity: anything that can
    change in place without becoming another object, by :func:`value_key`. Lists, dicts,
    sets and deques of any class and size (a table of activation functions, a list of
    config objects, an ``OrderedDict`` of settings), tuples holding such or objects,
    bytearrays, arrays and NumPy arrays of numbers: an item replaced in place is seen."""
    if type(value) in WEAK_PROXIES:  # (guarded by identity; what it refers to is followed)
        return False
    if _numeric_array(value) or isinstance(value, (bytearray, array.array)) or raw_memory(value):
        return True
    if type(value) is tuple:
        return not by_value(value)
    return isinstance(value, (list, tuple, dict, set, frozenset, collections.deque, types.MappingProxyType))


def needs_value_key(value: object) -> bool:
    """Whether ``==`` with a type check is not enough to compare ``value``: tuples (the
    types of their items), NaN, zeros (signed) and complex numbers (their parts)."""
    if type(value) is tuple:
        return True
    if type(value) is float:
        return math.isnan(value) or value == 0.0
    if type(value) is complex:
        return True
    return False


@dataclass
class Read:
    """One value the program can read: ``holder[key]`` (a globals dict, a module's or an
    object's ``__dict__``) or, with ``key`` None, an attribute of ``holder`` that lives in
    no dict (a closure cell's contents, a function's defaults, a partial's arguments), and
    the value then."""

    holder: object
    key: str | None
    value: object
    where: str  # for messages and docs: "global 'S' of f"
    contents: bool = False  # the contents of a small list or dict of scalars, not its identity
    contents_key: object = None  # their value_key when read (the container may change later)
    attribute: str = "cell_contents"  # what is read of ``holder`` when ``key`` is None

    def current(self) -> object:
        if self.key is None:
            try:
                return getattr(self.holder, self.attribute, ABSENT)  # a slot not set: absent
            except ValueError:  # the cell was emptied
                return ABSENT
        return self.holder.get(self.key, ABSENT)

    def unchanged(self) -> bool:
        now = self.current()
        if self.contents:
            return value_key(now) == self.contents_key
        if by_value(self.value):
            return by_value(now) and value_key(now) == value_key(self.value)
        return now is self.value


@dataclass
class ReadGroup:
    """Reads checked together: ``holder[key]`` for the dict reads, then the attribute
    reads (cells' contents), and what each must be (the object, the value, or its
    :func:`value_key`)."""

    dicts: list = field(default_factory=list)
    keys: list = field(default_factory=list)
    objects: list = field(default_factory=list)
    attributes: list = field(default_factory=list)
    expected: list = field(default_factory=list)
    types: list = field(default_factory=list)

    def add(self, read: Read, expected: object) -> None:
        if read.key is None:
            self.objects.append(read.holder)
            self.attributes.append(read.attribute)
        else:
            self.dicts.append(read.holder)
            self.keys.append(read.key)
        self.expected.append(expected)
        self.types.append(type(read.value))

    def __bool__(self) -> bool:
        return bool(self.expected)


def _plain_scalar(value: object) -> bool:
    """A scalar ``==`` with a type check compares exactly (not NaN, a zero, complex)."""
    return type(value) in _SCALARS and not needs_value_key(value)


@dataclass
class PythonGuards:
    """The reads of a :class:`PythonState` as prepared lists, for C-level checks in the
    prologue (``map`` over them; no Python line per value): objects by identity first (a
    replaced config object fails before its attributes are compared), then scalars by
    exact type and ``==`` (and the sign of zeros), small lists and dicts by their type,
    ``==`` with a copy and their items' types, and last the few values (tuples, NaN,
    containers of those) compared by :func:`value_key`, in Python."""

    same: ReadGroup = field(default_factory=ReadGroup)
    equal: ReadGroup = field(default_factory=ReadGroup)
    zeros: ReadGroup = field(default_factory=ReadGroup)  # expected: copysign(1.0, value)
    lists: ReadGroup = field(default_factory=ReadGroup)  # expected: a copy
    dicts: ReadGroup = field(default_factory=ReadGroup)
    list_item_types: list = field(default_factory=list)
    dict_item_types: list = field(default_factory=list)
    # The dicts read, and their versions when ``dicts.expected`` was copied: the same dict
    # at the same version holds the same items (scalars), so nothing else needs comparing.
    dict_objects: list = field(default_factory=list)
    dict_versions: list = field(default_factory=list)
    keyed: ReadGroup = field(default_factory=ReadGroup)
    # Dicts whose names are read (instances', classes'), and how many names each holds
    # (not counting the names the forward assigns, given with it): a name added shadows a
    # class's (``module.forward = ...``).
    namespaces: list = field(default_factory=list)
    namespace_lengths: list = field(default_factory=list)

    @classmethod
    def of(cls, reads: list[Read]) -> PythonGuards:
        g = cls()
        # Dict reads before attribute reads in each group, as the prologue reads them.
        for read in sorted(reads, key=lambda r: r.key is None):
            value = read.value
            if read.contents:
                items = list(value.values()) if type(value) is dict else list(value) if type(value) is list else ()
                if (
                    type(value) not in (list, dict)
                    or not all(map(_plain_scalar, items))
                    or (type(value) is dict and not all(type(k) is str for k in value))  # 1 == 1.0
                ):
                    g.keyed.add(read, read.contents_key)
                elif type(value) is dict:
                    g.dicts.add(read, dict(value))
                    g.dict_item_types += map(type, items)
                    g.dict_objects.append(value)
                    g.dict_versions.append(dict_version(value) if dict_version is not None else None)
                else:
                    g.lists.add(read, list(value))
                    g.list_item_types += map(type, items)
            elif not by_value(value):
                g.same.add(read, value)
            elif _plain_scalar(value):
                g.equal.add(read, value)
            elif type(value) is float and value == 0.0:
                g.equal.add(read, value)
                g.zeros.add(read, math.copysign(1.0, value))
            else:
                g.keyed.add(read, value_key(value))
        return g

    def dicts_read(self) -> list:
        """The dicts these guards read names or items of."""
        groups = (self.same, self.equal, self.zeros, self.lists, self.dicts, self.keyed)
        return [d for group in groups for d in group.dicts] + list(self.namespaces)

    def __bool__(self) -> bool:
        return bool(self.same or self.equal or self.lists or self.dicts or self.keyed or self.namespaces)
