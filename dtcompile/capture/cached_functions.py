"""The user's functions behind ``functools.lru_cache`` (or ``cache``) that the traced code
can read. While a call is traced, each is called through a stand-in put where the code
reads it (a global, a class attribute, a closure cell):

- with plain values (``causal_mask(4)``, ``get_config("a")``), the cached function itself,
  outside tracing: eager's call, which returns what the cache holds (a singleton made
  before, its attributes then guarded) or computes and keeps a real value, as eager's first
  call would; the program takes that value as eager does, and the prologue calls it again
  at each call, guarding that it returns the same (a cache emptied: computed anew);
- with a size under symbolic values, the same with the size's value, guarded (eager's
  cache is keyed by it: an entry per value);
- with a traced tensor, the function it wraps, traced: computed by the program at each
  call, and kept by no cache (it would hold the trace's values and hand them to its next
  caller)."""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from .python_reads import Read
from .user_code import is_library

_TRACED_NUMBERS = (torch.SymInt, torch.SymFloat, torch.SymBool)


def cached_stand_ins(python_state) -> list[tuple]:
    """Put a stand-in in place of each cached user function ``python_state`` read (or that
    a list, dict or function defaults it read hold); what to give to :func:`put_back_cached`."""
    swapped = []
    for read in list(python_state.reads):
        value = read.value
        if _user_cached(value):
            stand_in = _stand_in(value, python_state, read.where)
            if read.key is not None and isinstance(read.holder, dict):
                swapped.append((read.holder, read.key, value))
                read.holder[read.key] = stand_in
            elif read.key is None:
                swapped.append((read.holder, read.attribute, value))
                setattr(read.holder, read.attribute, stand_in)
        elif issubclass(
            type(value), (list, dict)
        ):  # (``fns[0](3)``, ``table["mask"](n)``; ``type``: a dead weak proxy raises at ``isinstance``)
            for key, item in list(value.items() if isinstance(value, dict) else enumerate(value)):
                if _user_cached(item):
                    swapped.append((value, key, item))
                    value[key] = _stand_in(item, python_state, f"{read.where}[{key!r}]")
        elif type(value) is tuple and read.key is None and read.attribute == "__defaults__":
            if any(map(_user_cached, value)):  # (``def f(x, mk=mk)``)
                swapped.append((read.holder, read.attribute, value))
                made = (_stand_in(v, python_state, f"{read.where}, a default") if _user_cached(v) else v for v in value)
                setattr(read.holder, read.attribute, tuple(made))
    return swapped


def put_back_cached(swapped: list) -> None:
    for holder, key, value in reversed(swapped):
        if isinstance(holder, (dict, list)):
            holder[key] = value
        else:
            setattr(holder, key, value)


def _user_cached(value) -> bool:
    return issubclass(type(value), functools._lru_cache_wrapper) and not is_library(value.__wrapped__)


def _stand_in(cached, python_state, where: str):
    @functools.wraps(cached)
    def call(*args, **kwargs):
        leaves = tree_flatten((args, kwargs))[0]
        if any(_traced(leaf) and not isinstance(leaf, _TRACED_NUMBERS) for leaf in leaves):
            return cached.__wrapped__(*args, **kwargs)
        if any(isinstance(leaf, _TRACED_NUMBERS) for leaf in leaves):
            # A size under symbolic values: eager's cache is keyed by its value, and returns
            # the object it holds (written in place since, or made before a global changed).
            # So the call is made with the value, guarded: an entry per value.
            args, kwargs = tree_map(_value, (args, kwargs))
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            result = cached(*args, **kwargs)
        call = _CachedCall(cached, args, kwargs)
        python_state.reads.append(Read(call, None, result, f"what {where} returns for {args}", attribute="result"))
        if not isinstance(result, torch.Tensor):  # what the code reads of it is guarded
            python_state.follow(result, f"the result of {where}")
        return result

    return call


class _CachedCall:
    """A call of a cached function, made again by the prologue (``result``): a cache hit,
    unless the cache was emptied since."""

    __slots__ = ("fn", "args", "kwargs")

    def __init__(self, fn, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    @property
    def result(self):
        return self.fn(*self.args, **self.kwargs)


def _value(leaf):
    """A traced number's value (the guard that it is that value is the trace's)."""
    if isinstance(leaf, torch.SymInt):
        return int(leaf)
    if isinstance(leaf, torch.SymFloat):
        return float(leaf)
    return bool(leaf) if isinstance(leaf, torch.SymBool) else leaf


def _traced(leaf) -> bool:
    if isinstance(leaf, _TRACED_NUMBERS):
        return True
    return isinstance(leaf, torch.Tensor) and (type(leaf) not in (torch.Tensor, torch.nn.Parameter) or is_fake(leaf))
