"""Objects that hold tensors, passed in a call (a KV cache), and what the call did to them.

A state object is a plain Python object (not a module, function or class) whose
``__dict__`` is its state. The traced program gets a *stand-in*: an object of the same
class, made without ``__init__``, whose ``__dict__`` holds the proxified attributes, so
its methods run on proxies. The real object is never touched while tracing.

After tracing, each stand-in's ``__dict__`` is compared with what it was given: an
attribute assigned a new value (``self.keys = torch.cat(...)``, ``self.is_initialized =
True``) is an :class:`AttributeUpdate` that the epilogue makes on the real object after
each call. In-place changes to a tensor attribute (``self.keys.index_copy_``) are ops of
the program itself. Changes the epilogue could not replay (an attribute deleted, a list
or dict of the call changed in place, a new object holding traced tensors) are errors.
"""

from __future__ import annotations

import collections
import enum
import functools
import gc
import inspect
import sys
import types
import weakref
from dataclasses import dataclass

import torch

from ..core import InputPath, TensorProxy, TracingError
from ..core.code_origin import dtcompile_code
from ..core.symbolic import is_symbolic
from .placements import same_spec

_MISSING = object()

# torch's objects whose state is the user's, read and changed between calls like a
# config's: an optimizer's param_groups (a scheduler's learning rate) and per-parameter
# state, a scheduler's counters, a GradScaler's scale, a distribution's parameters. The
# guards follow their attributes; other objects of torch's classes (a DeviceMesh, a
# placement, a spec) are torch's own, guarded by identity.
TORCH_USER_STATE = (
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    torch.amp.GradScaler,
    torch.distributions.Distribution,
)


# The modules made while the call is traced (``method_checks.effects_refused``): one the
# call returns or keeps would be the traced object, the same at every call.
MODULES_MADE: weakref.WeakSet = weakref.WeakSet()


def guarded_items(value: object) -> list[tuple[dict, str, object]]:
    """``(dict, key, item)`` of what the guards read of an attribute holder: its attributes,
    but a GradScaler's per-optimizer stages, which only its step methods read (a compiled
    call does not run them; a change inside is refused) and ``update()`` replaces at each
    step: guarded, every step would compile anew."""
    items = [(vars(value), name, item) for name, item in object_state(value).items() if name in vars(value)]
    if isinstance(value, torch.amp.GradScaler):
        items = [i for i in items if i[1] != "_per_optimizer_states"]
    return items


def optimizer_table(holder: object, key: object) -> bool:
    """Whether ``holder[key]`` is an optimizer's own table of its parameters (its groups, its
    per-parameter state): they hold tensors of the call (a model's parameters), which a
    compiled call that can reach the optimizer need not look up."""
    return key in ("param_groups", "state") and isinstance(holder, dict) and "_optimizer_step_pre_hooks" in holder


def is_state_object(value: object) -> bool:
    """Whether ``value`` is an object dtcompile takes apart by its ``__dict__`` when it is
    an input (a KV cache, a config): its state all in its ``__dict__`` (values in slots
    too: refused, the stand-in would lack them)."""
    return plain_object(value) and not slot_names(type(value))


def object_state(value: object) -> dict:
    """An object's attributes: its ``__dict__`` and the values in its ``__slots__``."""
    state = dict(getattr(value, "__dict__", None) or {})
    if makes_attributes(value):  # what the code set on it (``cfg.scale = 2.0``): not the mock's own
        return {k: v for k, v in state.items() if not k.startswith("_") and not makes_attributes(v)}
    for name in slot_names(type(value)):
        if hasattr(value, name):
            state.setdefault(name, getattr(value, name))
    return state


@functools.lru_cache(maxsize=256)
def slot_names(cls: type) -> tuple[str, ...]:
    """The names of the values instances of ``cls`` hold outside their ``__dict__`` (its
    ``__slots__`` and its bases'; ``abc.ABC``'s empty ``__slots__`` holds none)."""
    names = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__") or ()
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


