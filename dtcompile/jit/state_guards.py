"""Guards of the state a call reads besides its arguments, emitted into a prologue (``b``, its
builder): the torch state it was traced under (grad mode aside), the module tree and the
Python values the program read. Each is a few C-level passes over lists prepared at build
time; most read dicts only, and run when one changed since a call that passed them
(:func:`unless_dicts_changed`)."""

from __future__ import annotations

import array
import collections
import itertools
import math
import operator
from contextlib import nullcontext
from types import MappingProxyType

import torch

from ..capture.around_ops import function_mode_states, user_global_hooks
from ..capture.global_state import GlobalState
from ..capture.python_reads import ABSENT, PythonGuards, ReadGroup, raw_memory, value_key
from ..capture.python_state import PythonState
from ..capture.torch_settings import torch_settings
from ..core import dict_watch
from ..core.printing import python_literal
from ..core.torch_internals import (
    dict_version,
    dtensor_implicit_replication,
    dtensor_op_handlers,
    function_mode_count,
    saved_tensors_hooks,
)
from .saved_hooks import same_saved_hooks
from .unchanged_dicts import unless_dicts_changed

_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_FLAG_TABLES = (  # (hook table, a table of flags by hook id)
    ("_forward_hooks", "_forward_hooks_with_kwargs"),
    ("_forward_hooks", "_forward_hooks_always_called"),
    ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"),
)


def state_checks(b, module: torch.nn.Module | None, python_state: PythonState) -> dict[str, str]:
    """The module tree and the Python values the program read. The checks that read only
    dicts, whose values cost more to compare than a dict's version to read (submodules,
    training flags, hooks, scalars read from instance dicts and globals), run when one of
    those dicts has changed (:func:`unless_dicts_changed`); the others at every call:
    tables' lengths and empty slots (a ``len`` is cheaper than a version), the order of
    several hooks, attributes outside dicts, containers' contents, dicts the epilogue
    writes to. Returns the source of each submodule by path."""
    versioned, every_call = python_state.guards()
    modules = [] if module is None else list(module.named_modules(remove_duplicate=False))
    unique = list({id(m): m for _, m in modules}.values())
    watched: list[dict] = []
    sources = {"": "module"}
    with unless_dicts_changed(b, watched):
        if module is not None:
            sources = module_tree_checks(b, module, modules, unique, watched)
        python_state_checks(b, versioned, "PY")
        watched += versioned.dicts_read()
    module_table_checks(b, unique)
    if module is not None or python_state.modules:
        global_hook_checks(b)
    python_state_checks(b, every_call, "PY_EACH")
    return sources


def global_state_checks(b, state: GlobalState) -> None:
    """The state the call was traced under (:class:`GlobalState`): the default dtype,
    inference mode, the torch function modes and, with any, the default device; DTensor's implicit replication
    and its op handlers (the same table at the same version, else the same items)."""
    b.fail_if(f"torch.get_default_dtype() is not {python_literal(state.dtype)}")
    b.fail_if(f"torch.is_inference_mode_enabled() is not {state.inference_mode}")
    b.globals.update(function_mode_count=function_mode_count, implicit_replication=dtensor_implicit_replication)
    b.fail_if(f"function_mode_count() != {state.function_modes}")
    if state.function_modes:  # a default device may be among them: the one traced
        b.globals.update(DEFAULT_DEVICE=state.device, default_device=torch.get_default_device)
        b.fail_if("default_device() != DEFAULT_DEVICE")
        b.globals.update(function_mode_states=function_mode_states, FUNCTION_MODES=state.function_mode_states)
        b.fail_if("function_mode_states() != FUNCTION_MODES")
    b.fail_if(f"implicit_replication() is not {state.implicit_replication}")
    b.globals.update(torch_settings=torch_settings, TORCH_SETTINGS=state.settings)
    b.fail_if("torch_settings() != TORCH_SETTINGS")
    # The saved tensors hooks the call was traced under: the programs hold what they do.
    b.globals.update(saved_hooks=saved_tensors_hooks, same_saved_hooks=same_saved_hooks, SAVED_HOOKS=state.saved_hooks)
    b.fail_if("not same_saved_hooks(saved_hooks(), SAVED_HOOKS)")
    b.globals.update(op_handlers=dtensor_op_handlers, OP_HANDLER_ITEMS=state.op_handler_items)
    # No variable bound: the prologue's other names stay as they were.
    changed = "list(op_handlers().items()) != OP_HANDLER_ITEMS"
    if dict_version is not None:  # the table traced, unchanged since: no items to compare
        b.globals.update(
            dict_version=dict_version,
            OP_HANDLERS=state.op_handlers,
            OP_HANDLERS_VERSION=dict_version(state.op_handlers),
        )
        changed = (
            f"(op_handlers() is not OP_HANDLERS or dict_version(OP_HANDLERS) != OP_HANDLERS_VERSION) and {changed}"
        )
    b.fail_if(changed)


