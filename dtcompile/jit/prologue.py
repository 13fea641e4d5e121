"""Generating a prologue: the function that guards a call and unpacks its inputs.

The prologue receives ``(module, args, kwargs)`` as the user passed them. It checks
everything the trace assumed (the :class:`InputNode` tree from capture, grad mode, the
training flags of a module's submodules) and returns the computation's inputs in order,
or ``None`` as soon as one assumption fails, so the next cache entry can be tried.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import sympy
import torch
from torch.distributed.tensor import DTensor

from ..capture import (
    CallInputs,
    ConstantInput,
    DictInput,
    DTensorInput,
    LocalTensorMeta,
    ObjectInput,
    PytreeInput,
    SameObjectInput,
    SequenceInput,
    TensorInput,
)
from ..core.codegen import GeneratedFunction, literal_or_global
from ..core.printing import python_literal
from ..core.symbolic import is_symbolic, python_source, symbolic_expr
from ..core.torch_internals import TensorGuards, shape_guards, symbol_range
from .guards import meshes_match, spec_matches
from .state_guards import module_checks, python_state_checks


class _Builder:
    def __init__(self, unwrap_differentiable: bool):
        # A training step hands the DTensors that need gradients to autograd as they are.
        self.unwrap_differentiable = unwrap_differentiable
        self.devices: set[str] = set()
        # Symbolic sizes: the variable each symbol is bound to (its first occurrence), and
        # the checks (source, expected expression) that need every symbol bound first.
        self.symbols: dict[sympy.Symbol, str] = {}
        self.relations: list[tuple[str, sympy.Expr]] = []
        self.lines: list[str] = []
        self.globals: dict[str, object] = {
            "torch": torch,
            "DTensor": DTensor,
            "spec_matches": spec_matches,
            "meshes_match": meshes_match,
        }
        self.results: list[str] = []
        self.result_labels: list[str] = []  # the trace input each result binds, in order
        self.object_vars: dict[int, str] = {}  # id of an ObjectInput -> the variable bound to it
        # id of a TensorInput or DTensorInput -> the variable bound to the tensor (the DTensor),
        # and to the local tensor (the tensor itself, the DTensor's local): a tensor met again
        # must be the very same object.
        self.tensor_vars: dict[int, str] = {}
        self.local_vars: dict[int, str] = {}
        self.in_object = 0  # inside an object of the call (its tensors are not arguments)
        self.argument_tensors: list[str] = []  # the call's tensors outside objects, each met once
        # Tensors of the module's state with static metadata: (variable, the tensor traced),
        # checked together by one TensorGuards call (C++) at the end.
        self.batched: list[tuple[str, torch.Tensor]] = []
        self._count = 0

    def fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def constant(self, obj: object, prefix: str) -> str:
        return literal_or_global(obj, self.globals, prefix)

    def fail_if(self, condition: str) -> None:
        self.lines.append(f"    if {condition}: return None")

    def bind(self, expr: str, prefix: str = "v") -> str:
        name = self.fresh(prefix)
        self.lines.append(f"    {name} = {expr}")
        return name

    def tensor_meta(self, var: str, meta: LocalTensorMeta, proxy, example: torch.Tensor | None = None) -> None:
        """Guard a tensor's metadata. With ``example`` (the tensor traced, for the module's
        state) a tensor with static metadata joins the batch checked at the end."""
        self.devices.add(meta.device.type)
        offset = proxy.storage_offset()
        static = not any(is_symbolic(x) for x in (*proxy.shape, *proxy.stride(), offset))
        if example is None and self.in_object and static:
            example = _stand_in(meta)  # an input object's tensor: checked with the batch too
        if static and example is not None and TensorGuards is not None:
            self.batched.append(_Batched(var, example, meta.shape, meta.stride, offset))
            return
        tensor_type = self.constant(meta.type, "TYPE")
        device = self.fresh("DEVICE")  # a global: a literal would build a device per call
        self.globals[device] = meta.device
        self.fail_if(f"type({var}) is not {tensor_type}")
        # The storage offset too: a program may read it (``x.storage_offset()``).
        if static:
            self.fail_if(
                f"{var}.dtype is not {python_literal(meta.dtype)} or {var}.shape != {python_literal(meta.shape)}"
                f" or {var}.stride() != {python_literal(meta.stride)} or {var}.device != {device}"
                f" or {var}.requires_grad is not {meta.requires_grad} or {var}.storage_offset() != {offset}"
            )
            return
        self.fail_if(
            f"{var}.dtype is not {python_literal(meta.dtype)} or {var}.dim() != {proxy.dim()}"
            f" or {var}.device != {device} or {var}.requires_grad is not {meta.requires_grad}"
        )
        self.sizes(f"{var}.shape", proxy.shape, "size")
        self.sizes(f"{var}.stride()", proxy.stride(), "stride")
        self.sizes(f"({var}.storage_offset(),)", (offset,), "offset")

    def sizes(self, source: str, values, prefix: str) -> None:
        """Guard a tuple of sizes or strides traced as ``values`` (ints and SymInts): bind
        each symbol at its first occurrence; check constants now, relations at the end."""
        var = self.bind(source, prefix)
        for i, value in enumerate(values):
            expr = symbolic_expr(value)
            item = f"{var}[{i}]"
            if isinstance(expr, sympy.Integer):
                self.fail_if(f"{item} != {int(expr)}")
            elif isinstance(expr, sympy.Symbol) and expr not in self.symbols:
                self.symbols[expr] = self.bind(item, "s")
            else:
                self.relations.append((item, expr))

    def symbolic_guards(self, shape_env) -> None:
        """The relations between sizes, then what the trace assumed of them: the ShapeEnv's
        guards (equal sizes, divisibility, branches taken) and each symbol's range (sizes 0
        and 1 were traced as constants, so a symbol stands for 2 and more)."""
        for item, expr in self.relations:
            self.fail_if(f"{item} != {self.source(expr)}")
        checked = set()
        for expr in shape_guards(shape_env):
            if expr is sympy.true or expr in checked:
                continue
            checked.add(expr)
            self.fail_if(f"not ({self.source(expr)})")
        for symbol, var in self.symbols.items():
            bounds = symbol_range(shape_env, symbol)
            if bounds is None:
                continue
            if bounds.lower.is_Integer:
                self.fail_if(f"{var} < {int(bounds.lower)}")
            if bounds.upper.is_Integer:
                self.fail_if(f"{var} > {int(bounds.upper)}")

    def source(self, expr) -> str:
        missing = expr.free_symbols - set(self.symbols)
        if missing:
            raise AssertionError(f"dtcompile: a guard on sizes uses {sorted(map(str, missing))}, which no input binds")
        return python_source(expr, self.symbols)

    def check_batched(self) -> None:
        """The batched tensors' type, dtype, device, requires_grad, sizes and strides in one
        TensorGuards check (C++), and their storage offsets in one pass. TensorGuards also
        compares dispatch keys, which an active dispatch mode (CommDebugMode) changes: where
        it fails, the same checks run in Python before the call is turned down."""
        if not self.batched:
            return
        guards = self.fresh("TENSOR_GUARDS")
        self.globals[guards] = TensorGuards(
            *(t.example for t in self.batched),
            dynamic_dims_sizes=[list(t.shape) for t in self.batched],
            dynamic_dims_strides=[list(t.stride) for t in self.batched],
        )
        slow = " and ".join(self._python_check(t) for t in self.batched)
        self.fail_if(f"not {guards}.check({', '.join(t.var for t in self.batched)}) and not ({slow})")
        offsets = [t for t in self.batched if t.offset is not None]
        if offsets:
            self.globals["OFFSET"] = torch.Tensor.storage_offset
            expected = self.constant([t.offset for t in offsets], "OFFSETS")
            self.fail_if(f"list(map(OFFSET, ({', '.join(t.var for t in offsets)},))) != {expected}")

    def _python_check(self, t: _Batched) -> str:
        device = self.fresh("DEVICE")
        self.globals[device] = t.example.device
        var = t.var
        return (
            f"type({var}) is {self.constant(type(t.example), 'TYPE')} and {var}.dtype is {python_literal(t.example.dtype)}"
            f" and {var}.shape == {python_literal(tuple(t.shape))} and {var}.stride() == {python_literal(tuple(t.stride))}"
            f" and {var}.device == {device} and {var}.requires_grad is {t.example.requires_grad}"
        )

    def module_state(self, module: torch.nn.Module, inputs: CallInputs, sources: dict[str, str]) -> None:
        """Guard and unpack the module's parameters, buffers and tensor attributes. Those
        with static metadata (nearly all) are read in one C-level pass over their tables
        and checked with the batch (TensorGuards), a DTensor's spec by identity: a few
        passes whatever the depth of the model, not lines per tensor."""
        entries = []  # (table source, table, key, node, example)
        for table, pairs in (
            ("_parameters", inputs.params),
            ("_buffers", inputs.buffers),
            ("__dict__", inputs.attributes),
        ):
            for name, node in pairs:
                owner, _, leaf = name.rpartition(".")
                held = getattr(module.get_submodule(owner), table)
                entries.append((f"{sources[owner]}.{table}", held, leaf, node, held.get(leaf)))
        batch = [e for e in entries if TensorGuards is not None and _batchable(e[3], e[4])]
        position = {id(e[3]): i for i, e in enumerate(batch)}
        dtensors = [e for e in batch if isinstance(e[3], DTensorInput)]
        dtensor_position = {id(e[3]): i for i, e in enumerate(dtensors)}
        if batch:
            self.globals.update(HELD_TABLES=[e[1] for e in batch], HELD_KEYS=[e[2] for e in batch], is_=operator.is_)
            self.lines.append("    HELD = list(map(dict.get, HELD_TABLES, HELD_KEYS))")
            # The objects themselves (a DTensor: its type, requires_grad and global sizes) first:
            # what follows reads their attributes.
            for e in batch:
                self.batched.append(_Batched(f"HELD[{position[id(e[3])]}]", e[4], e[4].shape, e[4].stride(), None))
            self.check_batched()
            self.batched = []
        if dtensors:
            self.globals.update(
                SPEC=operator.attrgetter("_spec"),
                LOCAL=operator.attrgetter("_local_tensor"),
                HELD_DTENSORS=operator.itemgetter(*(position[id(e[3])] for e in dtensors)),
                HELD_SPECS=[e[3].spec for e in dtensors],
            )
            select = "HELD_DTENSORS(HELD)" + (",)" if len(dtensors) == 1 else "")
            self.lines.append(f"    HELD_DT = {'(' if len(dtensors) == 1 else ''}{select}")
            self.lines.append("    HELD_SPEC = list(map(SPEC, HELD_DT))")
            self.fail_if(
                "not all(map(is_, HELD_SPEC, HELD_SPECS)) and not all(map(spec_matches, HELD_SPEC, HELD_SPECS))"
            )
            self.lines.append("    HELD_LOCAL = list(map(LOCAL, HELD_DT))")
        for source, _, leaf, node, example in entries:
            if id(node) not in position:
                self.node(node, f"{source}.get({leaf!r})", example)
                continue
            var = f"HELD[{position[id(node)]}]"
            self.devices.add(node.meta.device.type)
            self.tensor_vars[id(node)] = var
            self.result_labels.append(node.proxy.label)
            if isinstance(node, TensorInput):
                self.local_vars[id(node)] = var
                self.results.append(var)
                self.batched.append(_Batched(var, example, example.shape, example.stride(), example.storage_offset()))
                continue
            local = f"HELD_LOCAL[{dtensor_position[id(node)]}]"
            self.local_vars[id(node)] = local
            self.results.append(var if node.requires_grad and not self.unwrap_differentiable else local)
            t = example._local_tensor
            self.batched.append(_Batched(local, t, t.shape, t.stride(), t.storage_offset()))

    def node(self, node, expr: str, example=None) -> None:
        """Guard and unpack ``node``, found at ``expr``; ``example`` is the value traced,
        where it is known (the module's state)."""
        if isinstance(node, ConstantInput):
            self._constant(node.value, expr)
        elif isinstance(node, TensorInput):
            var = self.bind(expr)
            self.tensor_meta(var, node.meta, node.proxy, example)
            self.results.append(var)
            self.result_labels.append(node.proxy.label)
            self.tensor_vars[id(node)] = self.local_vars[id(node)] = var
            if not self.in_object:
                self.argument_tensors.append(var)
        elif isinstance(node, DTensorInput):
            var = self.bind(expr)
            self.tensor_vars[id(node)] = var
            if not self.in_object:
                self.argument_tensors.append(var)
            self.fail_if(f"type({var}) is not DTensor")
            spec = self.bind(f"{var}._spec", "spec")
            if node.traced_spec is node.spec:
                expected = self.constant(node.spec, "SPEC")
                self.fail_if(f"{spec} is not {expected} and not spec_matches({spec}, {expected})")
            else:  # symbolic sizes: the mesh and placements as they are, the global sizes as relations
                mesh = self.constant(node.spec.mesh, "MESH")
                placements = self.constant(node.spec.placements, "PLACEMENTS")
                self.fail_if(f"{spec}.mesh is not {mesh} and not meshes_match({spec}.mesh, {mesh})")
                self.fail_if(
                    f"{spec}.placements != {placements} or {var}.dtype is not {python_literal(node.meta.dtype)}"
                )
                shard_order = getattr(node.spec, "shard_order", None)
                if shard_order is not None:
                    self.fail_if(f"{spec}.shard_order != {self.constant(shard_order, 'SHARD_ORDER')}")
                self.sizes(f"{var}.shape", node.traced_spec.tensor_meta.shape, "gsize")
                self.sizes(f"{var}.stride()", node.traced_spec.tensor_meta.stride, "gstride")
            self.fail_if(f"{var}.requires_grad is not {node.requires_grad}")
            local = self.bind(f"{var}._local_tensor", "local")
            self.local_vars[id(node)] = local
            if node.local_of is not None:  # the local tensor is an input met before
                self.fail_if(f"{local} is not {self.local_vars[id(node.local_of)]}")
                return
            self.tensor_meta(local, node.meta, node.proxy, None if example is None else example._local_tensor)
            self.results.append(var if node.requires_grad and not self.unwrap_differentiable else local)
            self.result_labels.append(node.proxy.label)
        elif isinstance(node, SequenceInput):
            if expr == "args":  # always the tuple of positional arguments
                var = expr
                self.fail_if(f"len(args) != {len(node.children)}")
            else:
                var = self.bind(expr)
                kind = node.type.__name__ if node.type in (tuple, list) else self.constant(node.type, "TYPE")
                self.fail_if(f"type({var}) is not {kind} or len({var}) != {len(node.children)}")
            if _alike_objects(node.children):
                self.alike_objects(node.children, var)
                return
            for i, child in enumerate(node.children):
                self.node(child, f"{var}[{i}]")
        elif isinstance(node, DictInput):
            var = expr if expr == "kwargs" else self.bind(expr)
            if not node.keys and expr == "kwargs":
                self.fail_if("kwargs")
            else:
                # In order: a function may iterate the dict (``d.values()``).
                keys = self.constant(tuple(node.keys), "KEYS")
                self.fail_if(f"type({var}) is not dict or tuple({var}) != {keys}")
            for key, child in zip(node.keys, node.children):
                self.node(child, f"{var}[{key!r}]")
        elif isinstance(node, PytreeInput):
            var = self.bind(expr)
            self.fail_if(f"type({var}) is not {self.constant(node.type, 'TYPE')}")
            flatten = self.constant(torch.utils._pytree.SUPPORTED_NODES[node.type].flatten_fn, "FLATTEN")
            children, context = self.fresh("children"), self.fresh("context")
            self.lines.append(f"    {children}, {context} = {flatten}({var})")
            self.fail_if(
                f"len({children}) != {len(node.children)} or {context} != {self.constant(node.context, 'CONTEXT')}"
            )
            for i, child in enumerate(node.children):
                self.node(child, f"{children}[{i}]")
        elif isinstance(node, ObjectInput):
            self.in_object += 1
            var = self.bind(expr, "obj")
            self.object_vars[id(node)] = var
            state = self.bind(f"{var}.__dict__", "state")
            self.fail_if(
                f"type({var}) is not {self.constant(node.type, 'TYPE')} or tuple({state}) != {self.constant(node.names, 'NAMES')}"
            )
            for name, child in zip(node.names, node.children):
                self.node(child, f"{state}[{name!r}]")
            self.in_object -= 1
        elif isinstance(node, SameObjectInput):
            if isinstance(node.first, ObjectInput):
                same = self.object_vars[id(node.first)]
            else:
                same = (self.local_vars if node.local else self.tensor_vars)[id(node.first)]
            self.fail_if(f"{expr} is not {same}")
        else:
            raise TypeError(f"unknown input node {node!r}")

    def alike_objects(self, objects: list[ObjectInput], var: str) -> None:
        """A sequence of objects of one class with the same attributes, each a constant or
        a tensor (a KV cache's layers): checked column by column in C-level passes, the
        tensors with the batch, not lines per object."""
        self.in_object += 1
        first = objects[0]
        n = len(objects)
        self.globals.setdefault("OBJECT_STATE", operator.attrgetter("__dict__"))
        self.globals["is_"] = operator.is_
        states = self.fresh("states")
        self.fail_if(f"not all(map(is_, map(type, {var}), {self.constant([first.type] * n, 'TYPES')}))")
        self.lines.append(f"    {states} = list(map(OBJECT_STATE, {var}))")
        self.fail_if(f"list(map(tuple, {states})) != {self.constant([first.names] * n, 'NAMES')}")
        columns = {}
        for j, name in enumerate(first.names):
            column = columns[name] = self.bind(
                f"list(map({self.constant(operator.itemgetter(name), 'ITEM')}, {states}))", "column"
            )
            if isinstance(first.children[j], ConstantInput):
                values = [o.children[j].value for o in objects]
                types = self.constant([type(v) for v in values], "TYPES")
                self.fail_if(f"list(map(type, {column})) != {types} or {column} != {self.constant(values, 'VALUES')}")
        for i, obj in enumerate(objects):
            self.object_vars[id(obj)] = f"{var}[{i}]"
            for name, child in zip(obj.names, obj.children):
                if isinstance(child, TensorInput):
                    item = f"{columns[name]}[{i}]"
                    self.tensor_meta(item, child.meta, child.proxy)
                    self.results.append(item)
                    self.result_labels.append(child.proxy.label)
                    self.tensor_vars[id(child)] = self.local_vars[id(child)] = item
        self.in_object -= 1

    def _constant(self, value: object, expr: str) -> None:
        if value is None:
            self.fail_if(f"{expr} is not None")
        elif isinstance(value, float) and math.isnan(value):
            self.fail_if(f"type({expr}) is not float or {expr} == {expr}")
        elif isinstance(value, float) and value == 0.0:
            # 0.0 == -0.0, but 1 / x tells them apart.
            self.globals["math"] = math
            self.fail_if(
                f"type({expr}) is not float or {expr} != 0.0 or math.copysign(1.0, {expr}) != {math.copysign(1.0, value)}"
            )
        else:
            kind = (
                type(value).__name__
                if type(value) in (bool, int, float, complex, str)
                else self.constant(type(value), "TYPE")
            )
            self.fail_if(f"type({expr}) is not {kind} or {expr} != {self.constant(value, 'CONST')}")


@dataclass
class _Batched:
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


def _alike_objects(children: list) -> bool:
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


def _stand_in(meta: LocalTensorMeta) -> torch.Tensor | None:
    """A tensor with ``meta``'s type, dtype, device and requires_grad, and no elements:
    TensorGuards' example for a tensor the trace holds no reference to (an input
    object's), the sizes and strides given apart."""
    t = torch.empty(0, dtype=meta.dtype, device=meta.device)
    if meta.type is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=meta.requires_grad)
    return t.requires_grad_(meta.requires_grad) if meta.type is torch.Tensor else None


