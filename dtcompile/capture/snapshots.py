"""What a traced call did to Python data it does not own, and putting that data back.

Tracing runs the user's Python once, on proxies. Whatever it does to Python data outside
the call's inputs (a list a hook appends to, a counter object a module holds, a dict of
activations) happens that once, with proxies, and never again at run time: eager would do
it at every call, with real tensors. A :class:`DataSnapshot` records the state of such
data before the trace; afterwards it tells which of it changed, and puts it back as it
was (in order), so that no proxy is left in user data and a failed compile changes nothing."""

from __future__ import annotations

import array
import collections
import functools
import logging
import pickle
import random
import sys
import types

import torch

from ..core import TensorProxy, TracingError
from ..core.torch_internals import dispatch_modes_off, saved_tensors_hooks
from .around_ops import user_function_modes, user_global_hook_functions
from .objects import TORCH_USER_STATE, is_rebuildable_object, makes_attributes, object_state, read_through, referent
from .python_reads import memory_copy, raw_memory, value_key
from .user_code import is_library

# Tensors and modules are guarded apart; a logger's state changes when it is asked
# whether a level is enabled (``Logger._cache``), which no result depends on.
_NOT_USER_DATA = (torch.Tensor, torch.nn.Module, logging.Logger)
ALL_LEVELS = 1 << 30  # a depth for :meth:`DataSnapshot.add`: everything reachable (each object once)


def _state(value: object) -> tuple | None:
    """A shallow copy of what ``value`` holds, tagged with its kind; None for values not
    snapshotted (numbers, tensors, modules, functions, torch's own objects)."""
    kind = _EXACT_KINDS.get(type(value))  # most values: a module's tables, lists, numbers
    if kind is not None:
        return kind(value)
    if makes_attributes(value):
        return ("object", list(object_state(value).items()))
    if isinstance(value, list):
        return ("list", list(value))
    if isinstance(value, collections.deque):
        return ("deque", list(value))
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return ("array", value.copy())
    if isinstance(value, dict):
        return ("dict", list(value.items()))
    if isinstance(value, set):
        return ("set", set(value))
    if isinstance(value, (bytearray, array.array)):
        return ("buffer", value[:])
    if raw_memory(value):  # a memoryview, a ctypes object
        return ("buffer", memory_copy(value))
    if hasattr(type(value), "__next__") and not hasattr(value, "__dict__"):
        position = _position(value)  # a generator, a list's iterator: where it stands, to tell whether it moved
        return None if position is None else ("iterator", position)
    generator = _generator_state(value)
    if generator is not None:
        return ("random", generator)
    if is_rebuildable_object(value) or isinstance(value, TORCH_USER_STATE):
        return ("object", list(object_state(value).items()))
    return None


def _generator_state(value: object) -> bytes | None:
    """The state of a random generator of its own (``random.Random(seed)``, a NumPy
    ``Generator`` or ``RandomState``, a ``torch.Generator``), which lives in C: a draw
    while tracing would happen once, its number baked into the program; a torch one
    seeded while tracing (``self.g.manual_seed(7)``) would be seeded once, not at each
    call (the program's random ops draw from it at run time; tracing draws nothing)."""
    if isinstance(value, torch.Generator):
        with torch._C.DisableTorchFunction(), dispatch_modes_off():  # (taken again after tracing, in its modes)
            return value.get_state().numpy().tobytes()
    if isinstance(value, random.Random):
        return pickle.dumps(value.getstate())
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.random.Generator):
        return pickle.dumps(value.bit_generator.state)
    if numpy is not None and isinstance(value, numpy.random.RandomState):
        return pickle.dumps(value.get_state())
    return None


def _set_generator_state(value: object, state: bytes) -> None:
    if isinstance(value, torch.Generator):
        with torch._C.DisableTorchFunction(), dispatch_modes_off():
            value.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        return
    state = pickle.loads(state)
    if isinstance(value, random.Random):
        value.setstate(state)
    elif hasattr(value, "bit_generator"):
        value.bit_generator.state = state
    else:
        value.set_state(state)


