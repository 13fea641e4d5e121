"""Symbolic sizes the user's code turns into text or hashes, while a call is traced.

Under ``cache="symbolic values"`` the traced code sees sizes as SymInts. ``str``,
``repr`` and f-strings of one give the symbol's name (``"s0"``), and hashing one raises;
code that computes with such text (``len(str(n))``, a size as a dict key) would bake in
the name or fail, where eager sees the number; so would a number read from tensor data
(``str(x.sum().item())``, a SymFloat). While a call is traced, these methods of
``torch.SymInt``, ``SymFloat`` and ``SymBool``, called from the user's code, take the
value instead: ``int(size)``, which guards the program on that value (a call with
another size compiles again, as it must; a number read from data is checked at run
time, as a branch on it is). Called from library code (torch printing a shape, a
log line), they behave as they do.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from ..core.code_origin import library_code


def _from_user_code() -> bool:
    frame = sys._getframe(2)  # the caller of the SymInt method
    return not library_code(frame.f_globals.get("__name__", ""), frame.f_code.co_filename)


@contextlib.contextmanager
def sizes_as_values_in_user_text():
    """Inside, ``repr``/``str``/``format``/``hash`` of a SymInt (a SymFloat, a SymBool:
    numbers read from data) called from the user's code use its value (see the module
    docstring)."""
    with contextlib.ExitStack() as stack:
        for cls, kind in ((torch.SymInt, int), (torch.SymFloat, float), (torch.SymBool, bool)):
            stack.enter_context(_values_in_user_text(cls, kind))
        yield


@contextlib.contextmanager
def _values_in_user_text(cls: type, kind: type):
    saved = {name: vars(cls)[name] for name in ("__repr__", "__format__", "__hash__") if name in vars(cls)}
    original_repr, original_hash = cls.__repr__, cls.__hash__

    def __repr__(self):
        return repr(kind(self)) if _from_user_code() else original_repr(self)

    def __format__(self, spec):
        if _from_user_code():
            return format(kind(self), spec)
        return object.__format__(self, spec)

    def __hash__(self):
        return hash(kind(self)) if _from_user_code() else original_hash(self)

    cls.__repr__, cls.__format__, cls.__hash__ = __repr__, __format__, __hash__
    try:
        yield
    finally:
        for name in ("__repr__", "__format__", "__hash__"):
            if name in saved:
                setattr(cls, name, saved[name])
            else:
                delattr(cls, name)
