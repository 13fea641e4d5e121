"""A module while it is traced: its tensors swapped for proxies, what the call assigned to
its modules' attributes, and the module put back as it was.

The traced module is the user's own object. While its forward runs on proxies, every
table that holds one of its tensors (``_parameters``, ``_buffers``, ``__dict__``) holds the
tensor's proxy instead, so tied weights stay tied. This is not
``torch.func.functional_call``: that leaves the proxies in a module registered under two
names (``self.b = self.a``), since it saves the second name's "original" after setting the
first, which is the same attribute of the same module.

Assignments the forward makes (``self.step = self.step + 1`` on a buffer, ``self.last =
y``, ``self.calls = 3``) are read off the tables afterwards and become
:class:`ModuleUpdate`\\ s, which the epilogue makes after each call, as eager's forward
would. Whatever happened, the module is then put back exactly as it was before tracing:
it never keeps a proxy, and a compile that fails leaves it unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..core import TracingError
from .outputs import HeldOutput

_TABLES = ("_parameters", "_buffers", "__dict__")
_MISSING = object()
_HELD = object()  # an entry moved, not assigned: what it holds at run time


@dataclass
class ModuleUpdate:
    """After each call, ``getattr(module, table)[key]`` is set to ``value`` (an
    OutputNode), or the key is removed where ``value`` is None."""

    module: torch.nn.Module
    table: str  # "_parameters", "_buffers" or "__dict__"
    key: str
    value: object | None
    path: str  # where it is, for messages: ``layers.0.last``
    moved: bool = False  # removed first, so that it is set last (``del self.a; self.a = v``)


def _table(module: torch.nn.Module, name: str) -> dict:
    return vars(module) if name == "__dict__" else getattr(module, name)


def _setattr_with_stand_ins(original, stand_ins: dict[int, object]):
    """``nn.Module.__setattr__`` while a module is traced: a parameter's stand-in (a proxy,
    not a ``Parameter``) assigned to a module attribute goes where eager puts the
    Parameter itself (``self.b.weight = self.a.weight`` ties them), in place of the
    TypeError ``__setattr__`` raises for a plain tensor in a parameter's slot."""

    def __setattr__(module, name, value):
        params = module.__dict__.get("_parameters")
        if id(value) not in stand_ins or params is None or torch.nn.modules.module._global_parameter_registration_hooks:
            return original(module, name, value)
        for table in (module.__dict__, module._buffers, module._modules):
            table.pop(name, None)
        module._non_persistent_buffers_set.discard(name)
        params[name] = value

    return __setattr__


