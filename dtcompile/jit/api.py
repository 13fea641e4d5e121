"""The public entry points: ``jit`` and the functions that inspect what it compiled."""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable

import torch

from ..core import Trace, TracingError
from ..core.codegen import GeneratedFunction
from .communication import Collective, program_collectives
from .compiled import CompiledFunction


class JittedFunction:
    """A function compiled by :func:`jit`; call it like the function. As a method, each
    object gets the function compiled with that object closed over (a bound method)."""

    def __init__(self, fn: Callable, compiled: CompiledFunction):
        self._dtcompile = compiled
        self._fn = fn
        self._bound: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        functools.update_wrapper(self, fn)

    def __call__(self, /, *args, **kwargs):
        return self._dtcompile(None, args, kwargs)

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        try:
            bound = self._bound.get(instance)
        except TypeError as error:
            raise TypeError(
                f"dtcompile.jit: a jitted method needs objects that can be weakly referenced and hashed; "
                f"{type(instance).__name__} cannot"
            ) from error
        if bound is None:
            compiled = self._dtcompile
            method = functools.partial(self._fn, instance)
            functools.update_wrapper(method, self._fn)
            bound = self._bound[instance] = jit(
                method, cache=compiled.cache, executors=compiled.executor_spec, check=compiled.check
            )
        return bound


def _jitted_module_call(self, /, *args, **kwargs):
    compiled = self._dtcompile
    cls = type(self)
    if cls is not compiled.jitted_class or _names(cls) != compiled.jitted_names:
        # The module itself is traced (its ``self`` is the module's own class, as eager's
        # code may ask): what changes the jitted object's class alone is not seen there.
        raise TracingError(
            f"dtcompile.jit: the class of the jitted {compiled.name} was changed after jit (a parametrization "
            "registered on it, its __class__ set, a method patched on the jitted class): make the change on the "
            "module before dtcompile.jit, or on the module itself (the jitted module follows its class)"
        )
    return compiled(self, args, kwargs)


def _names(cls: type) -> int:
    """How many names a jitted class holds, but ``__slotnames__`` (copyreg's cache, set when
    an instance is first copied)."""
    namespace = vars(cls)
    return len(namespace) - ("__slotnames__" in namespace)


def _plain(jitted: torch.nn.Module) -> torch.nn.Module:
    """The jitted module as an object of the module's class (sharing its ``__dict__``)."""
    plain = object.__new__(type(jitted._dtcompile.module))
    object.__setattr__(plain, "__dict__", jitted.__dict__)
    return plain


def _jitted_module_copy(self):
    """A shallow copy: the module's, with a ``__dict__`` of its own, compiled anew."""
    compiled = self._dtcompile
    return jit(copy.copy(_plain(self)), cache=compiled.cache, executors=compiled.executor_spec, check=compiled.check)


def _rejit(module: torch.nn.Module, cache: str, executors, check=None) -> torch.nn.Module:
    return jit(module, cache=cache, executors=executors, check=check)


def _jitted_module_deepcopy(self, memo):
    """A deep copy of the module, compiled anew (with an empty cache of its own)."""
    compiled = self._dtcompile
    return jit(
        copy.deepcopy(_plain(self), memo), cache=compiled.cache, executors=compiled.executor_spec, check=compiled.check
    )


def _jitted_module_reduce_ex(self, protocol):
    """Pickled as the plain module and unpickled compiled anew (``torch.save`` works)."""
    compiled = self._dtcompile
    return _rejit, (_plain(self), compiled.cache, compiled.executor_spec, compiled.check)


_jitted_classes: dict[type, type] = {}


def _plain_new(cls, /, *args, **kwargs):
    """``type(jitted)(...)`` (architecture-cloning code, ``from_pretrained``): a module of
    the class itself, as eager's ``type(model)(...)`` makes."""
    return cls.__bases__[0](*args, **kwargs)


