"""Objects the call makes that hold no traced tensor and are not rebuilt item by item (a
set, a bytearray, an ``array.array``, a ``UserList``, a ``Counter``, a list subclass): a
deep copy of the traced one at each call, as eager makes one. What they hold that was
there before the call (a global's dict, an object a module holds, a module) is not
copied: eager's holds those very objects (:func:`kept_in`, :func:`copied`)."""

from __future__ import annotations

import collections
import copy

import torch


def kept_in(value: object, existing: set[int], depth: int = 6) -> tuple:
    """The objects ``value`` holds (at any depth up to ``depth``) that a copy of it must
    hold as they are: ones in ``existing`` (there before the call), modules, tensors."""
    kept, seen, stack = [], set(), [(value, 0)]
    while stack:
        item, level = stack.pop()
        if id(item) in seen or isinstance(item, (str, bytes, int, float, complex, type(None))):
            continue
        seen.add(id(item))
        if level and (id(item) in existing or isinstance(item, (torch.nn.Module, torch.Tensor))):
            kept.append(item)
            continue
        if level >= depth:
            continue
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset, collections.deque)):
            children = list(item)
        elif isinstance(item, collections.UserList | collections.UserDict):
            children = [item.data]
        else:
            children = list(getattr(item, "__dict__", {}).values())
        stack += [(child, level + 1) for child in children]
    return tuple(kept)


def copied(value: object, kept: tuple) -> object:
    """A deep copy of ``value`` holding the objects ``kept`` themselves."""
    return copy.deepcopy(value, {id(k): k for k in kept})
