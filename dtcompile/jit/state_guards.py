"""Guards of the state a call reads besides its arguments, emitted into a prologue: the
module tree (submodules, training flags, hooks, table sizes, empty slots) and the Python
values the program read (globals, closure cells, attributes). Each is a few C-level
passes over lists prepared at build time, not a line of Python per value: these run at
every call. ``b`` is the prologue's builder (``prologue.py``): ``fresh``, ``bind``,
``fail_if`` and its ``globals``.
"""

from __future__ import annotations

import itertools
import math
import operator

import torch

from ..capture.python_reads import ABSENT, PythonGuards, ReadGroup, value_key
from ..core.torch_internals import dict_version

_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def module_checks(b, module: torch.nn.Module) -> dict[str, str]:
    """Check the module tree in a few C-level passes over prepared lists: every submodule
    is the module traced, under its name in its parent (a replaced submodule would run
    code the program does not have); each training flag is as traced (dropout and norms
    depend on it); each hook table holds the hooks traced into the program, and the empty
    ones stay empty. Parents are the objects traced once these checks pass, so their
    tables are read from the objects themselves (a module's ``_modules`` and hook dicts
    are changed in place by ``setattr`` and ``register_*_hook``, never replaced). Returns
    the source of each submodule by path (a global: the object traced)."""
    modules = list(module.named_modules(remove_duplicate=False))  # a module under two names: both
    sources = {"": "module"}
    tables, keys, children = [], [], []
    for path, submodule in modules[1:]:
        parent, _, leaf = path.rpartition(".")
        tables.append(module.get_submodule(parent)._modules)
        keys.append(leaf)
        children.append(submodule)
        sources[path] = b.fresh("MODULE")
        b.globals[sources[path]] = submodule
    if children:
        b.globals.update(MODULE_TABLES=tables, MODULE_KEYS=keys, MODULE_CHILDREN=children)
        b.fail_if("list(map(dict.get, MODULE_TABLES, MODULE_KEYS)) != MODULE_CHILDREN")
    unique = list({id(m): m for _, m in modules}.values())
    b.globals.update(
        TRAINING=operator.attrgetter("training"),
        MODULES=unique,
        TRAINING_FLAGS=[m.training for m in unique],
    )
    b.fail_if("list(map(TRAINING, MODULES)) != TRAINING_FLAGS")
    state_table_checks(b, unique)
    empty, hooked, hook_ids = [], [], []
    for submodule in unique:
        for table in _HOOK_TABLES:
            hooks = getattr(submodule, table)
            if hooks:
                hooked.append(hooks)
                hook_ids.append(tuple(hooks))
            else:
                empty.append(hooks)
    b.globals["EMPTY_HOOK_TABLES"] = empty
    b.fail_if("any(map(len, EMPTY_HOOK_TABLES))")
    if hooked:
        b.globals.update(HOOK_TABLES=hooked, HOOK_IDS=hook_ids)
        b.fail_if("list(map(tuple, HOOK_TABLES)) != HOOK_IDS")
    return sources


def state_table_checks(b, modules: list[torch.nn.Module]) -> None:
    """Each module's parameter, buffer and submodule tables hold as many entries as traced
    (none added or removed), and the empty slots (``Linear(bias=False)``'s ``bias``) are
    still empty: a parameter assigned there later must be used. The tensors in the other
    slots are read and guarded one by one."""
    tables, lengths, empty_tables, empty_keys = [], [], [], []
    for module in modules:
        for table in (module._parameters, module._buffers, module._modules):
            tables.append(table)
            lengths.append(len(table))
            for key, value in table.items():
                if value is None:
                    empty_tables.append(table)
                    empty_keys.append(key)
    b.globals.update(STATE_TABLES=tables, STATE_LENGTHS=lengths)
    b.fail_if("list(map(len, STATE_TABLES)) != STATE_LENGTHS")
    if empty_keys:
        b.globals.update(EMPTY_TABLES=empty_tables, EMPTY_KEYS=empty_keys, NONES=[None] * len(empty_keys))
        b.fail_if("list(map(dict.get, EMPTY_TABLES, EMPTY_KEYS)) != NONES")