class ModuleState:
    """The module tree of a traced call (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, proxies: dict[int, object]):
        self.proxies = proxies  # id of a tensor the module holds -> its proxy
        self.paths: dict[int, str] = {}
        self.modules: list[torch.nn.Module] = []
        for path, submodule in module.named_modules(remove_duplicate=False):
            if id(submodule) not in self.paths:
                self.paths[id(submodule)] = path
                self.modules.append(submodule)
        self._before: list[tuple[dict, dict]] = []  # (table, its items before tracing)
        self._traced: list[tuple[torch.nn.Module, str, dict]] = []  # (module, table name, items as traced)
        # id of a proxy standing for a Parameter -> (the proxy, where it stood: module, table, key)
        self._parameter_stand_ins: dict[int, tuple] = {}
        self._setattr = self._delattr = None
        # (id of a module, name) the call set or deleted, and deleted (set again, it moves last)
        self.assigned: set[tuple[int, str]] = set()
        self.deleted: set[tuple[int, str]] = set()
        self.refused: str | None = None  # (``updates``: told after a library's one-time setup is ruled out)

    def __enter__(self) -> ModuleState:
        for module in self.modules:
            for name in _TABLES:
                table = _table(module, name)
                self._before.append((table, dict(table)))
        for module in self.modules:
            for name in _TABLES:
                table = _table(module, name)
                for key, value in list(table.items()):
                    if id(value) in self.proxies:  # (tensors only: the keys are tensors' ids)
                        table[key] = stand_in = self.proxies[id(value)]
                        if isinstance(value, torch.nn.Parameter):
                            self._parameter_stand_ins.setdefault(id(stand_in), (stand_in, module, name, key))
                self._traced.append((module, name, dict(table)))
        self._setattr, self._delattr = torch.nn.Module.__setattr__, torch.nn.Module.__delattr__
        setattr_ = _setattr_with_stand_ins(self._setattr, self._parameter_stand_ins)
        torch.nn.Module.__setattr__ = _noted(setattr_, self.assigned)
        torch.nn.Module.__delattr__ = _noted(self._delattr, self.assigned, self.deleted)
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.Module.__setattr__, torch.nn.Module.__delattr__ = self._setattr, self._delattr
        self.restore()

    @contextlib.contextmanager
    def again(self):
        """The tables as traced (the stand-ins in place) while the backward is traced: code
        it runs (a checkpoint's recompute, a tensor hook) reads the module's tensors as the
        forward did, not the real ones (a DTensor's op would run now, its result a constant)."""
        for module, name, traced in self._traced:
            table = _table(module, name)
            table.update(traced)
        try:
            yield
        finally:
            self.restore()

    def restore(self) -> None:
        """Every table as it was before tracing (the same dict objects: others hold them)."""
        for table, items in self._before:
            if table.keys() != items.keys() or any(table[k] is not v for k, v in items.items()):
                table.clear()
                table.update(items)

    def assignments(self) -> list[tuple[torch.nn.Module, str, str, object, bool]]:
        """``(module, table, key, new value, moved)`` for each entry the call changed, in the
        table's order (the value ``_MISSING`` where removed). An entry the call deleted and
        set again moved last: it is removed, then set again, so that entries the caller
        reordered between calls stay as eager's code leaves them. Those are the entries it
        deleted (``del self.a``), and those after the longest start of the table's order
        that kept the order traced (deleted otherwise: ``vars(self).pop``); one of these the
        call neither set nor deleted is set again to what it holds at run time (``_HELD``)."""
        changed = []
        for module, name, traced in self._traced:
            table = _table(module, name)
            stayed = _kept_order(list(traced), list(table))
            for i, (key, value) in enumerate(table.items()):
                assigned, kept = (id(module), key) in self.assigned, traced.get(key, _MISSING) is value
                moved = key in traced and (i >= stayed or (id(module), key) in self.deleted)
                if moved or not kept:  # (one only moved holds at run time what it holds then)
                    changed.append((module, name, key, _HELD if kept and not assigned else value, moved))
            changed += [(module, name, key, _MISSING, False) for key in traced if key not in table]
        return changed

    def updates(self, describe, needs_gradients: bool) -> list[ModuleUpdate]:
        """The call's assignments as updates, their values described by ``describe`` (the
        output collector's); none, and :attr:`refused` said, in a call that needs gradients
        (unless the call is a library's one-time setup, run eagerly: ``LibrarySetUp``)."""
        updates = []
        for module, table, key, value, moved in self.assignments():
            prefix = self.paths[id(module)]
            path = f"{prefix}.{key}" if prefix else key
            if needs_gradients:
                self.refused = (
                    f"dtcompile.jit: the call (its forward, or a backward hook traced with it) assigns the module "
                    f"attribute {path!r}; that is replayed after each call only in calls that need no gradients"
                )
                return []
            if value is _MISSING:
                described = None
            elif value is _HELD:
                described = HeldOutput(module, table, key)
            elif id(value) in self._parameter_stand_ins:  # the Parameter itself, as eager assigns it
                described = HeldOutput(*self._parameter_stand_ins[id(value)][1:])
            else:
                described = describe(value, f"the module attribute {path!r}")
            updates.append(ModuleUpdate(module, table, key, described, path, moved))
        return updates


def _noted(original, *names: set):
    """``nn.Module.__setattr__`` or ``__delattr__`` while a module is traced, noting the names."""

    def noted(module, name, *value):
        for noted_names in names:
            noted_names.add((id(module), name))
        return original(module, name, *value)

    return noted


def _kept_order(before: list, after: list) -> int:
    """How many of the first keys of ``after`` appear in ``before`` in the same order."""
    at = 0
    for i, key in enumerate(after):
        while at < len(before) and before[at] != key:
            at += 1
        if at == len(before):
            return i
        at += 1
    return len(after)


def module_tensors(module: torch.nn.Module) -> list[tuple[str, object]]:
    """``(kind, (dotted name, tensor), ...)`` for the module's parameters, buffers and plain
    tensor attributes, every name of each. A module that holds one of its ancestors (a
    ``weakref.proxy`` to its parent passes as a module) is refused: the tree has no end."""
    _refuse_cycles(module, [], "the module")
    return [
        ("params", module.named_parameters(remove_duplicate=False)),
        ("buffers", module.named_buffers(remove_duplicate=False)),
        ("attributes", tensor_attributes(module)),
    ]


def _refuse_cycles(module, path: list, where: str) -> None:
    # (by its table of submodules: a weak proxy is another object, with its referent's tables)
    if any(module._modules is above for above in path):
        raise TracingError(
            f"dtcompile.jit: {where} is a module above it (a parent held as a submodule, perhaps through "
            "weakref.proxy): its module tree never ends, which tracing walks. Hold the parent otherwise "
            "(a weakref.ref, or outside _modules)"
        )
    path.append(module._modules)
    for name, child in module._modules.items():
        if child is not None:
            _refuse_cycles(child, path, f"{where}.{name}" if where != "the module" else name)
    path.pop()


def tensor_attributes(module: torch.nn.Module):
    """``(dotted name, tensor)`` for each plain tensor attribute of the module and its
    submodules (a cached mask, say): neither parameters nor buffers, but read at every
    call like them, so that assigning a new tensor is seen."""
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for attr, value in vars(owner).items():
            if issubclass(type(value), torch.Tensor):  # (not ``isinstance``: a dead weak proxy raises)
                yield (f"{owner_name}.{attr}" if owner_name else attr), value
