"""Python state the traced program read: globals, closure cells and module attributes.

A compiled program runs the user's Python once, while tracing; the Python values it read
then (``S = 2.0`` in ``lambda x: x * S``, ``self.scale``, ``self.use_bias``,
``self.config.eps``, a helper function it called) are baked into the program. Each is
guarded like an argument, so that a change compiles a new entry, as eager would see it.

Exact read tracking is not possible in Python (module ``__dict__`` lookups bypass every
hook), so what is guarded is what the code *can* read, found before tracing:

- **Code.** The traced function (or the module tree's classes' methods and hooks) and the
  user code these name, recursively; not library code (torch, the stdlib, site-packages).
- **Globals** each such function's code loads (``LOAD_GLOBAL`` in its bytecode, nested
  functions and lambdas included), from its ``__globals__`` (one absent there, a builtin
  or a name not defined yet, is guarded as absent); the **closure cells** it holds; its
  **default arguments** (``__defaults__``, ``__kwdefaults__``) and **attributes**
  (``f.scale``); a ``functools.partial``'s arguments, keywords and attributes; the
  attributes a Python module holds (imported at the top or inside the function) under the
  other names its code uses (``cfg.SCALE``; of a library module, by identity: ``F.relu``
  patched is seen); where the code names ``os`` or ``getenv``, the environment's contents.
- **Module attributes** of the jitted module's tree, and of any module the code reaches
  (a global model a loss function calls; for those also the training flag and which
  parameters, buffers, submodules and tensor attributes they hold): every entry of each
  submodule's ``__dict__`` except tensors, submodules and ``nn.Module``'s own tables
  (parameters, buffers, submodules, hooks and the training flag are guarded elsewhere).
  An attribute the forward assigns stays guarded (``if self.cache is None``, then
  ``self.cache = ...``; its absence, for ``hasattr``), but for one no user code loads by
  name that exists before the call (absent before, it is guarded absent).
- **Plain objects and containers, all the way down**: the attributes of a plain object
  (a config; those in its ``__slots__`` too; an object the code calls, and an
  ``lru_cache``'s wrapped function; a ``singledispatch`` function's implementations) held
  in such an attribute, global or cell (``self.config.scale``), the items of a container
  (and what a weak reference in one refers to), and what those hold in turn
  (``self.config.attention.rope.theta``, ``TABLE[0]["act"]``), each object once.
- **Classes**: every attribute a user class (a module's, a config's, one the code names)
  and its user bases define (methods by identity, constants by value, and what each holds
  followed: a descriptor's state, a nested class, a class-level table); of a library
  module class and its bases up to ``nn.Module``, the ``forward`` (patching a library's
  layer). So a method or class constant replaced after compiling is seen.
- **Which names** each of those instance and class dicts holds (by their number; the names
  the forward assigns are not counted): a name added shadows what the code read from a
  class (``layer.forward = wrapped``, ``self.SCALE = 3`` over a class constant).

How: ``None``/``bool``/``int``/``float``/``complex``/``str``/``bytes`` and tuples of them
by exact type and value (``1``, ``1.0`` and ``True`` are three values; so are ``0.0`` and
``-0.0``); anything that can change in place without becoming another object by identity
and by its contents (``python_reads.value_key``), whatever its size: lists, dicts, sets
and deques of any class (an ``OrderedDict``, a ``defaultdict`` and its factory, a list
subclass and its attributes), tuples holding such or objects, bytearrays, memoryviews and
ctypes objects (by their bytes), arrays and NumPy arrays of numbers; the tensors in a
container by identity (read at run time); anything else by identity. A ``custom_op``'s
definition is followed where the trace calls it (``python_guards.after_tracing``).

Not guarded: iterators (one the traced code advances is refused: ``snapshots.py``), a
library class's attributes but a module's ``forward`` (and ``nn.Module``'s own), a library
object's (but ``objects.TORCH_USER_STATE``'s, as a plain object's: an optimizer's),
values read inside library code (but what a library's wrapper of a user function wraps:
``@torch.no_grad()``), names reached only through strings (``getattr(cfg, name)``), NumPy
arrays of objects' contents, objects of C types other than the containers above (a
built-in bound method's object and a dict view's dict are followed). A global, class
attribute or closure variable the traced code rebinds is refused and put back.
"""