def global_hook_checks(b) -> None:
    """At every call, the global module hooks (``register_module_forward_hook``) are the
    ones traced, in order: they run around every module call, so one added after compiling
    changes what the program computes (a few empty dicts: about a microsecond). torch's
    own observers (``CommDebugMode``'s module tracker) are left out: they change nothing."""
    b.globals.update(user_global_hooks=user_global_hooks, GLOBAL_HOOK_ITEMS=user_global_hooks())
    b.fail_if("user_global_hooks() != GLOBAL_HOOK_ITEMS")


def module_tree_checks(b, module: torch.nn.Module, modules: list, unique: list, watched: list[dict]) -> dict[str, str]:
    """Every submodule is the module traced, under its name in its parent (a replaced
    submodule would run code the program does not have); each training flag is as traced
    (dropout and norms depend on it); a table with one hook holds the hook traced into
    the program. ``modules``: the module's ``named_modules``, ``unique``: each once. Adds
    the dicts read to ``watched``: the parents' ``_modules``, the modules' ``__dict__``\\ s
    (the training flags) and the hook tables. Parents are the objects traced once these
    checks pass, and each module holds the tables traced (checked: one put in place of
    another changes its ``__dict__``). Returns the source of each submodule by path (a
    global: the object traced)."""
    sources = {"": "module"}
    tables, keys, children = [], [], []
    by_path = dict(modules)
    for path, submodule in modules[1:]:
        parent, _, leaf = path.rpartition(".")
        tables.append(by_path[parent]._modules)
        keys.append(leaf)
        children.append(submodule)
        sources[path] = b.fresh("MODULE")
        b.globals[sources[path]] = submodule
    if children:
        b.globals.update(MODULE_TABLES=tables, MODULE_KEYS=keys, MODULE_CHILDREN=children)
        b.fail_if("list(map(dict.get, MODULE_TABLES, MODULE_KEYS)) != MODULE_CHILDREN")
    b.globals.update(
        TRAINING=operator.attrgetter("training"),
        MODULES=unique,
        TRAINING_FLAGS=[m.training for m in unique],
    )
    b.fail_if("list(map(TRAINING, MODULES)) != TRAINING_FLAGS")
    # Each module holds the tables traced (one put in place of another changes its
    # ``__dict__``, and the tables read below are the ones traced), its submodules in the
    # order traced (``_modules`` reordered: ``Sequential`` runs them in that order).
    holders, names, held = [], [], []
    for m in unique:
        for name in ("_parameters", "_buffers", "_modules", *_HOOK_TABLES):
            holders.append(vars(m))
            names.append(name)
            held.append(vars(m).get(name))
    b.globals.update(TABLE_HOLDERS=holders, TABLE_NAMES=names, TABLES_HELD=held, is_=operator.is_)
    b.fail_if("not all(map(is_, map(dict.get, TABLE_HOLDERS, TABLE_NAMES), TABLES_HELD))")
    parents = [m._modules for m in unique if len(m._modules) > 1]
    if parents:
        b.globals.update(PARENT_TABLES=parents, CHILD_ORDERS=[tuple(t) for t in parents])
        b.fail_if("list(map(tuple, PARENT_TABLES)) != CHILD_ORDERS")
    single = [hooks for m in unique for hooks in map(vars(m).get, _HOOK_TABLES) if len(hooks) == 1]
    if single:  # the hook itself, not only its key (one swapped under the same handle)
        b.globals.update(SINGLE_HOOK_TABLES=single, SINGLE_HOOKS=[tuple(hooks.items()) for hooks in single])
        b.globals["ITEMS"] = operator.methodcaller("items")
        b.fail_if("list(map(tuple, map(ITEMS, SINGLE_HOOK_TABLES))) != SINGLE_HOOKS")
    watched += tables
    watched += map(vars, unique)
    watched += single
    return sources


