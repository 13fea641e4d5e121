"""The prologue's batched checks: tensors checked together by one TensorGuards call (C++)
and one pass for their storage offsets, a module's tensors read in one pass over their
tables, and alike objects in a list (a KV cache's layers) checked column by column. What
they replace is a few Python lines per tensor, which made a prologue grow with the depth
of the model. ``b`` is the prologue's builder (``prologue.py``).
"""

from __future__ import annotations

import operator
import types
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..capture import CallInputs, ConstantInput, DTensorInput, LocalTensorMeta, ObjectInput, TensorInput
from ..capture.objects import attribute_or_none, optimizer_table
from ..capture.tensor_attributes import attributes_match, contents_keys
from ..core import dict_watch
from ..core.symbolic import is_symbolic
from ..core.torch_internals import TensorGuards
from .unchanged_dicts import unless_dicts_changed


@dataclass
class Batched:
    """A tensor checked with the batch: the expression bound to it, a tensor with the
    type, dtype, device, requires_grad (and dispatch keys) expected, the sizes and strides
    expected, and the storage offset (None: not checked)."""

    var: str
    example: torch.Tensor
    shape: tuple
    stride: tuple
    offset: int | None


def _batchable(node, example) -> bool:
    """A module's tensor checked with the batch: static metadata, seen once."""
    if isinstance(node, TensorInput):
        return example is not None and type(example) is node.meta.type and _static(node.proxy)
    if isinstance(node, DTensorInput):
        return (
            type(example) is DTensor and node.local_of is None and node.traced_spec is node.spec and _static(node.proxy)
        )
    return False


_SIMPLE_CONSTANTS = (bool, int, str, type(None), torch.device, torch.dtype)


def alike(children: list) -> bool:
    """Objects of one class, with the same attributes, each a simple constant (compared by
    type and ``==``) or a tensor with static metadata seen first here, column by column."""
    if len(children) < 2 or not all(isinstance(c, ObjectInput) for c in children):
        return False
    first = children[0]
    for child in children:
        if child.type is not first.type or child.names != first.names:
            return False
        for a, b in zip(child.children, first.children):
            if type(a) is not type(b):
                return False
            if isinstance(a, ConstantInput):
                if type(a.value) not in _SIMPLE_CONSTANTS:
                    return False
            elif not (
                isinstance(a, TensorInput) and a.meta.type in (torch.Tensor, torch.nn.Parameter) and _static(a.proxy)
            ):
                return False
    return True


def _static(proxy) -> bool:
    return not any(is_symbolic(x) for x in (*proxy.shape, *proxy.stride(), proxy.storage_offset()))


def stand_in(meta: LocalTensorMeta) -> torch.Tensor | None:
    """A tensor with ``meta``'s type, dtype, device and requires_grad, and no elements:
    TensorGuards' example for a tensor the trace holds no reference to (an input
    object's), the sizes and strides given apart."""
    with torch.inference_mode(meta.inference):
        t = torch.empty(0, dtype=meta.dtype, device=meta.device)
    if meta.type is torch.nn.Parameter:
        t = torch.nn.Parameter(t, requires_grad=meta.requires_grad)
    elif meta.type is torch.Tensor:
        t.requires_grad_(meta.requires_grad)
    else:
        return None
    torch._C._set_conj(t, meta.conj)  # TensorGuards compares them with the dispatch keys
    torch._C._set_neg(t, meta.neg)
    return t


def check_batched(b) -> None:
    """The batched tensors' type, dtype, device, requires_grad, sizes and strides in one
    TensorGuards check (C++), and their storage offsets in one pass. TensorGuards also
    compares dispatch keys, which an active dispatch mode (CommDebugMode) changes: where
    it fails, the same checks run in Python (:func:`tensors_match`) before the call is
    turned down. The source names each tensor once, whatever their number."""
    if not b.batched:
        return
    guards = b.fresh("TENSOR_GUARDS")
    b.globals[guards] = TensorGuards(
        *(t.example for t in b.batched),
        dynamic_dims_sizes=[list(t.shape) for t in b.batched],
        dynamic_dims_strides=[list(t.stride) for t in b.batched],
    )
    batch = b.bind(b.tuple_of([t.var for t in b.batched]), "batch")
    metas = b.constant([_expected(t) for t in b.batched], "METAS")
    b.globals["tensors_match"] = tensors_match
    b.fail_if(f"not {guards}.check(*{batch}) and not tensors_match({batch}, {metas})")
    offsets = [i for i, t in enumerate(b.batched) if t.offset is not None]
    if offsets:
        b.globals["OFFSET"] = torch.Tensor.storage_offset
        expected = b.constant([b.batched[i].offset for i in offsets], "OFFSETS")
        chosen = batch
        if len(offsets) < len(b.batched):
            chosen = f"{b.constant(_items(offsets), 'WITH_OFFSETS')}({batch})"
        b.fail_if(f"list(map(OFFSET, {chosen})) != {expected}")


