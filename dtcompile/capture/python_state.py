"""Python state the traced program read: globals, closure cells and module attributes.

A compiled program runs the user's Python once, while tracing; the Python values it read
then (``S = 2.0`` in ``lambda x: x * S``, ``self.scale``, ``self.use_bias``,
``self.config.eps``, a helper function it called) are baked into the program. Each is
guarded like an argument, so that a change compiles a new entry, as eager would see it.

Exact read tracking is not possible in Python (module ``__dict__`` lookups bypass every
hook), so what is guarded is what the code *can* read, found before tracing:

- **Code.** The traced function (or the methods of the module tree's classes, and the
  functions in its hook tables) and, recursively, the user-level functions, classes and
  Python modules these name through globals and closure cells. Library code is not
  followed: torch, transformers, dtcompile itself (but for ``dtcompile.testing``), the
  standard library, and anything installed in site-packages.
- **Globals** each such function's code loads (``LOAD_GLOBAL`` in its bytecode, nested
  functions and lambdas included) that are in its ``__globals__``; the **closure cells**
  it holds; the attributes a user Python module holds under the other names its code
  uses (``cfg.SCALE``).
- **Module attributes** of the jitted module's tree, and of any module the code reaches
  (a global model a loss function calls; for those also the training flag and which
  parameters, buffers, submodules and tensor attributes they hold): every entry of each submodule's ``__dict__``
  except tensors, submodules and ``nn.Module``'s own tables (parameters, buffers,
  submodules, hooks and the training flag are guarded elsewhere), and except attributes
  the forward assigns a tensor or a computed size (replayed after each call: guarding them
  would miss at every call). An attribute the forward assigns a constant stays guarded:
  ``self.calls = self.calls + 1`` bakes in the new value, which is right only for the old.
- **Objects one level deep**: the attributes of a plain object (a config) held in such an
  attribute, global or cell (``self.config.scale``, ``self.config.act``); the objects
  these hold are guarded by identity, not followed further.

How: ``None``/``bool``/``int``/``float``/``complex``/``str``/``bytes`` and tuples of them
by exact type and value (``1``, ``1.0`` and ``True`` are three values; so are ``0.0`` and
``-0.0``); a small list or dict (string keys, up to 32 items) of such values by identity
and by its contents; anything else (functions, classes, tensors, modules, objects) by
identity.

Not guarded: attributes of objects two levels down (``self.config.sub.x``), the contents
of larger or non-scalar lists and dicts (only which list or dict it is), class attributes
(``self.SCALE`` defined in the class body), values read inside library code (a global of
``transformers`` changed), names reached only through strings (``getattr(cfg, name)``),
defaults of a function's arguments, the arguments of a ``functools.partial``, and globals
the traced code itself assigns (their value after tracing is what the next call sees; the
assignment is not replayed).
"""

from __future__ import annotations

import dis
import functools
import sys
import sysconfig
import types
from dataclasses import dataclass, field

import torch

from .objects import is_rebuildable_object
from .outputs import ConstantOutput
from .python_reads import PythonGuards, Read, by_value, scalar_container, value_key

_LIBRARIES = {"torch", "transformers", "dtcompile", "numpy", "accelerate", "safetensors", "triton", "sympy"}
_LIBRARY_PATHS = tuple(
    path for path in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} if path
)
# nn.Module's own entries of a module's __dict__ (tables, hooks, the training flag):
# guarded by the prologue's module checks, or never read by the program.
_MODULE_TABLES = frozenset(vars(torch.nn.Module()))
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def is_library(obj: object) -> bool:
    """Whether a function, class or Python module is library code, whose reads are not
    guarded."""
    if isinstance(obj, types.ModuleType):
        module = obj.__name__
    else:
        module = getattr(obj, "__module__", None) or ""
    if module.startswith("dtcompile.testing"):
        return False
    root = module.partition(".")[0]
    if root in _LIBRARIES or root in sys.stdlib_module_names:
        return True
    code = getattr(obj, "__code__", None)
    if code is not None:
        filename = code.co_filename
    else:
        filename = getattr(sys.modules.get(module), "__file__", None) or ""
    return "site-packages" in filename or "dist-packages" in filename or filename.startswith(_LIBRARY_PATHS)


def _own(value: object) -> bool:
    """Whether ``value`` is one of dtcompile's own objects (a compiled function's state)."""
    module = type(value).__module__
    return module.startswith("dtcompile.") and not module.startswith("dtcompile.testing")


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


def _code_names(code: types.CodeType) -> tuple[set[str], set[str]]:
    """The global names a code object and the functions nested in it load, and the other
    names they use (attributes: ``cfg.SCALE``). Told apart by the bytecode, so that an
    attribute (``out.sum``) does not guard a global of that name (a loop's ``out``)."""
    global_names, other = set(), set(code.co_names)
    for instruction in dis.get_instructions(code):
        if instruction.opname in _GLOBAL_LOADS:
            global_names.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner_globals, inner_other = _code_names(const)
            global_names |= inner_globals
            other |= inner_other
    return global_names, other - global_names


