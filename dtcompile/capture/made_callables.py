"""Functions, partials, bound methods and classes the call makes and returns.

Eager makes them anew at each call (a ``def`` or ``lambda`` inside the function, a
``functools.partial``, ``Acc().add``); the trace holds the one made while tracing. One
whose state is plain values (never rebound) is made anew at each call from it
(:func:`remade`); one keeping state of the call (a list in its closure, a ``nonlocal``
counter, an object of the call, a class's attributes) is refused: the compiled call would
hand every caller that one object, so what one call's result did would show in the next's.
"""

from __future__ import annotations

import dis
import enum
import functools
import types

import torch

from ..core import TracingError

_ATOMS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    range,
    slice,
    type(Ellipsis),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
    types.ModuleType,
    types.BuiltinFunctionType,
    torch.nn.Module,  # (the same object at every call, in eager too)
)


def made_in_call(value: object, existing: set[int]) -> bool:
    """Whether ``value`` is a function, partial, bound method or class made by running the
    call (a ``def``, ``lambda`` or ``class`` statement inside a function), not one there before."""
    if id(value) in existing:
        return False
    if isinstance(value, functools.partial):
        return True
    if isinstance(value, types.MethodType):
        return made_in_call(value.__func__, existing) or not _plain(value.__self__, existing)
    if isinstance(value, (types.FunctionType, type)):
        return "<locals>" in getattr(value, "__qualname__", "")
    return False


def check_remakable(value: object, existing: set[int], where: object) -> None:
    """Raise ``TracingError`` where ``value`` (made in the call) keeps state of the call."""
    reason = _state_kept(value, existing)
    if reason is not None:
        raise TracingError(
            f"dtcompile.jit: {where} holds {_named(value)}, made inside the call, which keeps state of the "
            f"call ({reason}): eager makes it anew at each call, and the compiled call would return the one made "
            "while tracing at every call. Make it outside the compiled function, or return the values it holds"
        )


def remade(value: object) -> object:
    """``value`` (made in the call, keeping no state of it) made anew, as the call would."""
    if isinstance(value, functools.partial):
        made = functools.partial(remade(value.func), *value.args, **value.keywords)
        made.__dict__.update(value.__dict__)
        return made
    if not isinstance(value, types.FunctionType) or "<locals>" not in value.__qualname__:
        return value
    made = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, value.__closure__)
    made.__kwdefaults__ = None if value.__kwdefaults__ is None else dict(value.__kwdefaults__)
    made.__qualname__, made.__doc__, made.__module__ = value.__qualname__, value.__doc__, value.__module__
    made.__annotations__ = dict(value.__annotations__)
    made.__dict__.update(value.__dict__)
    return made


def _state_kept(value: object, existing: set[int]) -> str | None:
    if isinstance(value, type):
        return "a class defined in the function: its attributes"
    if isinstance(value, types.MethodType):
        return f"the {type(value.__self__).__name__} it is bound to"
    if isinstance(value, functools.partial):
        if not _plain(value.func, existing) and not made_in_call(value.func, existing):
            return "its function"
        parts = [*value.args, *value.keywords.values()]
        if not all(_plain(v, existing) for v in parts):
            return "an argument it holds"
        return _state_kept(value.func, existing) if made_in_call(value.func, existing) else None
    rebound = _rebound(value.__code__)
    for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
        if name in rebound:
            return f"the variable {name!r} it rebinds (nonlocal)"
        try:
            contents = cell.cell_contents
        except ValueError:  # (not yet assigned)
            return f"the variable {name!r} it closes over"
        if not _plain(contents, existing):
            return f"the {type(contents).__name__} {name!r} it closes over"
    defaults = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values(), *value.__dict__.values()]
    if not all(_plain(v, existing) for v in defaults):
        return "a default argument or an attribute of it"
    return None


def _plain(value: object, existing: set[int]) -> bool:
    """A value a function made anew may share with the one made while tracing."""
    if isinstance(value, _ATOMS) or id(value) in existing:
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_plain(v, existing) for v in value)
    if isinstance(value, (types.FunctionType, type)):
        return "<locals>" not in value.__qualname__ or _state_kept(value, existing) is None
    return False


def _rebound(code: types.CodeType) -> set[str]:
    """The free variables ``code`` (or a function it defines) assigns or deletes."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("STORE_DEREF", "DELETE_DEREF")}
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _rebound(constant)
    return names


def _named(value: object) -> str:
    if isinstance(value, functools.partial):
        return "a functools.partial"
    if isinstance(value, types.MethodType):
        return f"the bound method {value.__func__.__qualname__}"
    if isinstance(value, type):
        return f"the class {value.__qualname__}"
    return f"the function {value.__qualname__}"