def python_state_checks(b, guards: PythonGuards) -> None:
    """The Python values the program read (``capture/python_state.py``), in a few C-level
    passes over prepared lists: objects by identity first, then values by exact type and
    ``==``, then the few (tuples, NaN, zeros) compared by their :func:`value_key`."""
    if not guards:
        return
    plain = [(names, n) for names, (n, assigned) in zip(guards.namespaces, guards.namespace_lengths) if not assigned]
    if plain:
        b.globals.update(NAMESPACES=[names for names, _ in plain], NAMESPACE_LENGTHS=[n for _, n in plain])
        b.fail_if("list(map(len, NAMESPACES)) != NAMESPACE_LENGTHS")
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
            f"map(getattr, {prefix}_OBJECTS, {prefix}_ATTRIBUTES)"
        ] * bool(group.objects)

    if guards.same:
        # Dict reads, then attributes: each against its part of the objects expected.
        split = len(guards.same.dicts)
        b.globals.update(
            PY_SAME_OF_DICTS=guards.same.expected[:split], PY_SAME_OF_ATTRIBUTES=guards.same.expected[split:]
        )
        for values, expected in zip(
            read(guards.same, "PY_SAME"), ("PY_SAME_OF_DICTS", "PY_SAME_OF_ATTRIBUTES")[not split :]
        ):
            b.fail_if(f"not all(map(is_, {values}, {expected}))")
    if guards.equal:
        values = b.bind(" + ".join(f"list({v})" for v in read(guards.equal, "PY_EQUAL")), "py")
        b.globals["PY_EQUAL_TYPES"] = guards.equal.types
        b.fail_if(f"list(map(type, {values})) != PY_EQUAL_TYPES or {values} != PY_EQUAL")
    if guards.zeros:  # floats equal to zero, checked above: 0.0 or -0.0 as traced
        b.globals.update(copysign=math.copysign, PY_ONES=[1.0] * len(guards.zeros.expected))
        signs = " + ".join(f"list(map(copysign, PY_ONES, {v}))" for v in read(guards.zeros, "PY_ZERO_SIGNS"))
        b.fail_if(f"{signs} != PY_ZERO_SIGNS")
    b.globals["chain"] = itertools.chain.from_iterable
    for group, item_types, name, items in (
        (guards.lists, guards.list_item_types, "PY_LISTS", "chain({})"),
        (guards.dicts, guards.dict_item_types, "PY_DICT_CONTENTS", "chain(map(dict.values, {}))"),
    ):
        if group:
            values = b.bind(" + ".join(f"list({v})" for v in read(group, name)), "py")
            b.globals.update({f"{name}_TYPES": group.types, f"{name}_ITEM_TYPES": item_types})
            compare = (
                f"list(map(type, {values})) != {name}_TYPES or {values} != {name}"
                f" or list(map(type, {items.format(values)})) != {name}_ITEM_TYPES"
            )
            if group is guards.dicts and None not in guards.dict_versions:
                # The very dicts read while tracing, unchanged since (a big TP plan read by
                # every call): their contents need no comparing.
                b.globals.update(
                    dict_version=dict_version, PY_DICTS_READ=guards.dict_objects, PY_DICT_VERSIONS=guards.dict_versions
                )
                compare = (
                    f"(not all(map(is_, {values}, PY_DICTS_READ))"
                    f" or list(map(dict_version, {values})) != PY_DICT_VERSIONS) and ({compare})"
                )
            b.fail_if(compare)
    if guards.keyed:
        b.globals["VALUE_KEY"] = value_key
        keys = " + ".join(f"list(map(VALUE_KEY, {v}))" for v in read(guards.keyed, "PY_KEYED"))
        b.fail_if(f"{keys} != PY_KEYED")
