"""Generating a prologue: the function that guards a call and unpacks its inputs.

The prologue receives ``(module, args, kwargs)`` as the user passed them. It checks
everything the trace assumed (the :class:`InputNode` tree from capture, grad mode, the
training flags of a module's submodules) and returns the computation's inputs in order,
or ``None`` as soon as one assumption fails, so the next cache entry can be tried.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor, Placement

from ..capture import (
    CallInputs,
    ConstantInput,
    DictInput,
    DTensorInput,
    GlobalState,
    LocalTensorMeta,
    ObjectInput,
    PytreeInput,
    SameObjectInput,
    SequenceInput,
    TensorInput,
)
from ..capture.python_reads import value_key
from ..core.codegen import GeneratedFunction, literal_or_global
from ..core.printing import python_literal
from ..core.symbolic import LARGEST_SYMBOLIC_SIZE, SOURCE_GLOBALS, is_symbolic, python_source, symbolic_expr
from ..core.torch_internals import (
    TensorGuards,
    shape_guards,
    symbol_range,
)
from .batched_guards import (
    Batched,
    alike,
    alike_objects,
    attribute_checks,
    check_batched,
    distinct_objects,
    module_tensors,
    reached_otherwise,
    stand_in,
)
from .guards import meshes_match, spec_matches, unbound_sizes, writes_counted
from .state_guards import global_state_checks, state_checks


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
        self.globals: dict[str, object] = {name: obj for name, obj, _ in SOURCE_GLOBALS}
        self.globals.update(DTensor=DTensor, spec_matches=spec_matches, meshes_match=meshes_match, VALUE_KEY=value_key)
        self.globals["LEAF"] = LocalTensorMeta.leaf_of
        self.results: list[str] = []
        self.result_labels: list[str] = []  # the trace input each result binds, in order
        self.object_vars: dict[int, str] = {}  # id of an ObjectInput -> the variable bound to it
        # id of a TensorInput or DTensorInput -> the variable bound to the tensor (the DTensor), and
        # to the local tensor (itself, the DTensor's local): one met again must be the same object.
        self.tensor_vars: dict[int, str] = {}
        self.local_vars: dict[int, str] = {}
        self.in_object = 0  # inside an object of the call (its tensors are not arguments)
        # The call's tensors (arguments, objects', the module's bound one by one), each met
        # once; and columns of them (``alike_objects``: an expression, its length).
        self.call_tensors: list[str] = []
        self.call_columns: list[tuple[str, int]] = []
        # Lists of alike objects (``alike_objects``: variable, length) and the ids of their nodes.
        self.object_columns: list[tuple[str, int]] = []
        self.in_columns: set[int] = set()
        self.held_ids = False  # the ids of the module's tensors read in one pass are bound (HELD_IDS)
        # Tensors with static metadata, checked together by one TensorGuards call (C++).
        self.batched: list[Batched] = []
        # The module's tensors read in one pass (``module_tensors``): all, and where each list bound starts.
        self.pickable: tuple[str, dict[str, int]] | None = None
        self.held_examples: dict[str, torch.Tensor] = {}  # ``HELD[i]``: the module's tensor traced
        self._count = 0

    def fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def constant(self, obj: object, prefix: str) -> str:
        if isinstance(obj, (list, tuple)) and len(obj) > 8:  # not built at each call (devices, per layer)
            name = self.fresh(prefix)
            self.globals[name] = obj
            return name
        return literal_or_global(obj, self.globals, prefix)

    def tuple_of(self, exprs: list[str]) -> str:
        """Source of the tuple of ``exprs``, each run of items of the module's tensor
        lists (``HELD[i]``, ``HELD_LOCAL[j]``: ``self.pickable``) written as one C-level
        pick from them: a deep model's prologue would otherwise spell out hundreds."""
        parts, run = [], []

        def flush():
            if len(run) > 1:
                pick = self.fresh("PICK")
                self.globals[pick] = operator.itemgetter(*(index for index, _ in run))
                parts.append(f"*{pick}({self.pickable[0]})")
            else:
                parts.extend(expr for _, expr in run)
            run.clear()

        for expr in exprs:
            base, _, rest = expr.partition("[")
            if self.pickable is not None and base in self.pickable[1] and rest[:-1].isdigit():
                run.append((self.pickable[1][base] + int(rest[:-1]), expr))
                continue
            flush()
            parts.append(expr)
        flush()
        return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"

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
            example = stand_in(meta)  # an input object's tensor: checked with the batch too
        if static and example is not None and TensorGuards is not None:
            self.batched.append(Batched(var, example, meta.shape, meta.stride, offset))
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
                f" or {meta.bits_check(var)}"
            )
            return
        self.fail_if(
            f"{var}.dtype is not {python_literal(meta.dtype)} or {var}.dim() != {proxy.dim()}"
            f" or {var}.device != {device} or {var}.requires_grad is not {meta.requires_grad}"
            f" or {meta.bits_check(var)}"
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
        and 1 were traced as constants, so a symbol stands for 2 and more, up to
        ``LARGEST_SYMBOLIC_SIZE``). The ranges first: a guard may divide by a size that
        another call has as 0 (``n % (2 * s)``)."""
        for symbol, var in self.symbols.items():
            bounds = symbol_range(shape_env, symbol)
            if bounds is not None and bounds.lower.is_Integer:
                self.fail_if(f"{var} < {int(bounds.lower)}")
            upper = LARGEST_SYMBOLIC_SIZE
            if bounds is not None and bounds.upper.is_Integer:
                upper = min(upper, int(bounds.upper))
            self.fail_if(f"{var} > {upper}")
        for item, expr in self.relations:
            self.fail_if(f"{item} != {self.source(expr)}")
        checked = set()
        for expr in shape_guards(shape_env):
            if expr is sympy.true or expr in checked:
                continue
            checked.add(expr)
            self.fail_if(f"not ({self.source(expr)})")

    def source(self, expr) -> str:
        missing = expr.free_symbols - set(self.symbols)
        if missing:  # a storage's size (an argument viewing a tensor of the module's: ``m.w.detach()[1:]``)
            raise unbound_sizes(missing)
        return python_source(expr, self.symbols)

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
            self.call_tensors.append(var)
        elif isinstance(node, DTensorInput):
            var = self.bind(expr)
            self.tensor_vars[id(node)] = var
            self.call_tensors.append(var)
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
                    f" or {var}.dim() != {len(node.traced_spec.tensor_meta.shape)}"  # (then its sizes, one by one)
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
            self.call_tensors.append(local)  # (``f(dt, dt.to_local())`` traced apart)
            self.tensor_meta(local, node.meta, node.proxy, None if example is None else example._local_tensor)
            self.results.append(var if node.requires_grad and not self.unwrap_differentiable else local)
            self.result_labels.append(node.proxy.label)
        elif isinstance(node, SequenceInput):
            if expr == "args":  # always the tuple of positional arguments
                var = expr
                self.fail_if(f"len(args) != {len(node.children)}")
            else:
                var = self.object_vars[id(node)] = self.bind(expr)  # (returned: the caller's own)
                kind = node.type.__name__ if node.type in (tuple, list) else self.constant(node.type, "TYPE")
                self.fail_if(f"type({var}) is not {kind} or len({var}) != {len(node.children)}")
            if alike(node.children):
                alike_objects(self, node.children, var)
                return
            for i, child in enumerate(node.children):
                self.node(child, f"{var}[{i}]")
        elif isinstance(node, DictInput):
            var = expr if expr == "kwargs" else self.bind(expr)
            self.object_vars[id(node)] = var
            plain = expr == "kwargs" and all(type(key) is str for key in node.keys)  # (others: a str enum key)
            if not node.keys and expr == "kwargs":
                self.fail_if("kwargs")
            else:
                # In order (``d.values()``); keys not strings by value_key (1, 1.0, True: one to ``==``).
                keys = self.constant(tuple(node.keys) if plain else value_key(tuple(node.keys)), "KEYS")
                found = f"tuple({var})" if plain else f"VALUE_KEY(tuple({var}))"
                self.fail_if(f"type({var}) is not dict or {found} != {keys}")
            values = None if plain else self.bind(f"list({var}.values())", "values")  # (a key need not have a
            for i, (key, child) in enumerate(zip(node.keys, node.children)):  # literal, nor find itself: a nan)
                self.node(child, f"{var}[{key!r}]" if plain else f"{values}[{i}]")
        elif isinstance(node, PytreeInput):
            var = self.bind(expr)
            self.fail_if(f"type({var}) is not {self.constant(node.type, 'TYPE')}")
            flatten = self.constant(torch.utils._pytree.SUPPORTED_NODES[node.type].flatten_fn, "FLATTEN")
            children, context = self.fresh("children"), self.fresh("context")
            self.lines.append(f"    {children}, {context} = {flatten}({var})")
            self.fail_if(  # (an OrderedDict's keys, a defaultdict's factory: by value_key, as above)
                f"len({children}) != {len(node.children)}"
                f" or VALUE_KEY({context}) != {self.constant(value_key(node.context), 'CONTEXT')}"
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
            if isinstance(node.first, (ObjectInput, SequenceInput, DictInput)):  # (an object, a list met again)
                same = self.object_vars[id(node.first)]
            else:
                same = (self.local_vars if node.local else self.tensor_vars)[id(node.first)]
            self.fail_if(f"{expr} is not {same}")
        else:
            raise TypeError(f"unknown input node {node!r}")

    def _constant(self, value: object, expr: str) -> None:
        """Guard a constant input by exact type and value (a float's zero by its sign, a NaN by its bits)."""
        kind = type(value)
        if value is None:
            self.fail_if(f"{expr} is not None")
        elif kind in (bool, int, str) or (kind is float and value == value and value != 0.0):
            self.fail_if(f"type({expr}) is not {kind.__name__} or {expr} != {self.constant(value, 'CONST')}")
        else:
            by_value = kind in _EQUAL_BY_VALUE or isinstance(value, Placement)  # (a dtype, ``Shard(0)``)
            compared = (
                f"{expr} != {self.constant(value, 'CONST')}"
                if by_value
                else f"VALUE_KEY({expr}) != {self.constant(value_key(value), 'CONST')}"
            )
            self.fail_if(f"type({expr}) is not {self.constant(kind, 'TYPE')} or {compared}")


_EQUAL_BY_VALUE = (torch.dtype, torch.device, torch.layout, torch.memory_format, type(...), ReduceOp.RedOpType)


def build_prologue(
    inputs: CallInputs,
    grad_enabled: bool,
    global_state: GlobalState,
    captured: list[tuple[torch.Tensor, object]],
    module: torch.nn.Module | None,
    unwrap_differentiable: bool = True,
    shape_env=None,
    objects: list[ObjectInput] = (),
    input_labels: list[str] | None = None,
    dtensor_writes=(),
) -> GeneratedFunction:
    """The prologue of one cache entry (see the module docstring), for a call traced with grad mode
    ``grad_enabled`` and under ``global_state``. With ``unwrap_differentiable=False`` it returns a DTensor
    that requires grad itself, not its local tensor. With a ``shape_env`` (symbolic values) it binds the
    symbolic sizes and checks the ShapeEnv's guards. After the computation's inputs it returns ``objects``
    (input objects the epilogue updates or returns). ``input_labels``: the computation's inputs, in order;
    the results are checked against them as the prologue is built. Last, it counts ``dtensor_writes``."""
    b = _Builder(unwrap_differentiable)
    b.fail_if(f"torch.is_grad_enabled() is not {grad_enabled}")
    global_state_checks(b, global_state)
    # The arguments first: a call an entry does not fit usually fails there, cheaply.
    b.node(inputs.args, "args")
    b.node(inputs.kwargs, "kwargs")
    # The module tree, then the Python values read: a module's attributes are read from the modules
    # traced. Global module hooks (debugging tools such as CommDebugMode install them) are not
    # guarded: they ran while tracing, and run again only when a call compiles.
    sources = state_checks(b, module, inputs.python_state)
    if module is not None:
        module_tensors(b, module, inputs, sources)
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
    check_batched(b)
    attribute_checks(b, inputs.nodes())
    if shape_env is not None:
        b.symbolic_guards(shape_env)
    for device in sorted(d for d in b.devices if torch.amp.is_autocast_available(d)):  # (not "meta")
        # Autocast inserts casts while tracing: a program traced with it differs from one without.
        enabled = torch.is_autocast_enabled(device)
        check = f"torch.is_autocast_enabled({device!r}) is not {enabled}"
        if enabled:
            check += f" or torch.get_autocast_dtype({device!r}) is not {torch.get_autocast_dtype(device)}"
        b.fail_if(check)
    distinct_objects(b, reached_otherwise(inputs.python_state.reads))
    if input_labels is not None and b.result_labels != list(input_labels):
        # Capture orders the trace's inputs, this builder the prologue's results, by two
        # walks of the same tree: if they ever differ, tensors would bind to the wrong inputs.
        raise AssertionError(
            f"dtcompile: the prologue would return {b.result_labels}, the computation takes {list(input_labels)}"
        )
    # Input objects, and DTensors returned as the caller's own (bound as tensors).
    b.results += [b.object_vars.get(id(node)) or b.tensor_vars[id(node)] for node in objects]
    writes_counted(b, dtensor_writes)
    lines = ["def prologue(module, args, kwargs):", *b.lines, f"    return {b.tuple_of(b.results)}"]
    return GeneratedFunction("prologue", lines, b.globals, "prologue: guards the call and unpacks its inputs")
