"""Telling whether two saved_tensors_hooks pairs do the same, for the guards and for a
training step called under hooks other than those it was traced under."""

from __future__ import annotations

import types

import torch


def same_saved_hooks(a: tuple | None, b: tuple | None) -> bool:
    """Whether two saved_tensors_hooks pairs (pack, unpack) do the same: the same
    functions, or functions of the same code over the same defaults and closure cells
    (``save_on_cpu()`` entered anew at each step makes new closures of equal cells)."""
    if a is None or b is None:
        return a is b
    return all(_same_function(x, y) for x, y in zip(a, b))


def _same_function(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, types.MethodType) and isinstance(b, types.MethodType):
        return a.__self__ is b.__self__ and _same_function(a.__func__, b.__func__)
    if not (isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType)):
        return False
    if a.__code__ is not b.__code__ or a.__globals__ is not b.__globals__:
        return False
    return (
        _same_values(a.__defaults__ or (), b.__defaults__ or ())
        and _same_values(_cells(a), _cells(b))
        and (a.__kwdefaults__ or {}).keys() == (b.__kwdefaults__ or {}).keys()
        and _same_values(tuple((a.__kwdefaults__ or {}).values()), tuple((b.__kwdefaults__ or {}).values()))
    )


def _cells(fn) -> tuple:
    contents = []
    for cell in fn.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell
            contents.append(_EMPTY)
    return tuple(contents)


_EMPTY = object()


def _same_values(a: tuple, b: tuple) -> bool:
    """Scalars by type and value, anything else by identity."""
    scalars = (type(None), bool, int, float, str, torch.device, torch.dtype)
    return len(a) == len(b) and all(
        x is y or (type(x) is type(y) and isinstance(x, scalars) and x == y) for x, y in zip(a, b)
    )