from __future__ import annotations

import copyreg
import enum
import functools
import logging
import os
import sys
import types
import weakref
from dataclasses import dataclass, field

import torch

from .data_parallel import refuse_torchscript
from .input_nodes import ObjectInput, iter_nodes
from .objects import attribute_holder, attribute_or_none, dict_view, guarded_items, read_through, referent, slot_names
from .python_guards import AfterTracing
from .python_reads import ABSENT, Read, by_value, contents_guarded, raw_memory, value_key
from .user_code import class_namespace, code_names, is_library

# nn.Module's own entries of a module's __dict__ (tables, hooks, the training flag):
# guarded by the prologue's module checks, or never read by the program.
_MODULE_TABLES = frozenset(vars(torch.nn.Module()))
# State that decides no value computed: a logger's (the levels enabled), torch.ops' (its op
# namespaces, loaded as they are first used: while compiling too). Read by identity only.
_NOT_FOLLOWED = (logging.Logger, logging.LoggerAdapter, logging.Handler, type(torch.ops), type(torch.ops.aten))
_DYNAMIC_LOOKUPS = frozenset({"globals", "eval", "exec", "vars"})  # builtins reading globals by name
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


@dataclass
class PythonState(AfterTracing):
    """What the traced program can read (see the module docstring): the reads, in order."""

    reads: list[Read] = field(default_factory=list)
    # Every module reached, with its path: its code runs and its attributes are read.
    modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    # The dicts whose set of names is guarded (by their length; each name read on its own):
    # a name added shadows what the code read from a class (an instance's ``forward``, a
    # class constant set on an instance, a method overriding a base class's).
    namespaces: list[dict] = field(default_factory=list)
    _seen_reads: set = field(default_factory=set, repr=False)
    _walked: set = field(default_factory=set, repr=False)  # ids: each held in ``_held`` (an id freed is reused)
    _held: list = field(default_factory=list, repr=False)
    _seen_namespaces: set = field(default_factory=set, repr=False)
    # (id of a module's dict, name) the forward assigns or removes: made after each call.
    _assigned_names: dict = field(default_factory=dict, repr=False)
    _classes: dict = field(default_factory=dict, repr=False)  # id of a class's namespace -> the class
    # The attribute names the user code followed may read (``self.pos``, ``getattr``); "*": any (``vars``).
    _attribute_loads: set = field(default_factory=set, repr=False)

    @classmethod
    def of_function(cls, fn: object) -> PythonState:
        (state := cls()).follow(fn, getattr(fn, "__qualname__", "the function"))
        return state

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> PythonState:
        (state := cls()).module_tree(module, "", reached=False)
        return state

    def _read(self, holder: object, key: str | None, value: object, where: str, attribute="cell_contents") -> None:
        """Guard ``holder[key]``, or with ``key`` None the ``attribute`` of ``holder``."""
        seen = (id(holder), key if key is not None else attribute)
        if seen in self._seen_reads:
            return
        self._seen_reads.add(seen)
        self.reads.append(Read(holder, key, value, where, attribute=attribute))
        if contents_guarded(value):
            contents = Read(holder, key, value, f"the contents of {where}", True, value_key(value), attribute=attribute)
            self.reads.append(contents)

    def module_tree(self, root: torch.nn.Module, prefix: str, reached: bool = True) -> None:
        """Each submodule's attributes, the code of its class and its hooks. A module the
        code ``reached`` (not the jitted one, whose state the prologue guards as inputs):
        also its training flag, and which parameters, buffers, submodules and tensor
        attributes it holds, by identity (its tensors are captured by reference)."""
        for path, module in root.named_modules(prefix=prefix):
            if id(module) in self._walked:
                continue
            refuse_torchscript(module, path)
            self._walked.add(id(module))
            self.modules.append((path, module))
            owner = path or "the module"
            self._class(type(module), module_class=True)
            self._namespace(vars(module))
            if reached:
                if "training" in vars(module):
                    self._read(vars(module), "training", module.training, f"the training flag of {owner}")
                else:  # (torch.compile's module: a property, its module's flag)
                    self._read(module, None, module.training, f"the training flag of {owner}", attribute="training")
                self._read(module, None, type(module), f"the class of {owner}", attribute="__class__")
                for table in _HOOK_TABLES:  # (the jitted module's are guarded with its tree)
                    self._read(vars(module), table, getattr(module, table), f"the {table} of {owner}")
                for table in (module._parameters, module._buffers, module._modules, vars(module)):
                    self._namespace(table)  # (an entry added later: ``net.append(...)``, ``register_parameter``)
                    for name, value in table.items():
                        if value is None or isinstance(value, (torch.Tensor, torch.nn.Module)):
                            self._read(table, name, value, f"{name!r} of {owner}")
                        if isinstance(value, torch.Tensor):
                            self.follow(value, f"{name!r} of {owner}")
            for name, value in vars(module).items():
                if name in _MODULE_TABLES or issubclass(type(value), (torch.Tensor, torch.nn.Module)):
                    continue  # (by type: a dead weak proxy raises at isinstance)
                where = f"attribute {name!r} of {owner}"
                self._read(vars(module), name, value, where)
                self.follow(value, where)
            for table in _HOOK_TABLES:
                for hook in getattr(module, table).values():
                    self.follow(hook, f"a hook of {owner}")

    def follow_inputs(self, roots: list) -> None:
        """What the code reads through the call's objects and tensors (guarded as inputs): a class's attributes
        (``cfg.scale``), what a tensor's attributes hold (``w.info.scale``), an enum member's (``mode.scale``), a
        dict's keys (``{cfg: t}``), a module passed (``step(model, x)``: as one the code reaches)."""
        for node in (n for root in roots for n in iter_nodes(root)):
            if isinstance(node, ObjectInput):
                self.follow(node.type, f"the class of {node.path}")
            held = [node.value] if isinstance(getattr(node, "value", None), (enum.Enum, torch.nn.Module)) else []
            for value in (*held, *getattr(node, "keys", ())):
                self.follow(value, f"{node.path} (an enum member, or a key)")
            for name, value in getattr(node, "attributes", {}).items():
                self.follow(value, f"attribute {name!r} of {node.path}")

    def follow(self, value: object, where: str, names: set[str] = frozenset()) -> None:
        """What reading ``value`` lets the code read further: a user function's globals and
        cells, a user class's methods, a plain object's attributes, a container's items, what
        those hold in turn (``self.config.attention.rope.theta``), a Python module's ``names``."""
        value = referent(value)  # (through a weak proxy)
        if id(value) in self._walked or by_value(value) or isinstance(value, _NOT_FOLLOWED):
            return
        if value is os.getenv:  # (``from os import getenv``: the environment it reads)
            self._python_module(os, frozenset())
        self._held.append(value)
        if isinstance(value, torch.Tensor):  # a closed-over tensor's Python attributes (``w.scale``)
            self._walked.add(id(value))
            self._namespace(vars(value))  # (one added later: ``getattr(w, "scale", 1.0)``)
            self.reads.append(Read(value, None, vars(value), f"the attribute dict of {where}", attribute="__dict__"))
            for name, item in list(vars(value).items()):
                if not name.startswith("_"):
                    self._read(vars(value), name, item, f"{where}.{name}")
                    self.follow(item, f"{where}.{name}")
            return
        if contents_guarded(value):  # what its items hold: a config in a list
            self._walked.add(id(value))
            if not isinstance(value, bytearray) and not hasattr(value, "__array__") and not raw_memory(value):
                keyed = isinstance(value, (dict, types.MappingProxyType))
                for key, item in value.items() if keyed else enumerate(value):
                    self.follow(item, f"{where}[{key!r}]")
                    self.follow(key if keyed else None, f"a key of {where}")  # (an object, a module: ``{lin: 0.5}``)
            return
        if isinstance(value, weakref.ref):  # (a WeakValueDictionary's): what it refers to, while alive
            self._walked.add(id(value))
            self.follow(value(), where)
            return
        if isinstance(value, functools.partial):
            self._walked.add(id(value))
            self.follow(value.func, where)
            # Its keywords and attributes (``act.k``) can change in place, and what its arguments hold.
            self._read(value, None, value.keywords, f"the keyword arguments of {where}", attribute="keywords")
            self._read(value, None, value.args, f"the arguments of {where}", attribute="args")
            if attributes := vars(value):
                self._read(value, None, attributes, f"the attributes of {where}", attribute="__dict__")
            for item in (*value.args, *value.keywords.values(), *attributes.values()):
                self.follow(item, where)
            return
        compiled = attribute_or_none(value, "_dtcompile")  # a jitted function called inside: inlined
        if compiled is not None and not isinstance(value, torch.nn.Module):
            self._walked.add(id(value))
            self._attributes(value, where, skip=("_dtcompile", "_fn"))  # (copied from the function)
            self.follow(attribute_or_none(value, "_fn"), where)
            return
        if isinstance(value, types.MethodType):
            self.follow(value.__func__, where)
            self.follow(value.__self__, where)
            return
        if (owner := read_through(value)) is not None:  # ``settings.get``, ``settings.values()``
            self._walked.add(id(value))
            if dict_view(value):  # its dict, by what it holds (``mapping`` is a new proxy each time)
                held, where = value.mapping, f"the dict of {where}"
                self.reads.append(Read(value, None, held, where, True, value_key(held), attribute="mapping"))
            else:
                self._read(value, None, owner, f"the object of {where}", attribute="__self__")
            self.follow(owner, where)
            return
        if isinstance(value, torch.nn.Module):  # a model a function calls
            self.module_tree(value, where)
            return
        if isinstance(value, types.FunctionType) and isinstance(
            attribute_or_none(value, "registry"), types.MappingProxyType
        ):
            # ``functools.singledispatch``: its implementations by class (one registered later
            # too), and the function it wraps
            self._walked.add(id(value))
            self._read(value, None, value.registry, f"the implementations of {where}", attribute="registry")
            self.follow(value.registry, f"the implementations of {where}")
            self.follow(attribute_or_none(value, "__wrapped__"), where)
        elif isinstance(value, types.FunctionType):
            self._function(value)
        elif isinstance(value, type):
            self._class(value)
        elif isinstance(value, types.ModuleType):
            self._python_module(value, names)
        elif attribute_holder(value):
            self._walked.add(id(value))
            self._class(type(value))
            self._read(value, None, type(value), f"the class of {where}", attribute="__class__")  # (assignable)
            if isinstance(attribute_or_none(value, "__dict__"), dict):
                # Read from this dict: one put in its place (``cfg.__dict__ = d``) is seen by identity.
                self.reads.append(
                    Read(value, None, vars(value), f"the attribute dict of {where}", attribute="__dict__")
                )
                self._namespace(vars(value))
                for holder, name, item in guarded_items(value):
                    self._read(holder, name, item, f"{where}.{name}")
                    self.follow(item, f"{where}.{name}")
            for name in slot_names(type(value)):  # read as attributes; one not set, as absent
                item = getattr(value, name, ABSENT)
                self._read(value, None, item, f"{where}.{name}", attribute=name)
                self.follow(item, f"{where}.{name}")

    def _function(self, fn: types.FunctionType) -> None:
        if id(fn) in self._walked:
            return
        self._walked.add(id(fn))
        if is_library(fn):  # what a library's wrapper wraps: ``@torch.no_grad()``, ``@contextmanager``
            self.follow(getattr(fn, "__wrapped__", None), fn.__qualname__)
            return
        code = fn.__code__
        global_names, imported, attributes, loaded = code_names(code)
        self._attribute_loads |= loaded | ({"*"} if "vars" in global_names or "__dict__" in loaded else set())
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # not assigned yet: reading it would raise
                continue
            where = f"closure variable {name!r} of {fn.__qualname__}"
            self._read(cell, None, value, where)
            self.follow(value, where, attributes)
        self._read(fn, None, code, f"the code of {fn.__qualname__}", attribute="__code__")  # assignable too
        self._attributes(fn, fn.__qualname__)  # ``f.scale``, a function's "static variable"
        for name in ("__name__", "__qualname__"):  # (assignable, and read: ``act.__name__ == "gelu"``)
            self._read(fn, None, getattr(fn, name), f"the {name} of {fn.__qualname__}", attribute=name)
        for attribute in ("__defaults__", "__kwdefaults__"):  # assignable, and read at each call
            defaults = getattr(fn, attribute)
            where = f"the default arguments of {fn.__qualname__}"
            self._read(fn, None, defaults, where, attribute=attribute)
            for value in (defaults or {}).values() if isinstance(defaults, dict) else defaults or ():
                self.follow(value, where)
        for name in sorted(imported):
            module = sys.modules.get(name)
            if module is not None:
                self._python_module(module, attributes | set(name.split(".")[1:]))
        module_globals = fn.__globals__
        if global_names & _DYNAMIC_LOOKUPS:  # ``globals()["K"]``, ``eval("K")``: any global, not followed
            for name in sorted(set(module_globals) - global_names):
                if not name.startswith("__"):
                    self._read(module_globals, name, module_globals[name], f"global {name!r} read by {fn.__qualname__}")
        builtins = vars(b) if isinstance(b := module_globals.get("__builtins__", {}), types.ModuleType) else b
        for name in sorted(global_names):
            where = f"global {name!r} read by {fn.__qualname__}"
            # Absent: a builtin (read from the builtins then: ``builtins.abs`` patched is seen), or a NameError
            # the code caught. Defining it later shadows the builtin, or ends the error: guarded as absent.
            value = module_globals.get(name, ABSENT)
            self._read(module_globals, name, value, where)
            if value is ABSENT and name in builtins:
                self._read(builtins, name, builtins[name], f"the builtin {name!r}")
            elif value is not ABSENT:
                self.follow(value, where, attributes)

    def _attributes(self, fn: object, where: str, skip: tuple[str, ...] = ()) -> None:
        """A function's attributes (its ``__dict__``, by identity, its names, and each)."""
        attributes = vars(fn)
        self.reads.append(Read(fn, None, attributes, f"the attributes of {where}", attribute="__dict__"))
        self._namespace(attributes)
        for name, item in attributes.items():
            if name not in skip:
                self._read(attributes, name, item, f"attribute {name!r} of {where}")
                self.follow(item, f"attribute {name!r} of {where}")

    def _namespace(self, names: dict) -> None:
        if id(names) not in self._seen_namespaces:
            self._seen_namespaces.add(id(names))
            self.namespaces.append(names)

    def _class(self, cls: type, module_class: bool = False) -> None:
        """A user class's attributes (methods by identity, constants by value) and the
        code of its methods, its bases' too. Library classes are skipped, but for a module's
        class: there the ``forward`` of each class up to ``nn.Module`` is guarded (the
        usual way to patch a library's layer)."""
        for klass in cls.__mro__:
            if klass is object or klass is torch.nn.Module:
                continue
            library = is_library(klass)
            if id(klass) in self._walked or (library and not module_class):
                continue
            self._walked.add(id(klass))
            if not library and "__slotnames__" not in vars(klass):  # (set by copy at a first ``deepcopy``)
                copyreg._slotnames(klass)
            names = class_namespace(klass)
            self._classes[id(names)] = klass
            self._namespace(names)
            owner = f"class {klass.__qualname__}"
            if not library:  # (assignable: another base's attributes would be read)
                self._read(klass, None, klass.__bases__, f"the bases of {owner}", attribute="__bases__")
            for name, attr in names.items():
                if not library or name == "forward":
                    self._read(names, name, attr, f"{name!r} of {owner}")
                if library:
                    continue
                attr = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
                attr = attr.fget if isinstance(attr, property) else attr
                # Its methods' code, and what other attributes hold: a descriptor's state, a
                # nested class's attributes, the configs in a class-level table.
                self.follow(attr, f"{name!r} of {owner}")
            if type(klass) is not type and not library:  # a user metaclass: ``A.k`` may come from it
                self._class(type(klass))

    def _python_module(self, module: types.ModuleType, names: set[str]) -> None:
        """The attributes a Python module holds under names the code uses (``cfg.SCALE``). Of
        a library module (``F.relu``, ``torch.nn``), by identity only, not followed further
        than its submodules: a function patched there after compiling is seen."""
        key = (id(module), frozenset(names))  # another function may use other names of it
        if key in self._walked:
            return
        self._walked.add(key)
        library = is_library(module)
        contents = vars(module)
        if module is os:  # ``os.environ[...]``, ``os.getenv``: the environment, by its contents
            self._read(vars(os.environ), "_data", os.environ._data, "the environment (os.environ)")
        for name in sorted(names):
            if name in contents:
                value, where = contents[name], f"{module.__name__}.{name}"
                self._read(contents, name, value, where)
                if not library or isinstance(value, types.ModuleType):
                    self.follow(value, where, names)  # a package's module: ``pkg.sub.X``
