"""Generating an epilogue: the function that rebuilds the call's result.

The computation returns a flat tuple of local tensors. The epilogue wraps each DTensor
output with the spec DTensor's propagation gave it at trace time, through DTensor's own
constructor (no dispatch, no redistribution), and rebuilds the containers around them.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture import (
    ConstantOutput,
    DictOutput,
    DTensorOutput,
    HeldOutput,
    NewObjectOutput,
    NumberOutput,
    ObjectOutput,
    OutputNode,
    PytreeOutput,
    SequenceOutput,
    Slot,
    TensorOutput,
    new_object,
)
from ..capture.made_callables import remade
from ..capture.made_copies import copied
from ..core.codegen import GeneratedFunction, literal_or_global
from ..core.torch_internals import DTensorSpec, TensorMeta, keep_mask

_specs: dict[tuple, tuple[DTensorSpec, DTensorSpec]] = {}


def with_sizes(spec: DTensorSpec, shape: tuple, stride: tuple) -> DTensorSpec:
    """``spec`` with another global shape and stride (the call's, under symbolic values).
    Made once per (spec, sizes): a spec costs microseconds to build, and calls repeat sizes."""
    key = (id(spec), shape, stride)
    cached = _specs.get(key)
    if cached is not None and cached[0] is spec:
        return cached[1]
    if len(_specs) > 4096:
        _specs.clear()
    meta = TensorMeta(torch.Size(shape), stride, spec.tensor_meta.dtype)
    made = dataclasses.replace(spec, tensor_meta=meta)
    _specs[key] = (spec, made)
    return made


class _Answer(TorchDispatchMode):
    """Answers the op dispatched under it with ``made``."""

    def __init__(self, made: DTensor):
        super().__init__()
        self.made = made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.made


def as_view_of(base: DTensor, made: DTensor) -> DTensor:
    """``made`` (a DTensor just made, around a view of ``base``'s local tensor) as an autograd
    view of ``base``, as eager's (``x[:, 1:]``): sharing its version counter, ``_base`` it,
    and inside a custom Function refused in-place writes. Autograd makes a view of what a
    view op returns; the op, answered with ``made`` below it, runs no DTensor dispatch."""
    with _Answer(made):
        return torch.ops.aten.as_strided.default(base, made.shape, made.stride(), made.storage_offset())


def marked_parameter(local: torch.Tensor) -> torch.Tensor:
    """Eager's ``to_local()`` of a DTensor parameter: a Tensor that ``isinstance(..,
    nn.Parameter)`` accepts (torch marks it ``_is_param``)."""
    local._is_param = True
    return local


def requiring_grad(dtensor: DTensor) -> DTensor:
    """``dtensor`` with its local tensor (its own, detached) marked as requiring grad."""
    dtensor._local_tensor.requires_grad_()
    return dtensor


class _Builder:
    def __init__(self):
        self.globals: dict[str, object] = {"DTensor": DTensor, "torch": torch}
        self.statements: list[str] = []
        self._made: dict[int, str] = {}  # id of a DTensor (or shared) output node -> the variable it is made in
        self.uses: dict[int, int] = {}  # id of a node -> how many places of the result hold it
        self.input_positions: dict[str, int] = {}  # a training step's DTensor inputs: local label -> position

    def constant(self, obj: object, prefix: str) -> str:
        return literal_or_global(obj, self.globals, prefix)

    def dtensor(self, node: DTensorOutput) -> str:
        """``DTensor(local, spec)``, after keeping the call's masks where DTensor's embedding
        would; under symbolic values the spec is made anew with this call's global sizes.
        Made once, in a variable: a DTensor the call returns twice (``y, y``) is one object."""
        if id(node) not in self._made:
            made = self._new_dtensor(node)
            base = self._view_base(node)
            if base is not None:  # eager's is an autograd view of ``base``
                self.globals["as_view_of"] = as_view_of
                made = f"as_view_of({base}, {made})"
            self._made[id(node)] = name = f"d{len(self._made)}"
            self.statements.append(f"    {name} = {made}")
        return self._made[id(node)]

    def _view_base(self, node: DTensorOutput) -> str | None:
        if node.view_of_output is not None:
            return self.dtensor(node.view_of_output)
        if node.view_of_object is not None:
            return f"objs[{node.view_of_object}]"
        if node.view_of_input is not None and node.view_of_input in self.input_positions:
            return f"inputs[{self.input_positions[node.view_of_input]}]"
        return None

    def _new_dtensor(self, node: DTensorOutput) -> str:
        spec = self.constant(node.spec, "SPEC")
        for placement, slot in node.masks:
            self.globals["keep_mask"] = keep_mask
            self.statements.append(f"    keep_mask({spec}.placements[{placement}], outs[{slot}])")
        if node.shape is not None:
            self.globals["with_sizes"] = with_sizes
            spec = f"with_sizes({spec}, {self.sizes(node.shape)}, {self.sizes(node.stride)})"
        # requires_grad=False: a compiled training step gets its outputs' grad_fn from autograd.
        # The local tensor as eager's: one DTensor's dispatch made needs no gradient (the
        # program's may: a view of an input, made under no_grad); ``from_local`` of a tensor
        # that requires grad gives a local that does, set after DTensor's constructor (which
        # warns of a local that requires grad).
        local = f"outs[{node.index}]"
        if node.local_requires_grad:
            self.globals["requiring_grad"] = requiring_grad
            return f"requiring_grad(DTensor({local}.detach(), {spec}, requires_grad=False))"
        return f"DTensor({local} if not {local}.requires_grad else {local}.detach(), {spec}, requires_grad=False)"

    @staticmethod
    def sizes(values: tuple) -> str:
        items = [f"outs[{v.index}]" if isinstance(v, Slot) else str(v) for v in values]
        return f"({', '.join(items)}{',' if len(items) == 1 else ''})"

    def rebuild(self, node: OutputNode, wrap: bool) -> str:
        """The expression of ``node``; a container or object node met again (the call
        returned it twice) is made once, in a variable."""
        made_once = (SequenceOutput, DictOutput, PytreeOutput, NewObjectOutput)
        made_anew = (isinstance(node, ConstantOutput) and (node.copied or node.remade)) or (
            isinstance(node, TensorOutput) and node.parameter is not None
        )
        if not isinstance(node, made_once) and not made_anew:
            return self._rebuild(node, wrap)
        if id(node) in self._made:
            return self._made[id(node)]
        if self.uses.get(id(node), 1) == 1:
            return self._rebuild(node, wrap)
        expression = self._rebuild(node, wrap)
        self._made[id(node)] = name = f"o{len(self._made)}"
        self.statements.append(f"    {name} = {expression}")
        return name

    def _rebuild(self, node: OutputNode, wrap: bool) -> str:
        if isinstance(node, DTensorOutput):
            return self.dtensor(node) if wrap else f"outs[{node.index}]"
        if isinstance(node, TensorOutput) and node.parameter is not None:  # (eager's nn.Parameter(x * 2))
            return f"torch.nn.Parameter(outs[{node.index}], {node.parameter})"
        if isinstance(node, TensorOutput) and node.marked_parameter:
            self.globals["marked_parameter"] = marked_parameter
            return f"marked_parameter(outs[{node.index}])"
        if isinstance(node, (TensorOutput, NumberOutput)):
            return f"outs[{node.index}]"
        if isinstance(node, ConstantOutput):
            if node.remade:
                self.globals["remade"] = remade
                return f"remade({self.constant(node.value, 'MADE')})"
            if node.copied:
                self.globals["copied"] = copied
                return f"copied({self.constant(node.value, 'MADE')}, {self.constant(node.kept, 'KEPT')})"
            if type(node.value) in (list, dict, tuple):  # one there before the call: that very object
                name = f"CONST{len(self.globals)}"
                self.globals[name] = node.value
                return name
            return self.constant(node.value, "CONST")
        if isinstance(node, ObjectOutput):
            return f"objs[{node.index}]"
        if isinstance(node, SequenceOutput):
            inner = ", ".join(self.rebuild(c, wrap) for c in node.children)
            if node.type is list:
                return f"[{inner}]"
            if node.type is torch.Size:
                return f"torch.Size([{inner}])"
            if node.type is not tuple:  # a namedtuple: by ``_make``, which runs no ``__new__`` of its own again
                return f"{self.constant(node.type, 'TYPE')}._make(({inner}{',' if len(node.children) == 1 else ''}))"
            return f"({inner}{',' if len(node.children) == 1 else ''})"
        if isinstance(node, NewObjectOutput):
            self.globals["new_object"] = new_object
            inner = ", ".join(self.rebuild(c, wrap) for c in node.children)
            names = self.constant(node.names, "NAMES")
            return f"new_object({self.constant(node.type, 'TYPE')}, {names}, ({inner}{',' if len(node.children) == 1 else ''}))"
        if isinstance(node, DictOutput):
            items = zip(node.keys, node.children)
            return "{" + ", ".join(f"{self.constant(k, 'KEY')}: {self.rebuild(c, wrap)}" for k, c in items) + "}"
        if isinstance(node, PytreeOutput):
            unflatten = self.constant(torch.utils._pytree.SUPPORTED_NODES[node.type].unflatten_fn, "UNFLATTEN")
            children = ", ".join(self.rebuild(c, wrap) for c in node.children)
            made = f"{unflatten}([{children}], {self.constant(node.context, 'CONTEXT')})"
            if issubclass(node.type, collections.OrderedDict) and isinstance(node.context, list):
                return f"{self.constant(keys_in_order, 'IN_ORDER')}({made}, {self.constant(node.context, 'CONTEXT')})"
            return made
        raise TypeError(f"unknown output node {node!r}")


def keys_in_order(made: collections.OrderedDict, keys: list) -> collections.OrderedDict:
    """An OrderedDict node (a Hugging Face ``ModelOutput``) with its keys in the traced order:
    its constructor sets them in field order, where the code may have added one later
    (``out["loss"] = ...``), after the others, as eager's holds it."""
    if list(made.keys()) != keys:
        for key in keys:
            made.move_to_end(key)
    return made


def _uses(nodes: list) -> dict[int, int]:
    """How many places of the trees each node is at."""
    uses: dict[int, int] = {}
    stack = [n for n in nodes if isinstance(n, OutputNode)]
    while stack:
        node = stack.pop()
        uses[id(node)] = uses.get(id(node), 0) + 1
        if uses[id(node)] == 1:
            stack += getattr(node, "children", ())
    return uses


def dtensor_outputs(node: OutputNode):
    if isinstance(node, DTensorOutput):
        yield node
    for child in getattr(node, "children", ()):
        yield from dtensor_outputs(child)


def build_epilogue(output: OutputNode, wrap: bool = True, updates=(), module_updates=()) -> GeneratedFunction:
    """``epilogue(outs, objs)``: the call's result from the computation's flat outputs,
    after making the ``updates`` (AttributeUpdates) on the input objects ``objs`` and the
    ``module_updates`` (the forward's assignments to module attributes). With
    ``wrap=False`` the DTensor slots already hold DTensors (see ``build_output_wrapper``)."""
    b = _Builder()
    b.uses = _uses([output, *(u.value for u in updates), *(u.value for u in module_updates)])
    held = {}  # what the updates assign from module tables, read before any is made
    for update in module_updates:
        if isinstance(update.value, HeldOutput):
            source = f"{b.constant(update.value.module, 'MODULE')}.{update.value.table}[{update.value.key!r}]"
            held[id(update)] = f"held{len(held)}"
            b.statements.append(f"    {held[id(update)]} = {source}")
    for update in updates:
        value = b.rebuild(update.value, wrap)
        b.statements.append(f"    objs[{update.index}].__dict__[{update.name!r}] = {value}")
    for update in module_updates:
        table = f"{b.constant(update.module, 'MODULE')}.{update.table}"
        if update.value is None or update.moved:
            b.statements.append(f"    {table}.pop({update.key!r}, None)")
        if update.value is not None:
            value = held.get(id(update)) or b.rebuild(update.value, wrap)
            b.statements.append(f"    {table}[{update.key!r}] = {value}")
    result = b.rebuild(output, wrap)
    lines = ["def epilogue(outs, objs):", *b.statements, f"    return {result}"]
    return GeneratedFunction("epilogue", lines, b.globals, "epilogue: rebuilds the result from the local outputs")


def build_output_wrapper(output: OutputNode, slots: int, input_positions: dict[str, int]) -> GeneratedFunction:
    """``wrap_outputs(outs, inputs)``: each of the ``slots`` local outputs as the call returns
    it (DTensor slots wrapped; one eager makes a view of a DTensor of ``inputs``, the step's,
    at ``input_positions`` by its local tensor's label, a view of it), flat, for a training
    step's autograd function to return."""
    b = _Builder()
    b.input_positions = input_positions
    wrapped = [f"outs[{i}]" for i in range(slots)]
    for node in dtensor_outputs(output):
        wrapped[node.index] = b.dtensor(node)
    result = f"({', '.join(wrapped)}{',' if slots == 1 else ''})"
    lines = ["def wrap_outputs(outs, inputs):", *b.statements, f"    return {result}"]
    return GeneratedFunction("wrap_outputs", lines, b.globals, "wraps a training step's local outputs")


def views_made_own(outs, slots: int, inputs: list):
    """``outs`` with each output that views memory nothing else the step has or returns
    holds (``(x * 2).t()``: its base was the program's own) made a tensor of its own on that
    memory. Eager's is a view of an intermediate, which the caller may change in place;
    a custom Function's output that is a view may not be."""
    views = [i for i in range(slots) if isinstance(outs[i], torch.Tensor) and outs[i]._base is not None]
    if not views:
        return outs
    outs, memory = list(outs), collections.Counter()
    for t in (*outs, *inputs):
        if isinstance(t, torch.Tensor):
            memory[t.untyped_storage()._cdata] += 1
    for i in views:
        t = outs[i]
        if memory[t.untyped_storage()._cdata] == 1 and not (t.is_conj() or t.is_neg()):
            own = torch.empty(0, dtype=t.dtype, device=t.device)
            outs[i] = own.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return outs