def is_rebuildable_object(value: object) -> bool:
    """Whether an object the call made can be made anew after each call from its class and
    attributes (a dataclass, a plain object, one with ``__slots__``): made by
    ``object.__new__``, its state all in its attributes."""
    if isinstance(value, (type, types.ModuleType, enum.Enum, torch.nn.Module, torch.Tensor)) or callable(value):
        return False
    if isinstance(value, (list, tuple, dict, set, frozenset, str, bytes)) or type(value).__new__ is not object.__new__:
        return False
    module = type(value).__module__  # (torch's objects hold state of their own: but a distribution, all attributes)
    return not module.startswith("torch") or module.startswith("torch.distributions.")


WEAK_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)


def referent(value: object) -> object:
    """What a ``weakref.proxy`` refers to (None once it is dead: a dead one raises at any
    use); any other value itself."""
    if type(value) in WEAK_PROXIES:
        try:
            return value.__init__.__self__
        except ReferenceError:
            return None
    return value


def makes_attributes(value: object) -> bool:
    """A ``unittest.mock`` mock (a logger mocked in a test, a config): any attribute asked
    for, of it or of its class, is made then, so walking what it holds never ended, and
    reading it changes it. Only what the code set on it is its state (:func:`object_state`)."""
    mock = sys.modules.get("unittest.mock")
    return mock is not None and isinstance(value, mock.NonCallableMock)


def attribute_or_none(value: object, name: str) -> object:
    """``getattr(value, name, None)``, also where the class's ``__getattr__`` raises
    something else than AttributeError (a KeyError from a dict it wraps); and None where
    only its ``__getattr__`` would answer: a mock or an auto-vivifying config makes the
    attribute asked for (a walk of what it holds then never ends)."""
    if hasattr(type(value), "__getattr__"):
        try:
            inspect.getattr_static(value, name)
        except AttributeError:
            return None
    try:
        return getattr(value, name, None)
    except Exception:
        return None


def plain_object(value: object) -> bool:
    """An object whose attributes are its ``__dict__``: a config, a dataclass, a
    ``types.SimpleNamespace``."""
    plain = is_rebuildable_object(value) or type(value) is types.SimpleNamespace
    return plain and isinstance(attribute_or_none(value, "__dict__"), dict)


_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


def read_through(value: object) -> object | None:
    """What a built-in bound method (``settings.get``, ``d.__setitem__``, ``log.append``)
    or a dict view (``settings.values()``) reads and writes: its object, or its dict. None
    for anything else, and for a builtin of a Python module or a class (``math.sqrt``)."""
    if isinstance(value, _DICT_VIEWS):
        return next((d for d in gc.get_referents(value) if isinstance(d, dict)), None)
    if isinstance(value, (types.BuiltinMethodType, types.MethodWrapperType)):
        owner = value.__self__
        return None if owner is None or isinstance(owner, (type, types.ModuleType)) else owner
    return None


def dict_view(value: object) -> bool:
    return isinstance(value, _DICT_VIEWS)


def attribute_holder(value: object) -> bool:
    """An object whose state code reads through its attributes, which the guards follow
    (``python_state.py``): a plain object (a config), one holding values in ``__slots__``
    (a ``dataclass(slots=True)``), or one of a class with ``__call__`` (a scaler, an
    ``lru_cache`` wrapper and the function it wraps), one of torch's whose state is the
    user's (``TORCH_USER_STATE``: an optimizer); not one of dtcompile's own."""
    module = type(value).__module__
    if dtcompile_code(module):
        return False  # a compiled function's state
    if plain_object(value) or makes_attributes(value) or (slot_names(type(value)) and is_rebuildable_object(value)):
        return True
    if isinstance(value, (*TORCH_USER_STATE, enum.Enum)):  # (an enum member's attributes: per-member config)
        return isinstance(attribute_or_none(value, "__dict__"), dict)
    return (
        callable(value)
        and not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType))
        and isinstance(attribute_or_none(value, "__dict__"), dict)
        and not module.startswith("torch")
    )


