"""The public entry points: ``jit`` and the functions that inspect what it compiled."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..core import Trace
from ..core.codegen import GeneratedFunction
from .compiled import CompiledFunction


class JittedFunction:
    """A function compiled by :func:`jit`; call it like the function."""

    def __init__(self, fn: Callable, compiled: CompiledFunction):
        self._dtcompile = compiled
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self._dtcompile(None, args, kwargs)


def _jitted_module_call(self, *args, **kwargs):
    return self._dtcompile(self, args, kwargs)


_jitted_classes: dict[type, type] = {}


def _jitted_class(cls: type) -> type:
    """``Jitted<cls>``: ``cls`` with a compiled ``__call__`` and a slot for the compiled
    function. A slot, not an attribute: the instance shares the module's ``__dict__``."""
    jitted_cls = _jitted_classes.get(cls)
    if jitted_cls is None:
        namespace = {
            "__call__": _jitted_module_call,
            "__slots__": ("_dtcompile",),
            "__module__": cls.__module__,
            "__qualname__": f"Jitted{cls.__qualname__}",
        }
        jitted_cls = _jitted_classes[cls] = type(f"Jitted{cls.__name__}", (cls,), namespace)
    return jitted_cls


def _jit_module(module: torch.nn.Module, cache: str, executors) -> torch.nn.Module:
    """The module, compiled: an object of a subclass of the module's class that shares the
    module's ``__dict__`` (so its parameters, buffers, submodules, training flag, hooks and
    attributes are the module's own) and whose call runs the compiled program."""
    compiled = CompiledFunction(module, module=module, cache=cache, executors=executors)
    compiled.name = type(module).__qualname__
    jitted = object.__new__(_jitted_class(type(module)))
    object.__setattr__(jitted, "__dict__", module.__dict__)
    object.__setattr__(jitted, "_dtcompile", compiled)
    return jitted


def jit(fn_or_module, *, cache: str = "constant values", executors=None):
    """Compile a function or module over DTensors (or plain tensors) into per-rank programs.

    ``cache``: ``"constant values"`` (one compilation per input metadata; the default) or
    ``"no caching"`` (trace and compile at every call). ``executors``: names in claiming
    order, by default ``["collectives", "torch"]``.
    """
    if isinstance(fn_or_module, torch.nn.Module):
        return _jit_module(fn_or_module, cache, executors)
    if not callable(fn_or_module):
        raise TypeError(f"dtcompile.jit expects a function or an nn.Module, not {type(fn_or_module).__name__}")
    compiled = CompiledFunction(fn_or_module, module=None, cache=cache, executors=executors)
    return JittedFunction(fn_or_module, compiled)


def _compiled(jfn) -> CompiledFunction:
    compiled = getattr(jfn, "_dtcompile", None)
    if not isinstance(compiled, CompiledFunction):
        raise TypeError(f"{jfn!r} was not made by dtcompile.jit")
    return compiled


def _last_entry(jfn):
    entry = _compiled(jfn).stats.last
    if entry is None:
        raise RuntimeError("dtcompile: this function has not been compiled yet; call it first")
    return entry


def last_traces(jfn) -> list[Trace]:
    """The computation traces of the last compilation, pass by pass; the last one is the
    execution trace, which is what runs."""
    return list(_last_entry(jfn).traces)


def last_prologue(jfn) -> GeneratedFunction:
    """The prologue of the last compilation (guards and input unpacking)."""
    return _last_entry(jfn).prologue


def last_epilogue(jfn) -> GeneratedFunction:
    """The epilogue of the last compilation (how outputs become DTensors again)."""
    return _last_entry(jfn).epilogue


def cache_hits(jfn) -> int:
    """Calls that reused a cache entry."""
    return _compiled(jfn).stats.hits


def cache_misses(jfn) -> int:
    """Calls that compiled a new entry."""
    return _compiled(jfn).stats.misses


def compile_seconds(jfn) -> list[float]:
    """The wall time of each compilation, in order."""
    return list(_compiled(jfn).stats.compile_seconds)
