"""Tracing one call: from a function and its arguments to a per-rank trace.

The call runs once on proxies, below DTensor (see ``recorder.py``). What comes out is a
:class:`CapturedCall`: the computation trace, the tree of inputs the prologue guards,
the tree of outputs the epilogue rebuilds, and the constants the program closes over.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..core import InputPath, Trace, verify
from .autograd import BackwardCapture, capture_backward
from .inputs import DictInput, DTensorInput, InputNode, InputProxifier, ObjectInput, SequenceInput, iter_leaves
from .objects import AttributeUpdate, holds_proxies, is_state_object
from .outputs import OutputCollector, OutputNode
from .placements import describe_placements
from .recorder import CallAnnotator, OpRecorder, Recording, TracingError


@dataclass
class CallInputs:
    """The inputs of a call: positional, keyword, and a module's parameters and buffers."""

    args: InputNode
    kwargs: InputNode
    params: list[tuple[str, InputNode]] = field(default_factory=list)
    buffers: list[tuple[str, InputNode]] = field(default_factory=list)
    attributes: list[tuple[str, InputNode]] = field(default_factory=list)  # tensors in a module's __dict__

    def nodes(self) -> list[InputNode]:
        module_state = self.params + self.buffers + self.attributes
        return [self.args, self.kwargs] + [n for _, n in module_state]


@dataclass
class CapturedCall:
    trace: Trace
    inputs: CallInputs
    output: OutputNode
    captured: list[torch.Tensor]
    grad_enabled: bool
    meshes: list  # the DeviceMeshes of the DTensor inputs, without repeats
    shape_env: ShapeEnv | None  # the symbols and guards of symbolic sizes
    # For a call that needs gradients: the trace holds the forward and then the backward,
    # and this says where one ends and what the other takes and gives.
    backward: BackwardCapture | None = None
    # The input objects the epilogue receives (to update or to return), and the updates.
    objects: list[ObjectInput] = field(default_factory=list)
    updates: list[AttributeUpdate] = field(default_factory=list)


def _parameter_names(fn) -> list[str]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _rank_line() -> str:
    if dist.is_available() and dist.is_initialized():
        return f"per-rank program of rank {dist.get_rank()} of {dist.get_world_size()}"
    return "program of a single process"


def capture_call(
    fn, args: tuple, kwargs: dict, module: torch.nn.Module | None = None, symbolic: bool = False
) -> CapturedCall:
    """Trace ``fn(*args, **kwargs)`` (or ``module(*args, **kwargs)``) into a per-rank trace.
    With ``symbolic`` the sizes of the call's tensors are symbols of a ShapeEnv (the
    module's parameters, buffers and attributes keep theirs)."""
    recording = Recording(FakeTensorMode(shape_env=ShapeEnv() if symbolic else None))
    proxifier = InputProxifier(recording, symbolic)
    names = _parameter_names(module.forward if module is not None else fn)
    arg_pairs = [
        proxifier.proxify(a, InputPath("args").index(i), names[i] if i < len(names) else f"arg{i}")
        for i, a in enumerate(args)
    ]
    kwarg_pairs = [proxifier.proxify(v, InputPath("kwargs").key(k), k) for k, v in kwargs.items()]
    inputs = CallInputs(
        SequenceInput(InputPath("args"), tuple, [n for _, n in arg_pairs]),
        DictInput(InputPath("kwargs"), tuple(kwargs.keys()), [n for _, n in kwarg_pairs]),
    )
    proxy_args = tuple(p for p, _ in arg_pairs)
    proxy_kwargs = dict(zip(kwargs.keys(), (p for p, _ in kwarg_pairs)))
    state: dict[int, object] = {}  # id of a tensor the module holds -> what the traced module holds
    if module is not None:
        for kind, named in (
            ("params", module.named_parameters()),
            ("buffers", module.named_buffers()),
            ("attributes", _tensor_attributes(module)),
        ):
            for name, tensor in named:
                if id(tensor) in state:  # the same tensor under a second name
                    continue
                proxy, node = proxifier.proxify(tensor, InputPath(kind).key(name), name)
                getattr(inputs, kind).append((name, node))
                state[id(tensor)] = proxy

    grad_enabled = torch.is_grad_enabled()
    training = grad_enabled and bool(proxifier.differentiable)
    collector = OutputCollector(proxifier.objects)
    module_objects = _module_objects(module) if module is not None else []
    backward = None
    with enable_python_dispatcher(), CallAnnotator(recording), OpRecorder(recording):
        try:
            if module is not None:
                with _state_swapped(module, state):
                    result = module(*proxy_args, **proxy_kwargs)
            else:
                result = fn(*proxy_args, **proxy_kwargs)
            output = collector.describe(result)
            updates = proxifier.objects.updates(collector.describe)
            if training and proxifier.objects.needed:
                raise TracingError(
                    "dtcompile.jit: a call that needs gradients returns or changes an input object "
                    f"({proxifier.objects.needed[0].path}); that is supported only without gradients"
                )
            if training:
                backward = capture_backward(recording, proxifier.differentiable, collector.values)
        finally:
            recording.forget_values()
            collector.release_masks()
            stained = _restore_stained(module_objects)
    if stained:
        raise TracingError(
            f"dtcompile.jit: the call stored a traced tensor in the module's attribute {stained[0]!r}; objects "
            "a module holds are read when tracing, not at each call. Pass the object in the call instead "
            "(its tensors then become inputs and its attribute changes are replayed after each call)"
        )

    leaves = [n for top in inputs.nodes() for n in iter_leaves(top)]
    proxies = [n.proxy for n in leaves if hasattr(n, "proxy")] + recording.captured_proxies
    outputs = tuple(collector.proxies)
    if backward is not None:
        proxies += backward.cotangents
        outputs += tuple(g for g in backward.grads if g is not None)
    trace = Trace(
        fn_name="computation",
        inputs=proxies,
        bound_symbols=recording.bound_symbols,
        output=outputs,
        title="computation, as recorded below DTensor" + (" (forward, then backward)" if backward else ""),
        header_notes=[_rank_line()],
        input_notes={n.proxy.label: _input_note(n) for n in leaves if hasattr(n, "proxy")},
        globals={label: (constant.value, None) for label, constant in recording.constants.items()},
    )
    verify(trace)
    meshes = []
    for node in proxifier.dtensor_inputs:
        if not any(node.spec.mesh is m for m in meshes):
            meshes.append(node.spec.mesh)
    shape_env = recording.fake_mode.shape_env
    return CapturedCall(
        trace,
        inputs,
        output,
        recording.captured,
        grad_enabled,
        meshes,
        shape_env,
        backward,
        proxifier.objects.needed,
        updates,
    )