def new_object(cls: type, names: tuple, values: tuple) -> object:
    """An object of ``cls`` with these attributes, made without ``__init__`` (``__setattr__``
    bypassed too, so frozen dataclasses and ``__slots__`` work)."""
    obj = cls() if cls is types.SimpleNamespace else object.__new__(cls)
    for name, value in zip(names, values):
        object.__setattr__(obj, name, value)
    return obj


def new_stand_in(value: object) -> object:
    """An object of ``value``'s class with no state yet, made without running its ``__init__``."""
    cls = type(value)
    return cls.__new__(cls) if cls is types.SimpleNamespace else object.__new__(cls)


def holds_proxies(value: object, seen: set | None = None) -> bool:
    """Whether a new object made by the call holds traced tensors, however deep: in a
    container of any class, an object's attributes or slots, a function's closure."""
    if isinstance(value, TensorProxy) or is_symbolic(value):  # (a size the program computes: ``Info(n=x.shape[0])``)
        return True
    if isinstance(value, torch.Tensor):
        return isinstance(getattr(value, "_local_tensor", None), TensorProxy)
    if type(value) in _LEAVES or isinstance(value, (type, types.ModuleType, torch.nn.Module)):
        return False
    seen = set() if seen is None else seen
    if id(value) in seen:
        return False
    seen.add(id(value))
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, weakref.ref):
        items = [value()]
    elif isinstance(value, types.CellType):
        items = _cell_values_of((value,))
    elif isinstance(value, BaseException):
        items = [*value.args, *object_state(value).values()]
    elif type(value).__name__ == "ndarray" and str(getattr(value, "dtype", "")) == "object":
        items = value.ravel().tolist()
    elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        items = value
    elif isinstance(value, slice):
        items = (value.start, value.stop, value.step)
    elif isinstance(value, types.MappingProxyType):
        items = value.values()
    elif isinstance(value, types.FunctionType):  # a closure over a traced tensor
        items = [*_cell_values(value), *(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
    elif isinstance(value, (types.MethodType, functools.partial)):
        items = (
            (value.__self__, value.__func__)
            if isinstance(value, types.MethodType)
            else (value.func, value.args, value.keywords)
        )
    else:  # (a method-wrapper's object too)
        items = [*object_state(value).values(), getattr(value, "__self__", None)]
    return any(holds_proxies(item, seen) for item in items)


_LEAVES = frozenset((type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device))


def _cell_values(fn: types.FunctionType) -> list:
    return _cell_values_of(fn.__closure__ or ())


def _cell_values_of(cells) -> list:
    values = []
    for cell in cells:
        try:
            values.append(cell.cell_contents)
        except ValueError:  # not assigned yet
            continue
    return values


@dataclass
class AttributeUpdate:
    """After each call, ``objects[index].__dict__[name]`` is set to ``value`` (an OutputNode)."""

    index: int
    name: str
    value: object


@dataclass
class _Traced:
    node: object  # the ObjectInput
    stand_in: object
    given: dict  # the attributes the stand-in was given


class StateObjects:
    """The stand-ins of one trace, the containers given to the program, and which real
    objects the epilogue needs (to update them or to return them)."""

    def __init__(self):
        self.traced: list[_Traced] = []
        self._by_stand_in: dict[int, _Traced] = {}
        self.by_real: dict[int, object] = {}  # id of a real object -> its ObjectInput
        # (path, container given to the program, its items then): lists and dicts of the
        # call must not change in place, which the epilogue could not replay.
        self.containers: list[tuple[InputPath, object, list]] = []
        self.needed: list[object] = []  # ObjectInputs (and DTensorInputs) the epilogue receives, in order
        self._given: dict[int, tuple[object, object]] = {}  # id of a traced DTensor input -> (it, its node)
        self._given_containers: dict[int, tuple[object, object]] = {}  # id -> (a container of the call, its node)
        self.containers_returned = True  # whether one returned is the caller's own (not with gradients)

    def add(self, node, stand_in: object, given: dict, real: object) -> None:
        traced = _Traced(node, stand_in, dict(given))
        self.traced.append(traced)
        self._by_stand_in[id(stand_in)] = traced
        self.by_real[id(real)] = node

    def add_container(self, path: InputPath, container: object, node) -> None:
        """A list, dict or tuple of the call, as given to the program (``node``: its input
        node). Returned, it is the caller's own, as in eager."""
        self._given_containers[id(container)] = (container, node)
        if isinstance(container, (list, dict)):
            items = list(container.items()) if isinstance(container, dict) else list(container)
            self.containers.append((path, container, items))

    def return_as_given(self, dtensors: list[tuple[object, object]]) -> None:
        """``(traced DTensor, its DTensorInput)`` of the call's DTensors: one the call returns
        (or assigns) unchanged is the caller's own object, as in eager. Only without
        gradients: a training step's outputs get their ``grad_fn`` from its autograd."""
        for traced, node in dtensors:
            self._given[id(traced)] = (traced, node)

    def index_of(self, value: object) -> int | None:
        """The epilogue's index of the real object whose stand-in is ``value`` (or which is
        the DTensor ``value`` traces, unchanged), or None."""
        traced = self._by_stand_in.get(id(value))
        container = self._given_containers.get(id(value))
        if traced is not None and traced.stand_in is value:
            found = traced.node
        elif container is not None and container[0] is value and self.containers_returned:
            found = container[1]
        else:
            given = self._given.get(id(value))
            if given is None or given[0] is not value:
                return None
            found = given[1]
            if value._local_tensor is not found.proxy or not same_spec(value._spec, found.traced_spec):
                return None  # its metadata changed in place (``x.squeeze_()``): rebuilt, as traced
        for i, node in enumerate(self.needed):
            if node is found:
                return i
        self.needed.append(found)
        return len(self.needed) - 1

    def refuse_other_paths(self, reads: list) -> None:
        """An input object the traced code also reads another way (a global, a module's
        attribute) would be two objects while tracing, the stand-in and the real one,
        where eager has one: an attribute assigned through one path is not seen through
        the other, ``is`` between them is False. Refused."""
        for read in reads:
            node = self.by_real.get(id(read.value))
            if node is not None:
                raise TracingError(
                    f"dtcompile.jit: {node.path} is also reached as {read.where}; the traced code gets a stand-in "
                    "for an object of the call, so the two would be different objects while tracing (an attribute "
                    "assigned through one not seen through the other). Reach it one way: pass it in the call only"
                )

    def updates(self, describe) -> list[AttributeUpdate]:
        """What the call changed on each object, as updates (values described by
        ``describe``, the output collector's); raises where it cannot be replayed."""
        for path, container, items in self.containers:
            now = list(container.items()) if isinstance(container, dict) else list(container)
            pairs = isinstance(container, dict)  # (a list's items may be tuples: ``[x.shape]``)
            if len(now) != len(items) or any(_differs(a, b, pairs) for a, b in zip(now, items)):
                raise TracingError(
                    f"dtcompile.jit: the call changed {path} (a {type(container).__name__}) in place; "
                    "dtcompile replays attribute assignments on input objects, not in-place changes "
                    "to their lists and dicts"
                )
        updates = []
        for traced in self.traced:
            state = traced.stand_in.__dict__
            removed = [name for name in traced.given if name not in state]
            # (one deleted and set again moved last: ``vars(obj)`` after the call would tell)
            moved = [b for a, b in zip([name for name in state if name in traced.given], traced.given) if a != b]
            if removed or moved:
                raise TracingError(
                    f"dtcompile.jit: the call deleted {traced.node.path}.{(removed or moved)[0]}; deleting an input "
                    "object's attributes is not supported"
                )
            changed = [n for n, v in state.items() if traced.given.get(n, _MISSING) is not v]
            if not changed:
                continue
            index = self.index_of(traced.stand_in)
            for name in changed:
                value = describe(state[name], traced.node.path.attr(name))
                updates.append(AttributeUpdate(index, name, value))
        return updates


def _differs(a, b, pairs: bool) -> bool:
    if pairs:  # a dict's (key, value) pair
        return (a[0] is not b[0] and a[0] != b[0]) or a[1] is not b[1]  # (a nan key is not equal to itself)
    return a is not b