def _position(iterator: object, depth: int = 3) -> object:
    """What tells where an iterator stands: a generator's instruction and locals, or what
    the iterator's ``__reduce__`` gives (``count(5)``, a list iterator's index), with the
    iterators it holds (``zip``'s) in turn; None where it tells nothing."""
    if isinstance(iterator, types.GeneratorType):
        frame = iterator.gi_frame
        return None if frame is None else (frame.f_lasti, value_key(dict(frame.f_locals)))
    try:
        reduced = iterator.__reduce__()
    except Exception:  # noqa: BLE001 (what cannot be reduced is not followed)
        return None
    if not isinstance(reduced, tuple) or depth == 0:
        return None
    return tuple(_part(part, depth) for part in reduced)


def _part(part: object, depth: int) -> object:
    if isinstance(part, tuple):
        return tuple(_part(p, depth) for p in part)
    if hasattr(type(part), "__next__"):
        return _position(part, depth - 1)
    return value_key(part)


def _not_kept(value: object) -> None:
    return None


_EXACT_KINDS = {
    dict: lambda value: ("dict", list(value.items())),
    collections.OrderedDict: lambda value: ("dict", list(value.items())),
    list: lambda value: ("list", list(value)),
    set: lambda value: ("set", set(value)),
    **dict.fromkeys((bool, int, float, str, type(None), torch.dtype, torch.device), _not_kept),
}


_PLAIN_DICTS = (dict, collections.OrderedDict)