def module_table_checks(b, modules: list[torch.nn.Module]) -> None:
    """Each module's parameter, buffer and submodule tables hold as many entries as traced
    (none added or removed), the empty slots (``Linear(bias=False)``'s ``bias``) are still
    empty, a parameter assigned there later must be used; the empty hook tables are still
    empty (at every call, unless dict watchers tell the changes; the order of parameters
    and buffers, else, when the tables' versions changed); each module's class is
    as traced, and the tables with several hooks (or tables of submodules, parameters or
    buffers that are OrderedDicts) hold them in the order traced, at every call (an
    OrderedDict's order changes without a new version or a watcher's notice:
    ``move_to_end``). The tensors in the other slots are read and guarded one by one
    (``batched_guards.py``)."""
    if not modules:
        return
    tables, lengths, empty_tables, empty_keys = [], [], [], []
    for module in modules:
        for table in (module._parameters, module._buffers, module._modules):
            tables.append(table)
            lengths.append(len(table))
            for key, value in table.items():
                if value is None:
                    empty_tables.append(table)
                    empty_keys.append(key)
    hook_tables = [hooks for m in modules for hooks in map(vars(m).get, _HOOK_TABLES)]
    # Which hooks take keyword arguments or run always (``_forward_hooks_with_kwargs``), of
    # the modules with hooks: each flag changes how a hook is called.
    flags = [vars(m)[f] for m in modules for hooks, f in _FLAG_TABLES if vars(m).get(hooks) and f in vars(m)]
    hook_tables += flags
    # Told of changes, these need not run while none of the tables has changed; else (a ``len``
    # costs less than a version) at every call, but for the order of parameters and buffers
    # (``parameters()``), read when their tables' versions changed (cheaper than their keys).
    several = [t for m in modules for t in (m._parameters, m._buffers) if len(t) > 1]
    with unless_dicts_changed(b, tables + hook_tables) if dict_watch.available else nullcontext():
        b.globals.update(STATE_TABLES=tables, STATE_LENGTHS=lengths)
        b.fail_if("list(map(len, STATE_TABLES)) != STATE_LENGTHS")
        with nullcontext() if dict_watch.available or not several else unless_dicts_changed(b, several):
            b.globals.update(TENSOR_TABLES=several, TENSOR_ORDERS=[tuple(t) for t in several])
            b.fail_if("list(map(tuple, TENSOR_TABLES)) != TENSOR_ORDERS")
        if empty_keys:
            b.globals.update(EMPTY_TABLES=empty_tables, EMPTY_KEYS=empty_keys, NONES=[None] * len(empty_keys))
            b.fail_if("list(map(dict.get, EMPTY_TABLES, EMPTY_KEYS)) != NONES")
        b.globals["EMPTY_HOOK_TABLES"] = [hooks for hooks in hook_tables if not hooks]
        b.fail_if("any(EMPTY_HOOK_TABLES)")  # (a dict's truth is its length, read without a call)
    # Each module's class, as traced (``m.lin.__class__ = Quantized`` changes no dict).
    b.globals.update(STATE_MODULES=modules, STATE_MODULE_TYPES=list(map(type, modules)))
    b.fail_if("list(map(type, STATE_MODULES)) != STATE_MODULE_TYPES")
    flag_ids = set(map(id, flags))
    ordered = [hooks for hooks in hook_tables if len(hooks) > 1 or (hooks and id(hooks) in flag_ids)]
    # (and an OrderedDict of submodules, parameters or buffers: an unpickled older model's)
    ordered += [t for t in tables if type(t) is not dict and len(t) > 1]
    if ordered:  # their hooks in order (``move_to_end`` tells no watcher, changes no version)
        b.globals.update(HOOK_TABLES=ordered, HOOKS_IN_ORDER=[tuple(h.items()) for h in ordered])
        b.globals["ITEMS"] = operator.methodcaller("items")
        b.fail_if("list(map(tuple, map(ITEMS, HOOK_TABLES))) != HOOKS_IN_ORDER")