def _module_objects(module: torch.nn.Module) -> list[tuple[str, object, dict]]:
    """``(path, object, its state now)`` for each object a module holds (and the objects
    those hold, a few levels down): read at trace time, they are not inputs."""
    found, seen = [], set()

    def visit(path: str, value: object, depth: int) -> None:
        if depth > 3 or id(value) in seen or not is_state_object(value):
            return
        seen.add(id(value))
        found.append((path, value, dict(vars(value))))
        for name, child in vars(value).items():
            visit(f"{path}.{name}", child, depth + 1)

    for owner_name, owner in module.named_modules():
        for attr, value in vars(owner).items():
            visit(f"{owner_name}.{attr}" if owner_name else attr, value, 0)
    return found


def _restore_stained(objects: list[tuple[str, object, dict]]) -> list[str]:
    """Where the call left traced tensors in objects a module holds: their paths, after
    putting every such object's state back as it was before tracing."""
    stained = [path for path, obj, _ in objects if any(holds_proxies(v, 1) for v in vars(obj).values())]
    if stained:
        for _, obj, state in objects:
            obj.__dict__.clear()
            obj.__dict__.update(state)
    return stained


def _tensor_attributes(module: torch.nn.Module):
    """``(dotted name, tensor)`` for each plain tensor attribute of the module and its
    submodules (a cached mask, say): neither parameters nor buffers, but read at every
    call like them, so that assigning a new tensor is seen."""
    for owner_name, owner in module.named_modules():
        for attr, value in vars(owner).items():
            if isinstance(value, torch.Tensor):
                yield (f"{owner_name}.{attr}" if owner_name else attr), value


@contextlib.contextmanager
def _state_swapped(module: torch.nn.Module, state: dict[int, object]):
    """The module's parameters, buffers and tensor attributes replaced by their proxies
    while it is traced, and restored afterwards, even if tracing fails.

    Every place that holds a tensor gets its proxy, so tied weights stay tied. This is not
    ``torch.func.functional_call``: that leaves the proxies in a module registered under
    two names (``self.b = self.a``), since it saves the second name's "original" after
    setting the first, which is the same attribute of the same module.
    """
    saved = []
    for owner in module.modules():  # each module object once, however many names it has
        for table in (owner._parameters, owner._buffers, vars(owner)):
            for leaf, tensor in list(table.items()):
                if isinstance(tensor, torch.Tensor) and id(tensor) in state:
                    saved.append((table, leaf, tensor))
                    table[leaf] = state[id(tensor)]
    try:
        yield
    finally:
        for table, leaf, tensor in saved:
            table[leaf] = tensor


def _input_note(node) -> str:
    if isinstance(node, DTensorInput):
        meta = node.spec.tensor_meta
        shape = ", ".join(str(s) for s in meta.shape)
        return f"{node.proxy.provenance}  local of DTensor[{shape}] {describe_placements(node.spec.placements)}"
    return str(node.proxy.provenance)