def _items(indices: list[int]):
    """A function picking these positions of a sequence, as a tuple."""
    if len(indices) == 1:
        return lambda sequence: (sequence[indices[0]],)
    return operator.itemgetter(*indices)


def _expected(t: Batched) -> LocalTensorMeta:
    e = t.example
    return LocalTensorMeta(
        type(e),
        tuple(t.shape),
        tuple(t.stride),
        e.dtype,
        e.device,
        e.requires_grad,
        e.is_conj(),
        e.is_neg(),
        e.is_inference(),
        LocalTensorMeta.leaf_of(e),
    )


def tensors_match(tensors: tuple, metas: list[LocalTensorMeta]) -> bool:
    """TensorGuards' checks in Python (bar the dispatch keys), tensor by tensor."""
    return all(map(_matches, tensors, metas))


def _matches(t, m: LocalTensorMeta) -> bool:
    return (
        type(t) is m.type
        and t.dtype is m.dtype
        and t.shape == m.shape
        and t.stride() == m.stride
        and t.device == m.device
        and t.requires_grad is m.requires_grad
        and t.is_neg() is m.neg
        and t.is_inference() is m.inference
        and (not m.dtype.is_complex or t.is_conj() is m.conj)
    )


def _owner_and_key(name: str, owners: dict, table: str) -> tuple[str, str]:
    """The submodule's path and the key in its ``table`` of a tensor named ``name`` (an
    attribute's own name may hold a dot: ``setattr(self, "scale.v", t)``)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        owner, key = ".".join(parts[:i]), ".".join(parts[i:])
        if owner in owners and key in getattr(owners[owner], table):
            return owner, key
    raise KeyError(name)


def module_tensors(b, module: torch.nn.Module, inputs: CallInputs, sources: dict[str, str]) -> None:
    """Guard and unpack the module's parameters, buffers and tensor attributes. Those
    with static metadata (nearly all) are read in one C-level pass over their tables
    and checked with the batch (TensorGuards), a DTensor's spec by identity: a few
    passes whatever the depth of the model, not lines per tensor."""
    entries = []  # (table source, table, key, node, example)
    owners = dict(module.named_modules(remove_duplicate=False))
    for table, pairs in (
        ("_parameters", inputs.params),
        ("_buffers", inputs.buffers),
        ("__dict__", inputs.attributes),
    ):
        for name, node in pairs:
            owner, leaf = _owner_and_key(name, owners, table)
            held = getattr(owners[owner], table)
            entries.append((f"{sources[owner]}.{table}", held, leaf, node, held.get(leaf)))
    batch = [e for e in entries if TensorGuards is not None and _batchable(e[3], e[4])]
    position = {id(e[3]): i for i, e in enumerate(batch)}
    dtensors = [e for e in batch if isinstance(e[3], DTensorInput)]
    dtensor_position = {id(e[3]): i for i, e in enumerate(dtensors)}
    if batch:
        b.globals.update(HELD_TABLES=[e[1] for e in batch], HELD_KEYS=[e[2] for e in batch], is_=operator.is_)
        distinct = len({id(e[4]) for e in batch})
        if dict_watch.available:  # told of the tables' changes: the tensors read when one changed
            b.globals["HELD_NOW"] = []
            b.globals["HELD_IDS"] = set()
            with unless_dicts_changed(b, b.globals["HELD_TABLES"]):
                b.lines.append("    HELD_NOW[:] = map(dict.get, HELD_TABLES, HELD_KEYS)")
                b.lines.append("    HELD_IDS.clear(); HELD_IDS.update(map(id, HELD_NOW))")
                b.fail_if(f"len(HELD_IDS) != {distinct}")
            b.lines.append("    HELD = HELD_NOW")
        else:
            b.lines.append("    HELD = list(map(dict.get, HELD_TABLES, HELD_KEYS))")
            b.lines.append("    HELD_IDS = {*map(id, HELD)}")
            # Tensors traced as distinct are distinct (code may ask ``self.a.weight is self.b.weight``).
            b.fail_if(f"len(HELD_IDS) != {distinct}")
        b.held_ids = True
        # The objects themselves (a DTensor: its type, requires_grad and global sizes) first:
        # what follows reads their attributes.
        for e in batch:
            b.batched.append(Batched(f"HELD[{position[id(e[3])]}]", e[4], e[4].shape, e[4].stride(), None))
        b.pickable = ("HELD", {"HELD": 0})
        check_batched(b)
        b.batched = []
    if dtensors:
        b.globals.update(
            SPEC=operator.attrgetter("_spec"),
            LOCAL=operator.attrgetter("_local_tensor"),
            HELD_DTENSORS=operator.itemgetter(*(position[id(e[3])] for e in dtensors)),
            HELD_SPECS=[e[3].spec for e in dtensors],
        )
        select = "HELD_DTENSORS(HELD)" + (",)" if len(dtensors) == 1 else "")
        b.lines.append(f"    HELD_DT = {'(' if len(dtensors) == 1 else ''}{select}")
        b.lines.append("    HELD_SPEC = list(map(SPEC, HELD_DT))")
        b.fail_if("not all(map(is_, HELD_SPEC, HELD_SPECS)) and not all(map(spec_matches, HELD_SPEC, HELD_SPECS))")
        b.lines.append("    HELD_LOCAL = list(map(LOCAL, HELD_DT))")
    if batch:
        b.lines.append(f"    HELD_ALL = HELD{' + HELD_LOCAL' if dtensors else ''}")
        b.pickable = ("HELD_ALL", {"HELD": 0, "HELD_LOCAL": len(batch)})
    for source, _, leaf, node, example in entries:
        if id(node) not in position:
            b.node(node, f"{source}.get({leaf!r})", example)
            continue
        var = f"HELD[{position[id(node)]}]"
        b.held_examples[var] = example
        b.devices.add(node.meta.device.type)
        b.tensor_vars[id(node)] = var
        b.result_labels.append(node.proxy.label)
        if isinstance(node, TensorInput):
            b.local_vars[id(node)] = var
            b.results.append(var)
            b.batched.append(Batched(var, example, example.shape, example.stride(), example.storage_offset()))
            continue
        local = f"HELD_LOCAL[{dtensor_position[id(node)]}]"
        b.local_vars[id(node)] = local
        b.results.append(var if node.requires_grad and not b.unwrap_differentiable else local)
        t = example._local_tensor
        b.batched.append(Batched(local, t, t.shape, t.stride(), t.storage_offset()))


def alike_objects(b, objects: list[ObjectInput], var: str) -> None:
    """A sequence of objects of one class with the same attributes, each a constant or
    a tensor (a KV cache's layers): checked column by column in C-level passes, the
    tensors with the batch, not lines per object."""
    b.in_object += 1
    first = objects[0]
    n = len(objects)
    b.globals.setdefault("OBJECT_STATE", operator.attrgetter("__dict__"))
    b.globals["is_"] = operator.is_
    states = b.fresh("states")
    b.fail_if(f"not all(map(is_, map(type, {var}), {b.constant([first.type] * n, 'TYPES')}))")
    b.lines.append(f"    {states} = list(map(OBJECT_STATE, {var}))")
    b.fail_if(f"list(map(tuple, {states})) != {b.constant([first.names] * n, 'NAMES')}")
    columns = {}
    for j, name in enumerate(first.names):
        column = columns[name] = b.bind(
            f"list(map({b.constant(operator.itemgetter(name), 'ITEM')}, {states}))", "column"
        )
        if isinstance(first.children[j], ConstantInput):
            values = [o.children[j].value for o in objects]
            types = b.constant([type(v) for v in values], "TYPES")
            b.fail_if(f"list(map(type, {column})) != {types} or {column} != {b.constant(values, 'VALUES')}")
    for j, name in enumerate(first.names):
        if all(isinstance(o.children[j], TensorInput) for o in objects):
            b.call_columns.append((columns[name], n))
    b.object_columns.append((var, n))
    for i, obj in enumerate(objects):
        b.object_vars[id(obj)] = f"{var}[{i}]"
        b.in_columns.add(id(obj))
        for name, child in zip(obj.names, obj.children):
            if isinstance(child, TensorInput):
                item = f"{columns[name]}[{i}]"
                b.tensor_meta(item, child.meta, child.proxy)
                b.results.append(item)
                b.result_labels.append(child.proxy.label)
                b.tensor_vars[id(child)] = b.local_vars[id(child)] = item
                if not any(column == columns[name] for column, _ in b.call_columns):
                    b.call_tensors.append(item)
    b.in_object -= 1


def reached_otherwise(reads: list) -> list:
    """What the code reads other than through the call (a module's attribute, a global)
    that the trace refuses to be one of the call's objects or tensors: plain objects
    (``c is self.state``), and the tensors small containers hold (``x is self.ts[1]``).
    Traced apart, a call passing one must be traced anew (and refused there)."""
    found = {}
    for read in reads:
        value = read.value
        if isinstance(attribute_or_none(value, "__dict__"), dict) and not isinstance(value, _NOT_OBJECTS):
            found[id(value)] = value
        if read.contents and not optimizer_table(read.holder, read.key):  # (see ``refuse_other_paths``)
            for tensor in _tensors_in(value, 3):
                found[id(tensor)] = tensor
    return list(found.values())


_NOT_OBJECTS = (type, types.ModuleType, types.FunctionType, torch.nn.Module, torch.Tensor)


def _tensors_in(value, depth: int) -> list:
    if depth <= 0 or not isinstance(value, (dict, list, tuple, set, frozenset)):
        return []
    items = [x for pair in value.items() for x in pair] if isinstance(value, dict) else list(value)
    return [x for x in items if isinstance(x, torch.Tensor)] + [t for x in items for t in _tensors_in(x, depth - 1)]


def distinct_objects(b, reached: list) -> None:
    """Objects and tensors traced as distinct are distinct at the call: the program
    updates each object on its own, and code may ask ``q is k``, ``x is self.b`` or
    ``cache.keys is x``. The call's objects and tensors (arguments, objects', the
    module's), in one set, apart from the module's tensors read in one pass
    (``HELD_IDS``)."""
    objects = [var for key, var in b.object_vars.items() if key not in b.in_columns]
    parts = [f"id({var})" for var in (*objects, *b.call_tensors)]
    parts += [f"*map(id, {column})" for column, _ in (*b.object_columns, *b.call_columns)]
    count = len(b.object_vars) + len(b.call_tensors) + sum(n for _, n in b.call_columns)
    held = b.held_ids
    if count > 1 or (count and (held or reached)):
        ids = b.bind("{" + ", ".join(parts) + ("," if len(parts) == 1 and count == 1 else "") + "}", "ids")
        check = f"len({ids}) != {count}" + (f" or not HELD_IDS.isdisjoint({ids})" if held else "")
        if reached:
            b.globals["REACHED"] = reached  # (held: their ids stay theirs)
            b.globals["REACHED_IDS"] = frozenset(map(id, reached))
            check += f" or not REACHED_IDS.isdisjoint({ids})"
        b.fail_if(check)


def attribute_checks(b, roots: list) -> None:
    """Each tensor's Python attributes as traced (``capture/tensor_attributes.py``): one
    holding attributes a user set, by ``attributes_match``; the others, by how many
    attributes they hold, in one pass (a ``w.tag`` set after compiling is a new entry),
    but for the tensors of input objects (a KV cache's, a library's own: a few hundred more
    objects touched per call at 32 layers)."""
    counted = []
    for node, in_object in _tensor_leaves(roots):
        if id(node) not in b.tensor_vars:
            continue
        if node.attributes:
            b.globals["attributes_match"] = attributes_match
            expected = b.constant(node.attributes, "ATTRIBUTES")
            contents = contents_keys(node.attributes)
            contents = f", {b.constant(contents, 'CONTENTS')}" if contents else ""
            b.fail_if(f"not attributes_match({b.tensor_vars[id(node)]}, {expected}{contents})")
        elif not in_object:
            var = b.tensor_vars[id(node)]
            counted.append((var, node.held_attributes, b.held_examples.get(var)))
    held = [(var, n, t) for var, n, t in counted if var.startswith("HELD") and t is not None]
    if held and dict_watch.available:
        # The module's tensors, told of changes of their attribute dicts: counted again only
        # when one of those changed, or a tensor or its ``__dict__`` is not the one watched
        # (a DTensor's local tensor is a slot, replaced without any dict changing).
        tensors = b.bind(b.tuple_of([var for var, _, _ in held]), "held")
        b.globals.update(
            COUNTED=[t for _, _, t in held],
            COUNTED_DICTS=[vars(t) for _, _, t in held],
            OBJECT_STATE=operator.attrgetter("__dict__"),
            is_=operator.is_,
        )
        replaced = (
            f"not all(map(is_, {tensors}, COUNTED)) or not all(map(is_, map(OBJECT_STATE, {tensors}), COUNTED_DICTS))"
        )
        with unless_dicts_changed(b, b.globals["COUNTED_DICTS"], replaced):
            counts = b.constant([n for _, n, _ in held], "ATTRIBUTE_COUNTS")
            b.fail_if(f"list(map(len, map(vars, {tensors}))) != {counts}")
        counted = [c for c in counted if c not in held]
    if counted:
        counts = b.constant([n for _, n, _ in counted], "ATTRIBUTE_COUNTS")
        b.fail_if(f"list(map(len, map(vars, {b.tuple_of([v for v, _, _ in counted])}))) != {counts}")


def _tensor_leaves(nodes: list, in_object: bool = False):
    """``(node, inside an input object)`` for each tensor node under ``nodes``."""
    for node in nodes:
        if isinstance(node, (TensorInput, DTensorInput)):
            yield node, in_object
        else:
            yield from _tensor_leaves(getattr(node, "children", ()), in_object or isinstance(node, ObjectInput))