def python_state_checks(b, guards: PythonGuards, tag: str) -> None:
    """The Python values the program read (``capture/python_state.py``), in a few C-level
    passes over prepared lists: objects by identity first, then values by exact type and
    ``==``, then the few (tuples, NaN, zeros) compared by their :func:`value_key`. ``tag``
    begins the names of the lists (a prologue checks two sets of reads)."""
    if not guards:
        return
    plain = [(names, n) for names, (n, assigned) in zip(guards.namespaces, guards.namespace_lengths) if not assigned]
    if plain:
        b.globals[f"{tag}_NAMESPACES"] = [names for names, _ in plain]
        b.globals[f"{tag}_NAMESPACE_LENGTHS"] = [n for _, n in plain]
        b.fail_if(f"list(map(len, {tag}_NAMESPACES)) != {tag}_NAMESPACE_LENGTHS")
        # Their names in order: code iterating ``vars(cfg)`` meets them so (``del``, then set again).
        b.globals[f"{tag}_NAMESPACE_ORDERS"] = [tuple(names) for names, _ in plain]
        b.fail_if(f"list(map(tuple, {tag}_NAMESPACES)) != {tag}_NAMESPACE_ORDERS")
    for names, (n, assigned) in zip(guards.namespaces, guards.namespace_lengths):
        if assigned:  # names the forward assigns (the epilogue does, after each call) are not counted
            var = b.fresh("NAMESPACE")
            b.globals[var] = names
            counted = "".join(f" - ({key!r} in {var})" for key in assigned)
            b.fail_if(f"len({var}){counted} != {n}")
    b.globals.update(is_=operator.is_, ABSENT=itertools.repeat(ABSENT))

    def read(group: ReadGroup, prefix: str) -> list[str]:
        """Expressions iterating the group's current values: dict reads, then attributes."""
        b.globals.update({f"{prefix}_DICTS": group.dicts, f"{prefix}_KEYS": group.keys})
        b.globals.update({f"{prefix}_OBJECTS": group.objects, f"{prefix}_ATTRIBUTES": group.attributes})
        b.globals[prefix] = group.expected
        return [f"map(dict.get, {prefix}_DICTS, {prefix}_KEYS, ABSENT)"] * bool(group.dicts) + [
            f"map(getattr, {prefix}_OBJECTS, {prefix}_ATTRIBUTES, ABSENT)"
        ] * bool(group.objects)

    if guards.same:
        # Dict reads, then attributes: each against its part of the objects expected.
        split = len(guards.same.dicts)
        of_dicts, of_attributes = f"{tag}_SAME_OF_DICTS", f"{tag}_SAME_OF_ATTRIBUTES"
        b.globals.update({of_dicts: guards.same.expected[:split], of_attributes: guards.same.expected[split:]})
        for values, expected in zip(read(guards.same, f"{tag}_SAME"), (of_dicts, of_attributes)[not split :]):
            b.fail_if(f"not all(map(is_, {values}, {expected}))")
    if guards.equal:
        equal = f"{tag}_EQUAL"
        values = b.bind(" + ".join(f"list({v})" for v in read(guards.equal, equal)), "py")
        b.globals[f"{equal}_TYPES"] = guards.equal.types
        b.fail_if(f"list(map(type, {values})) != {equal}_TYPES or {values} != {equal}")
    if guards.zeros:  # floats equal to zero, checked above: 0.0 or -0.0 as traced
        signs, ones = f"{tag}_ZERO_SIGNS", f"{tag}_ONES"
        b.globals.update({"copysign": math.copysign, ones: [1.0] * len(guards.zeros.expected)})
        found = " + ".join(f"list(map(copysign, {ones}, {v}))" for v in read(guards.zeros, signs))
        b.fail_if(f"{found} != {signs}")
    b.globals["chain"] = itertools.chain.from_iterable
    for group, item_types, name, items in (
        (guards.lists, guards.list_item_types, f"{tag}_LISTS", "chain({})"),
        (guards.dicts, guards.dict_item_types, f"{tag}_DICT_CONTENTS", "chain(map(dict.values, {}))"),
    ):
        if group:
            values = b.bind(" + ".join(f"list({v})" for v in read(group, name)), "py")
            b.globals.update({f"{name}_TYPES": group.types, f"{name}_ITEM_TYPES": item_types})
            compare = (
                f"list(map(type, {values})) != {name}_TYPES or {values} != {name}"
                f" or list(map(type, {items.format(values)})) != {name}_ITEM_TYPES"
            )
            if group is guards.dicts:  # (``==`` of dicts ignores the order code iterating one meets)
                b.globals[f"{name}_ORDER"] = [key for d in group.expected for key in d]
                compare += f" or list(chain({values})) != {name}_ORDER"
            if group is guards.dicts and None not in guards.dict_versions:
                # The very dicts read while tracing, unchanged since (a big TP plan read by
                # every call): their contents need no comparing.
                read_, versions = f"{tag}_DICTS_READ", f"{tag}_DICT_VERSIONS"
                b.globals.update(
                    {"dict_version": dict_version, read_: guards.dict_objects, versions: guards.dict_versions}
                )
                compare = (
                    f"(not all(map(is_, {values}, {read_})) or list(map(dict_version, {values})) != {versions})"
                    f" and ({compare})"
                )
            b.fail_if(compare)
    if guards.keyed:
        b.globals["VALUE_KEY"] = value_key
        watched, rest = _split_watched(guards.keyed) if dict_watch.available else (ReadGroup(), guards.keyed)
        for group, name in ((watched, f"{tag}_WATCHED_KEYED"), (rest, f"{tag}_KEYED")):
            if not group:
                continue
            values = read(group, name)
            compare = " + ".join(f"list(map(VALUE_KEY, {v}))" for v in values) + f" != {name}"
            unchanged = _same_objects(b, group, values, name)
            # Told of the changes of every dict a check reads, it need not run while none changed.
            # Recorded as passed only while the values are the containers watched (one replaced
            # by an equal new container passes, but its changes are not told: checked again).
            told = unless_dicts_changed(b, _dicts_read(group), passes_if=unchanged) if group is watched else None
            with told or nullcontext():
                b.fail_if(compare if unchanged is None else f"not ({unchanged}) and {compare}")