def _children(value: object) -> list[tuple[tuple, object]]:
    """``((kind, key), child)`` for what ``value`` holds; its path is written out only
    when reported (``_path``)."""
    if type(value).__name__ == "ndarray":
        return []
    if isinstance(value, (list, collections.deque, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        children = [(("[]", k), v) for k, v in items]
        state = getattr(value, "__dict__", None)  # a subclass's own attributes (``registry.calls``)
        return children + [((".", "__dict__"), state)] if type(state) is dict else children
    if isinstance(value, (set, bytearray, array.array)) or raw_memory(value):
        return []
    return [((".", k), v) for k, v in object_state(value).items()]


def _path(path) -> str:
    """A path as text: a string, or ``(parent path, (kind, key))``."""
    steps = []
    while not isinstance(path, str):
        path, (kind, key) = path
        steps.append(f"[{key!r}]" if kind == "[]" else f".{key}")
    return path + "".join(reversed(steps))


def _same(a: tuple, b: tuple) -> bool:
    """Whether two states hold the same things: equal keys, and the very same objects."""
    (kind, items), (other_kind, other_items) = a, b
    if kind != other_kind:
        return False
    if kind == "array":  # the same numbers, bit for bit (a 0-d one has no length)
        return (
            items.shape == other_items.shape
            and items.dtype == other_items.dtype
            and items.tobytes() == other_items.tobytes()
        )
    if len(items) != len(other_items):
        return False
    if kind in ("set", "iterator", "random"):
        return items == other_items
    if kind == "buffer":  # the same bytes
        return bytes(items) == bytes(other_items)
    if kind in ("list", "deque"):
        return all(x is y for x, y in zip(items, other_items))
    return all(_same_key(k, j) and x is y for (k, x), (j, y) in zip(items, other_items))


def _same_key(a, b) -> bool:
    """Keys by value, but tensors (a dict keyed by a parameter) by identity."""
    return a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)


class DataSnapshot:
    """The shallow state of containers and plain objects reachable from some roots, a few
    levels down, taken before a trace (see the module docstring)."""

    def __init__(self):
        self._taken: dict[int, tuple] = {}  # id -> (the value, its path (``_path``), its state)
        # Empty dicts (most of a module's hook tables), each with its path: they hold
        # nothing to copy, and are put back by emptying them.
        self._empty: list[tuple[dict, object]] = []
        self._depths: dict[int, int] = {}  # id -> how many levels down it was recorded
        # The module hook tables library code filled while traced (put back, as the rest):
        # transformers' output capturing hooks, registered at the first call asking for them.
        self.library_setup: list[str] = []

    def add(self, value: object, path, depth: int = 3) -> None:
        """Record ``value`` (found at ``path``) and what it holds, ``depth`` levels down."""
        value = referent(value)  # (through a weak proxy)
        if type(value) in _PLAIN_DICTS and not value:
            self._empty.append((value, path))
            return
        if depth < 0 or self._depths.get(id(value), -1) >= depth:
            return
        if isinstance(value, torch.Tensor) and depth:
            # A closed-over tensor's Python attributes (``W.calls += 1``): set once, while tracing.
            # Not a traced one's (a hook's closure holding an input): they are the trace's own.
            if not isinstance(getattr(value, "_local_tensor", value), TensorProxy):
                self.add(vars(value), (path, (".", "__dict__")), depth - 1)
            return
        if isinstance(value, _NOT_USER_DATA):
            return
        if isinstance(value, types.FunctionType):  # its attributes (``f.calls += 1``, ``f.last = y``)
            if depth and not is_library(value):
                self.add(vars(value), (path, (".", "__dict__")), depth - 1)
            return
        if type(value) is tuple:  # itself unchanged, but what it holds can change in place
            self._depths[id(value)] = depth
            for index, child in enumerate(value):
                self.add(child, (path, ("[]", index)), depth - 1)
            return
        owner = read_through(value)
        if owner is not None:  # ``settings.get``, ``d.__setitem__``, ``d.values()``: what it reads and writes
            self.add(owner, (path, (".", "__self__")), depth)
            return
        if id(value) not in self._taken:  # (met again from higher up: only what it holds is new)
            state = _state(value)
            if state is None:
                return
            self._taken[id(value)] = (value, path, state)
        self._depths[id(value)] = depth
        if depth:
            for step, child in _children(value):
                self.add(child, (path, step), depth - 1)

    def add_callable(self, fn: object, path: str) -> None:
        """Record the data a function can reach and change: what its closure cells hold,
        the object a bound method belongs to (``store.append``), a partial's arguments,
        and the globals its code names. torch's own functions (debugging tools' hooks) are
        left out."""
        if isinstance(fn, functools.partial):
            for i, arg in enumerate(fn.args):
                self.add(arg, f"argument {i} of {path}")
            for key, arg in fn.keywords.items():
                self.add(arg, f"argument {key!r} of {path}")
            fn = fn.func
        owner = getattr(fn, "__self__", None)
        if owner is not None:  # a bound method's object: modules and Python modules are skipped
            self.add(owner, f"the object of {path}")
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is None or (getattr(fn, "__module__", None) or "").startswith("torch"):
            return
        self.add(fn, path, depth=2)  # its attributes
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                self.add(cell.cell_contents, f"{name!r} (a closure variable of {path})", depth=2)
            except ValueError:  # an empty cell
                continue
        names = fn.__globals__
        for name in code.co_names:
            if name in names:
                self.add(names[name], f"{name!r} (a global of {path})", depth=2)

    def add_frame(self, frame, path: str) -> None:
        """What a running user function can change: the globals its code names, and, in a
        method, its object (``add_callable`` for a function known before the call)."""
        code, names = frame.f_code, frame.f_globals
        for name in code.co_names:
            if name in names:
                self.add(names[name], f"{name!r} (a global of {path})", depth=2)
        if code.co_argcount and code.co_varnames[0] == "self":
            self.add(frame.f_locals.get("self"), f"the object of {path}")

    def values(self) -> list:
        """The values recorded (reached from the roots before the trace)."""
        return [value for value, _, _ in self._taken.values()]

    def put_back(self) -> list[str]:
        """Put every value recorded back in the state it had; the paths of those that
        had changed."""
        changed = []
        for value, path in self._empty:
            if value:
                setup = _library_hooks(value, path)
                (self.library_setup if setup else changed).append(
                    f"registered hooks on {_path(path)}" if setup else _path(path)
                )
                value.clear()
        for value, path, state in self._taken.values():
            if _same(_state(value), state):
                continue
            kind, items = state
            if kind == "iterator":  # moved on by the trace: it cannot be moved back
                changed.append(f"{_path(path)}, an iterator it advanced (not put back)")
                continue
            module = kind == "dict" and str(path).startswith("the attributes of the module")  # (a reached one's)
            set_once = _set_from_none(value, items) if kind == "object" or module else None
            if set_once:
                self.library_setup.append(f"set {_path(path)}.{set_once} from None")
            else:
                changed.append(_path(path))
            if kind == "buffer" and raw_memory(value):  # its bytes written back
                memoryview(value).cast("B")[:] = items
            elif kind in ("list", "buffer"):
                value[:] = items
            elif kind == "deque":
                value.clear()
                value.extend(items)
            elif kind == "array":
                value[...] = items
            elif kind == "random":
                _set_generator_state(value, items)
            elif kind in ("dict", "set"):
                value.clear()
                value.update(items)
            else:
                names, now = [name for name, _ in items], list(object_state(value))
                reordered = [n for n in now if n in names] != names  # (``del cfg.a; cfg.a = 1``: set again in order)
                for name in now:
                    if reordered or name not in names:
                        object.__delattr__(value, name)
                for name, item in items:
                    object.__setattr__(value, name, item)
        return changed


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _library_hooks(table: dict, path) -> bool:
    """Whether ``table``, empty before the trace, is a module's hook table (or one of its
    flags' tables) that library code filled: each hook in it a library's function."""
    # (a path as text: "the contents of the _forward_hooks of m.layers.0", a reached module's table)
    name = path[1][1] if isinstance(path, tuple) else next((w for w in str(path).split() if w[0] == "_"), "")
    if not (name.startswith(("_forward", "_backward")) and "hooks" in name):
        return False
    return all(type(v) is bool or is_library(getattr(v, "func", v)) for v in table.values())


def _set_from_none(value: object, items: list) -> str | None:
    """The first name, where all the traced code changed of an object is names it set from
    None (or unset) to a plain constant (Hugging Face's ``config.problem_type``, set by a
    classification model's first call with labels): eager's first call sets them once, and
    a later call finds them set, so one eager run gives eager's state. None otherwise."""
    before, now = dict(items), value if type(value) is dict else object_state(value)
    if not before.keys() <= now.keys():
        return None
    set_now = [name for name, item in now.items() if name not in before or item is not before[name]]
    plain = all(before.get(name) is None and type(now[name]) in (str, int, float, bool) for name in set_now)
    return set_now[0] if set_now and plain else None


class LibrarySetUp(TracingError):
    """The call's first run sets something up, once, as at eager's first call (library code
    registered module hooks, the code set attributes from None to constants): the call runs
    eagerly, which sets them up, and the next call is traced with them in place."""


_NOT_SNAPSHOTTED = frozenset({bool, int, float, str, type(None)})  # a module's flags and sizes: nothing held


def user_data(fn, modules: list | None, paths: dict) -> DataSnapshot:
    """A snapshot of the Python data the traced code can change without receiving it: the
    containers and objects the module tree holds (``modules``, by their ``paths``; not
    their tensors and tables, which ``ModuleState`` swaps and reads), and what the function,
    the modules' hooks and the global module hooks reach."""
    snapshot = DataSnapshot()
    for hook in saved_tensors_hooks() or ():  # (they run while tracing only: a count they keep would stop)
        snapshot.add_callable(hook, f"the saved tensors hook {getattr(hook, '__qualname__', hook)}")
    for where, hook in user_global_hook_functions():
        snapshot.add_callable(hook, where)
    for mode in user_function_modes():  # (one counting the ops would count them once, while tracing)
        snapshot.add(mode, f"the torch function mode {type(mode).__qualname__}")
    if modules is None:
        snapshot.add_callable(fn, getattr(fn, "__qualname__", "the function"))
        return snapshot
    for module in modules:
        prefix = paths[id(module)]
        owner = f"the module attribute {prefix}"  # the path of each attribute, written out if reported
        for name, value in vars(module).items():
            if type(value) not in _NOT_SNAPSHOTTED and name not in ("_parameters", "_buffers"):
                snapshot.add(value, (owner, (".", name)) if prefix else f"{owner}{name}")
        for table in _HOOK_TABLES:
            for hook in getattr(module, table).values():
                kind = table.strip("_")[:-1].replace("_", " ")
                owner = f"module {prefix!r}" if prefix else "the module"
                snapshot.add_callable(hook, f"the {kind} {getattr(hook, '__qualname__', hook)} of {owner}")
    return snapshot