def build_prologue(
    inputs: CallInputs,
    grad_enabled: bool,
    captured: list[tuple[torch.Tensor, object]],
    module: torch.nn.Module | None,
    unwrap_differentiable: bool = True,
    shape_env=None,
    objects: list[ObjectInput] = (),
    input_labels: list[str] | None = None,
) -> GeneratedFunction:
    """The prologue of one cache entry (see the module docstring). With
    ``unwrap_differentiable=False`` it returns a DTensor that requires grad itself, not its
    local tensor. With a ``shape_env`` (symbolic values) it binds the symbolic sizes and
    checks the ShapeEnv's guards. After the computation's inputs it returns ``objects``
    (input objects the epilogue updates or returns). ``input_labels``: the computation's
    inputs, in order; the results are checked against them as the prologue is built."""
    b = _Builder(unwrap_differentiable)
    b.fail_if(f"torch.is_grad_enabled() is not {grad_enabled}")
    # The arguments first: a call an entry does not fit usually fails there, cheaply.
    b.node(inputs.args, "args")
    b.node(inputs.kwargs, "kwargs")
    if len(b.argument_tensors) > 1:
        # Tensors traced as distinct objects are distinct at the call (code may ask ``q is k``).
        distinct = ", ".join(f"id({var})" for var in b.argument_tensors)
        b.fail_if(f"len({{{distinct}}}) != {len(b.argument_tensors)}")
    if module is not None:
        # Global module hooks (debugging tools such as CommDebugMode install them) are not
        # guarded: they ran while tracing, and run again only when a call compiles.
        b.module_state(module, inputs, module_checks(b, module))
    # After the module checks: a module's attributes are read from the modules traced.
    python_state_checks(b, inputs.python_state.guards())
    for i, (held, proxy) in enumerate(captured):
        # Held by reference: its values are read at each call, its metadata guarded.
        name = f"CAPTURED{i}"
        b.globals[name] = held
        if isinstance(held, DTensor):  # a closed-over DTensor of a training call: its local tensor is the input
            b.fail_if(f"{name}.requires_grad is not {held.requires_grad}")
            local = b.bind(f"{name}._local_tensor", "local")
            b.tensor_meta(local, LocalTensorMeta.of(held._local_tensor), proxy, held._local_tensor)
            b.results.append(name if held.requires_grad and not unwrap_differentiable else local)
            b.result_labels.append(proxy.label)
            continue
        b.tensor_meta(name, LocalTensorMeta.of(held), proxy, held)
        b.results.append(name)
        b.result_labels.append(proxy.label)
    b.check_batched()
    if shape_env is not None:
        b.symbolic_guards(shape_env)
    for device in sorted(b.devices):
        # Autocast inserts casts while tracing: a program traced with it differs from one without.
        enabled = torch.is_autocast_enabled(device)
        check = f"torch.is_autocast_enabled({device!r}) is not {enabled}"
        if enabled:
            check += f" or torch.get_autocast_dtype({device!r}) is not {torch.get_autocast_dtype(device)}"
        b.fail_if(check)
    if len(b.object_vars) > 1:
        # Objects traced as distinct must be distinct: the program updates each on its own.
        distinct = ", ".join(f"id({var})" for var in b.object_vars.values())
        b.fail_if(f"len({{{distinct}}}) != {len(b.object_vars)}")
    if input_labels is not None and b.result_labels != list(input_labels):
        # Capture orders the trace's inputs, this builder the prologue's results, by two
        # walks of the same tree: if they ever differ, tensors would bind to the wrong inputs.
        raise AssertionError(
            f"dtcompile: the prologue would return {b.result_labels}, the computation takes {list(input_labels)}"
        )
    b.results += [b.object_vars[id(node)] for node in objects]
    returned = ", ".join(b.results)
    lines = [
        "def prologue(module, args, kwargs):",
        *b.lines,
        f"    return ({returned}{',' if len(b.results) == 1 else ''})",
    ]
    return GeneratedFunction("prologue", lines, b.globals, "prologue: guards the call and unpacks its inputs")
