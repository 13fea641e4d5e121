"""Which code is the user's, and what a code object names.

Python state is guarded only where user code can read it (``python_state.py``): library
code (torch, transformers, the standard library, site-packages) is not followed, and what a
user function reads is found from its bytecode.
"""

from __future__ import annotations

import dis
import functools
import gc
import sys
import types

import torch

from ..core.code_origin import library_code


def is_library(obj: object) -> bool:
    """Whether a function, class or Python module is library code, whose reads are not
    guarded."""
    if isinstance(obj, types.ModuleType):
        module = obj.__name__
    else:
        module = getattr(obj, "__module__", None)
        module = module if isinstance(module, str) else ""  # (a metaclass's descriptor, Cython's)
    code = getattr(obj, "__code__", None)
    if isinstance(code, types.CodeType):  # (the class of functions has a descriptor there)
        filename = code.co_filename
    else:
        filename = getattr(sys.modules.get(module), "__file__", None) or ""
    return library_code(module, filename)


def class_namespace(cls: type) -> dict:
    """The dict behind ``cls.__dict__`` (a read-only view): the prologue reads names from
    it with ``dict.get`` like an instance's, and ``setattr(cls, ...)`` changes it in place.
    The view's only referent is that dict."""
    (names,) = gc.get_referents(vars(cls))
    return names


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})


def code_names(code: types.CodeType) -> tuple[set[str], set[str], set[str], set[str]]:
    """The global names a code object and the functions nested in it load, the Python
    modules they import (``import cfg`` inside a function), the other names they use
    (attributes: ``cfg.SCALE``), and the attribute names they may read (loaded, or a
    string constant: ``getattr(self, "pos")``). Told apart by the bytecode, so that an
    attribute (``out.sum``) does not guard a global of that name (a loop's ``out``)."""
    global_names, imported, other = set(), set(), set(code.co_names)
    loaded = {const for const in code.co_consts if isinstance(const, str)}
    for instruction in dis.get_instructions(code):
        if instruction.opname in _GLOBAL_LOADS:
            global_names.add(instruction.argval)
        elif instruction.opname == "IMPORT_NAME":
            imported.add(instruction.argval)
        elif instruction.opname in _ATTRIBUTE_LOADS:
            loaded.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner = code_names(const)
            for names, more in zip((global_names, imported, other, loaded), inner):
                names |= more
    return global_names, imported, other - global_names, loaded


def block_functions(modules, limit: int = 2000) -> list[types.FunctionType]:
    """The functions a block's code can run: its classes' methods (up to ``nn.Module``,
    and a user class's after it: a mixin), with their properties, static and class
    methods; the functions its modules hold as attributes (in a small dict, list or tuple,
    or a helper object, too); and, followed from each, the
    user functions and classes its globals, closure cells and user Python modules name
    (``scale_of(self)``: a helper reading ``REG[id(m)]``). Library code is not followed."""
    found: dict[int, types.FunctionType] = {}
    stack: list = []
    for sub in modules:
        mro = type(sub).__mro__
        for klass in mro:
            before = mro.index(klass) < mro.index(torch.nn.Module)
            if klass is not object and klass is not torch.nn.Module and (before or not is_library(klass)):
                # A library class's own methods only (``nn.Linear.forward``), not what its
                # descriptors wrap (a hub's kernel lookup, whose globals change as it runs).
                stack += [(value, isinstance(value, types.FunctionType)) for value in vars(klass).values()]
        stack += [(value, False) for value in vars(sub).values()]
    seen: set[int] = set()
    while stack and len(found) < limit:
        value, own = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, (staticmethod, classmethod)):
            stack.append((value.__func__, own))
        elif isinstance(value, property):
            stack += [(fn, own) for fn in (value.fget, value.fset, value.fdel)]
        elif isinstance(value, types.MethodType):
            stack.append((value.__func__, own))
        elif isinstance(value, functools.partial):
            stack.append((value.func, own))
        elif isinstance(value, types.FunctionType) and (own or not is_library(value)):
            found[id(value)] = value
            if not is_library(value):
                stack += [(item, False) for item in _named_code(value)]
        elif isinstance(value, type) and not is_library(value):
            stack += [
                (item, False) for klass in value.__mro__ if not is_library(klass) for item in vars(klass).values()
            ]
        elif isinstance(value, (dict, list, tuple)) and len(value) <= _CONTAINER_ITEMS:
            stack += [(item, False) for item in (value.values() if isinstance(value, dict) else value)]
        elif not isinstance(value, (torch.nn.Module, torch.Tensor)) and not is_library(type(value)):
            state = getattr(value, "__dict__", None)  # a helper object (``self.lookup.scale(self)``)
            if isinstance(state, dict):
                stack += [(type(value), False), *((item, False) for item in state.values())]
    return list(found.values())


_CONTAINER_ITEMS = 64  # a module's table of functions is followed; a long list of numbers is not


def _named_code(fn: types.FunctionType) -> list:
    """The user functions, classes and what user Python modules hold under the names the
    code uses, that ``fn``'s globals and closure cells name."""
    global_names, imported, attributes, _ = code_names(fn.__code__)
    named = [fn.__globals__.get(name) for name in global_names]
    named += [sys.modules.get(name) for name in imported]
    for cell in fn.__closure__ or ():
        try:
            named.append(cell.cell_contents)
        except ValueError:  # not assigned yet
            pass
    found = []
    for value in named:
        if isinstance(value, types.ModuleType):
            if not is_library(value):  # ``helpers.scale_of``: what the code names of it
                found += [vars(value)[name] for name in sorted(attributes & set(vars(value)))]
        elif isinstance(value, (types.FunctionType, type, functools.partial, types.MethodType)):
            found.append(value)
    return found