def _split_watched(group: ReadGroup) -> tuple[ReadGroup, ReadGroup]:
    """The reads of ``group`` whose value, and all it holds that can change, lives in dicts
    (whose changes dict watchers tell), and the others."""
    watched, rest = ReadGroup(), ReadGroup()
    for d, k, expected, kind in zip(group.dicts, group.keys, group.expected, group.types):
        value, dicts = dict.get(d, k, ABSENT), []
        ok = value_key(value) == expected and _containers(value, [], dicts) and None not in dicts
        target = watched if ok else rest
        target.dicts.append(d)
        target.keys.append(k)
        target.expected.append(expected)
        target.types.append(kind)
    rest.objects, rest.attributes = group.objects, group.attributes
    rest.expected += group.expected[len(group.dicts) :]
    rest.types += group.types[len(group.dicts) :]
    return watched, rest


def _dicts_read(group: ReadGroup) -> list[dict]:
    """The dicts ``group``'s reads read from, and those their values hold."""
    dicts = list(group.dicts)
    for d, k in zip(group.dicts, group.keys):
        _containers(dict.get(d, k, ABSENT), [], dicts)
    return dicts


def _same_objects(b, group: ReadGroup, values: list[str], prefix: str) -> str | None:
    """For values compared by :func:`value_key` (containers, read at every call): an
    expression true when each is the object it is now, holding the very objects it holds
    now (lengths, then items by identity), so that their keys need computing only when it
    fails. None where a value now is not what was traced (the forward changed it) or holds
    what identity does not pin (an array)."""
    now = [dict.get(d, k, ABSENT) for d, k in zip(group.dicts, group.keys)]
    now += [getattr(o, a, ABSENT) for o, a in zip(group.objects, group.attributes)]
    if list(map(value_key, now)) != group.expected:
        return None
    containers: list = []
    if not all(_containers(value, containers, []) for value in now):
        return None
    b.globals.update({f"{prefix}_NOW": now, f"{prefix}_CONTAINERS": containers})
    b.globals[f"{prefix}_LENGTHS"] = list(map(len, containers))
    b.globals[f"{prefix}_ITEMS"] = list(itertools.chain.from_iterable(containers))
    b.globals[f"{prefix}_FILLED"] = [c for c in containers if c]  # (empty ones: their lengths tell)
    read = values[0] if len(values) == 1 else f"chain(({', '.join(values)},))"
    same = f"all(map(is_, {read}, {prefix}_NOW))"
    expression = (
        f"{same} and list(map(len, {prefix}_CONTAINERS)) == {prefix}_LENGTHS"
        f" and all(map(is_, chain({prefix}_FILLED), {prefix}_ITEMS))"
    )
    return expression