@dataclass
class PythonState:
    """What the traced program can read (see the module docstring): the reads, in order."""

    reads: list[Read] = field(default_factory=list)
    # Every module reached, with its path: its code runs and its attributes are read.
    modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    _seen_reads: set = field(default_factory=set, repr=False)
    _walked: set = field(default_factory=set, repr=False)

    @classmethod
    def of_function(cls, fn: object) -> PythonState:
        state = cls()
        state.follow(fn, getattr(fn, "__qualname__", "the function"))
        return state

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> PythonState:
        state = cls()
        state.module_tree(module, "", reached=False)
        return state

    def _read(self, holder: object, key: str | None, value: object, where: str) -> None:
        if (id(holder), key) in self._seen_reads:
            return
        self._seen_reads.add((id(holder), key))
        self.reads.append(Read(holder, key, value, where))
        if scalar_container(value):
            self.reads.append(Read(holder, key, value, f"the contents of {where}", True, value_key(value)))

    def module_tree(self, root: torch.nn.Module, prefix: str, reached: bool = True) -> None:
        """Each submodule's attributes, the code of its class and its hooks. A module the
        code ``reached`` (not the jitted one, whose state the prologue guards as inputs):
        also its training flag, and which parameters, buffers, submodules and tensor
        attributes it holds, by identity (its tensors are captured by reference)."""
        for path, module in root.named_modules(prefix=prefix):
            if id(module) in self._walked:
                continue
            self._walked.add(id(module))
            self.modules.append((path, module))
            owner = path or "the module"
            self._class(type(module))
            if reached:
                self._read(vars(module), "training", module.training, f"the training flag of {owner}")
                for table in (module._parameters, module._buffers, module._modules, vars(module)):
                    for name, value in table.items():
                        if value is None or isinstance(value, (torch.Tensor, torch.nn.Module)):
                            self._read(table, name, value, f"{name!r} of {owner}")
            for name, value in vars(module).items():
                if name in _MODULE_TABLES or isinstance(value, (torch.Tensor, torch.nn.Module)):
                    continue
                where = f"attribute {name!r} of {owner}"
                self._read(vars(module), name, value, where)
                self.follow(value, where)
            for table in _HOOK_TABLES:
                for hook in getattr(module, table).values():
                    self.follow(hook, f"a hook of {owner}")

    def follow(self, value: object, where: str, names: set[str] = frozenset()) -> None:
        """What reading ``value`` lets the code read further: a user function's globals and
        cells, a user class's methods, a plain object's attributes, the ``names`` of a user
        Python module."""
        if id(value) in self._walked or by_value(value):
            return
        if isinstance(value, functools.partial):
            self._walked.add(id(value))
            self.follow(value.func, where)
            return
        compiled = getattr(value, "_dtcompile", None)  # a jitted function called inside: inlined
        if compiled is not None and not isinstance(value, torch.nn.Module):
            self.follow(getattr(value, "_fn", None), where)
            return
        if isinstance(value, types.MethodType):
            self.follow(value.__func__, where)
            self.follow(value.__self__, where)
            return
        if isinstance(value, torch.nn.Module):  # a model a function calls
            self.module_tree(value, where)
            return
        if isinstance(value, types.FunctionType):
            self._function(value)
        elif isinstance(value, type):
            self._class(value)
        elif isinstance(value, types.ModuleType):
            self._python_module(value, names)
        elif is_rebuildable_object(value) and isinstance(getattr(value, "__dict__", None), dict) and not _own(value):
            self._walked.add(id(value))  # one level: its attributes are not followed further
            for name, item in vars(value).items():
                self._read(vars(value), name, item, f"{where}.{name}")

    def _function(self, fn: types.FunctionType) -> None:
        if id(fn) in self._walked or is_library(fn):
            return
        self._walked.add(id(fn))
        code = fn.__code__
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # not assigned yet: reading it would raise
                continue
            where = f"closure variable {name!r} of {fn.__qualname__}"
            self._read(cell, None, value, where)
            self.follow(value, where)
        global_names, attributes = _code_names(code)
        module_globals = fn.__globals__
        for name in sorted(global_names):
            if name in module_globals:
                value = module_globals[name]
                where = f"global {name!r} of {fn.__qualname__}"
                self._read(module_globals, name, value, where)
                self.follow(value, where, attributes)

    def _class(self, cls: type) -> None:
        """A user class's methods, its bases' too (library classes are skipped)."""
        for klass in cls.__mro__:
            if id(klass) in self._walked or is_library(klass) or klass is object:
                continue
            self._walked.add(id(klass))
            for attr in vars(klass).values():
                if isinstance(attr, (staticmethod, classmethod)):
                    attr = attr.__func__
                elif isinstance(attr, property):
                    attr = attr.fget
                if isinstance(attr, types.FunctionType):
                    self._function(attr)

    def _python_module(self, module: types.ModuleType, names: set[str]) -> None:
        """The attributes a user Python module holds under names the code uses (``cfg.SCALE``)."""
        if is_library(module):
            return
        contents = vars(module)
        for name in sorted(names):
            if name in contents:
                value = contents[name]
                where = f"{module.__name__}.{name}"
                self._read(contents, name, value, where)
                self.follow(value, where, names)  # a package's module: ``pkg.sub.X``

    def forget(self, keep) -> None:
        """Drop the reads for which ``keep(read)`` is false."""
        self.reads = [read for read in self.reads if keep(read)]

    def forget_assigned(self, module_updates: list) -> None:
        """Drop what the traced code assigned: values that changed while tracing (a global
        counter), and module attributes the forward assigns (``ModuleUpdate``\\ s, made
        again after each call) to a tensor or another value the program computes: guarding
        those would miss at every call. An attribute assigned a constant (a scalar the
        program baked in, which ``self.calls + 1`` may have been computed from) stays
        guarded, so the replayed constant is right: an idempotent assignment
        (``self.ready = True``) compiles once more, a Python counter at every call."""
        assigned = {
            (id(vars(u.module)), u.key)
            for u in module_updates
            if u.table == "__dict__" and not (isinstance(u.value, ConstantOutput) and by_value(u.value.value))
        }
        self.forget(lambda read: (id(read.holder), read.key) not in assigned and read.unchanged())

    def guards(self) -> PythonGuards:
        return PythonGuards.of(self.reads)
