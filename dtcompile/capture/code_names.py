"""Which attribute names a module's call can read: the names its code uses.

``equivalence.py`` lets two blocks differ in an attribute (a layer's index) only where no
code a call of the block can run names it. Found from bytecode: each code object's names
(``co_names``: attributes, globals, methods) and string constants (``getattr(self,
"x")``), from the class's ``forward`` (and ``__call__``, ``__getattr__`` overrides up to
nn.Module) through the methods and properties it names, the hooks, and the functions and
classes these reach through globals and closure cells (a decorator's wrapped function), a
few levels deep; torch's own code is not followed, but nn.Module's call is included.
"""

from __future__ import annotations

import functools
import types

import torch

# A name in code that can read any attribute: a differing attribute is then never unread.
READS_ANY = frozenset({"__dict__", "vars", "__getattribute__", "getattr_static"})
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

# Where a module's code starts: what its call runs, and how it looks up attributes.
_ENTRY_POINTS = ("forward", "__call__", "_call_impl", "__getattr__", "__getattribute__")


@functools.cache
def module_call_names() -> frozenset:
    """The attribute names nn.Module's own call reads (``forward``, the hook tables), and
    its attribute lookup: an instance's ``forward`` (Hugging Face's tensor parallelism sets
    one per module) is read by every call."""
    names: set[str] = {"forward"}
    for fn in (torch.nn.Module._wrapped_call_impl, torch.nn.Module._call_impl, torch.nn.Module.__getattr__):
        _code_names(fn.__code__, names)
    return frozenset(names)


_names_of_class: dict[type, tuple[tuple, frozenset]] = {}  # class -> (its namespace's ids, names)


def class_names(cls: type) -> frozenset:
    """The attribute names and strings the code a call of ``cls`` can run names: its
    ``forward`` (and ``__call__``, ``__getattr__`` overrides up to nn.Module), the methods
    and properties of the class these name, and the functions they name through their
    globals (see :func:`_callable_names`). Methods only construction calls (``__init__``,
    ``reset_parameters``) are not followed, unless the forward names them. Found again
    when the class's namespace changed (a method patched)."""
    namespace: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if klass is torch.nn.Module or klass is object or not issubclass(klass, torch.nn.Module):
            continue
        namespace.update(vars(klass))
    ids = tuple((name, id(value)) for name, value in namespace.items())
    cached = _names_of_class.get(cls)
    if cached is not None and cached[0] == ids:
        return cached[1]
    names: set[str] = set()
    pending = [name for name in _ENTRY_POINTS if name in namespace]
    followed: set[str] = set()
    while pending:
        name = pending.pop()
        if name in followed:
            continue
        followed.add(name)
        found: set[str] = set()
        _callable_names(namespace[name], found, 3)
        names |= found
        pending.extend(n for n in found if n in namespace and n not in followed)
    _names_of_class[cls] = (ids, frozenset(names))
    return _names_of_class[cls][1]


def _callable_names(value, names: set, depth: int) -> None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        for accessor in (value.fget, value.fset):
            _callable_names(accessor, names, depth)
        return
    if isinstance(value, functools.partial):
        _callable_names(value.func, names, depth)
        return
    if isinstance(value, types.MethodType):
        value = value.__func__
    if isinstance(value, type) and depth > 0 and not _is_torch(value):
        for member in vars(value).values():  # a helper class the code names
            if isinstance(member, (types.FunctionType, staticmethod, classmethod, property)):
                _callable_names(member, names, depth - 1)
        return
    if isinstance(value, types.FunctionType):
        _code_names(value.__code__, names)
        if depth > 0:
            # A decorator's wrapper holds the function it wraps in a closure cell.
            for cell in value.__closure__ or ():
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if callable(contents):
                    _callable_names(contents, names, depth - 1)
            # The functions and classes it names through its globals (a helper reading ``module.x``).
            for name in value.__code__.co_names:
                target = value.__globals__.get(name)
                if isinstance(target, (types.FunctionType, type)) and not _is_torch(target):
                    _callable_names(target, names, depth - 1)


def _is_torch(fn) -> bool:
    return (getattr(fn, "__module__", None) or "").startswith("torch.")


def _code_names(code: types.CodeType, names: set) -> None:
    names.update(code.co_names)
    for const in code.co_consts:
        if isinstance(const, str):
            names.add(const)
        elif isinstance(const, types.CodeType):
            _code_names(const, names)


def hook_names(attributes: dict, names: set) -> None:
    """Add the names the hooks in a module's attributes (``vars(module)``) use."""
    for table in _HOOK_TABLES:
        for hook in attributes.get(table, {}).values():
            if callable(hook):
                _callable_names(hook, names, 3)
                for cell in getattr(hook, "__closure__", None) or ():
                    try:
                        _callable_names(cell.cell_contents, names, 2)
                    except ValueError:  # an empty cell
                        pass