def _containers(value: object, found: list, dicts: list) -> bool:
    """Add to ``found`` what can change in place under ``value`` (lists, sets, deques;
    a dict's keys and values), recursively, and to ``dicts`` the dicts among them (None
    for a container whose changes no dict watcher tells: a list, a set, a deque, an
    OrderedDict's order of several items); False where something else can change (an
    array, a bytearray, a ``defaultdict``'s factory, a list subclass's attributes). Tensors,
    and objects whose attributes are guarded apart, are pinned by their identity."""
    kind = type(value)
    if id(value) in _WALKING:  # (a container holding itself: covered where it was met first)
        return True
    if kind is dict or kind is collections.OrderedDict:
        found += (value.keys(), value.values())
        dicts.append(value if kind is dict or len(value) < 2 else None)  # (``move_to_end``)
        items = value.values()
    elif kind in (list, set, collections.deque):
        found.append(value)
        dicts.append(None)
        items = value
    elif kind in (tuple, frozenset):
        items = value
    else:
        return isinstance(value, torch.Tensor) or not (
            hasattr(value, "__array__")
            or isinstance(value, (list, tuple, dict, set, collections.deque, bytearray, array.array, MappingProxyType))
            or raw_memory(value)  # (a memoryview, a ctypes object)
        )
    _WALKING.add(id(value))
    try:
        return all(_containers(item, found, dicts) for item in items)
    finally:
        _WALKING.discard(id(value))


_WALKING: set[int] = set()