def _jitted_class(cls: type) -> type:
    """``cls`` with a compiled ``__call__`` and a slot for the compiled function (a slot, not
    an attribute: the instance shares the module's ``__dict__``), under ``cls``'s names: code
    that names a model by its class (Hugging Face's ``save_pretrained`` writes it into the
    config) sees eager's."""
    jitted_cls = _jitted_classes.get(cls)
    if jitted_cls is None:
        namespace = {
            "__call__": _jitted_module_call,
            "__copy__": _jitted_module_copy,
            "__deepcopy__": _jitted_module_deepcopy,
            "__reduce_ex__": _jitted_module_reduce_ex,
            "__new__": _plain_new,
            "__slots__": ("_dtcompile",),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        jitted_cls = _jitted_classes[cls] = type(cls.__name__, (cls,), namespace)
    return jitted_cls


def _jit_module(module: torch.nn.Module, cache: str, executors, check) -> torch.nn.Module:
    """The module, compiled: an object of a subclass of the module's class that shares the
    module's ``__dict__`` (so its parameters, buffers, submodules, training flag and
    attributes are the module's own) and whose call runs the compiled program (hooks ran
    while tracing; the prologue guards them)."""
    compiled = CompiledFunction(module, module=module, cache=cache, executors=executors, check=check)
    compiled.name = type(module).__qualname__
    jitted = object.__new__(_jitted_class(type(module)))
    object.__setattr__(jitted, "__dict__", module.__dict__)
    object.__setattr__(jitted, "_dtcompile", compiled)
    compiled.jitted_class = type(jitted)
    compiled.jitted_names = _names(type(jitted))
    return jitted


_TORCHSCRIPT = (
    "dtcompile.jit: a TorchScript module (torch.jit.script or torch.jit.trace) runs in TorchScript's "
    "interpreter, which dtcompile cannot trace; compile the nn.Module it was made from"
)


def jit(fn_or_module, *, cache: str = "constant values", executors=None, check: str | None = None):
    """Compile a function or module over DTensors (or plain tensors) into per-rank programs.

    ``cache``: ``"constant values"`` (one compilation per input metadata; the default),
    ``"symbolic values"`` (the sizes of the call's tensors are symbolic: one compilation
    serves every size that meets its guards), or ``"no caching"`` (trace and compile at
    every call; for debugging). ``executors``: names in claiming order, by default
    ``["collectives", "torch"]``. A module comes back as a jitted module: the same object
    state under a subclass of its class whose call runs the compiled program.

    ``check="eager"`` (or the environment variable ``DTCOMPILE_CHECK=eager``) also runs the
    eager program at each call and raises :class:`EagerMismatchError` where outputs or
    changed inputs differ, naming the first line of the per-rank program whose value
    differs: a debugging mode (each call runs three or four times).
    """
    if isinstance(fn_or_module, torch.jit.ScriptModule):
        raise TypeError(_TORCHSCRIPT)
    if isinstance(fn_or_module, torch.nn.Module):
        return _jit_module(fn_or_module, cache, executors, check)
    if not callable(fn_or_module):
        raise TypeError(f"dtcompile.jit expects a function or an nn.Module, not {type(fn_or_module).__name__}")
    compiled = CompiledFunction(fn_or_module, module=None, cache=cache, executors=executors, check=check)
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
    """The epilogue of the last compilation: how the computation's flat outputs become the
    call's result (for a training entry, the DTensors are wrapped before, inside the
    autograd Function, and this rebuilds the containers)."""
    return _last_entry(jfn).epilogue


def collectives(jfn) -> list[Collective]:
    """The collectives of the last compilation's execution traces, in the order each
    program starts them (for a training entry: the forward's, then the backward's). Each
    :class:`Collective` says its kind, process group and mesh dim, the bytes this rank
    hands it and gets back (the expression, under symbolic sizes), and whether compute
    runs between its start and its wait; ``str()`` of one is a line of text."""
    entry = _last_entry(jfn)
    rows = []
    for trace in entry.traces:
        if trace.title.startswith("execution"):
            rows += program_collectives(trace, entry.group_labels)
    return rows


def cache_hits(jfn) -> int:
    """Calls that reused a cache entry."""
    return _compiled(jfn).stats.hits


def cache_misses(jfn) -> int:
    """Calls that compiled a new entry."""
    return _compiled(jfn).stats.misses


def timed_call(jfn, *args, **kwargs):
    """Call ``jfn`` (a jitted function or module) and return ``(result, CallTimes)``: the
    seconds spent in its guards (prologue), its computation and its epilogue. The call must
    hit the cache (call it once first) and not need gradients."""
    compiled = _compiled(jfn)
    module = jfn if compiled.module is not None else None
    return compiled.timed_call(module, args, kwargs)


def compile_seconds(jfn) -> list[float]:
    """The wall time of each compilation, in order."""
    return list(_compiled(jfn).stats.compile_seconds)
