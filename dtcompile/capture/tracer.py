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
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

from ..core import InputPath, Trace, TracingError, data_dependent_error, verify
from ..core.compiling import compiling
from ..core.data_symbols import decided_by_values
from ..core.eager_paths import eager_paths
from ..core.torch_internals import decomposed_strategies_untraced, dtensor_refused_symbols
from .annotator import CallAnnotator
from .around_ops import code_around_ops
from .autograd import BackwardCapture, capture_backward
from .block_training import BlockReplayFailed
from .blocks import RepeatedBlocks
from .c10d import object_collective_refusal, symbolic_splits
from .cached_functions import cached_stand_ins, put_back_cached
from .data_branches import assumptions_unlogged, branch_refused, checks_first
from .data_parallel import refuse_data_parallel
from .fake_calls import storage_refusal
from .fsdp import FSDPTracing, option_reads, refuse_fsdp_reached, refusing_recomputes
from .global_state import (
    GlobalState,
    RandomStates,
    autocast_devices,
    autocast_regions,
    generators_made,
    modes_left_changed,
    seeding_refused,
    state_put_back,
    torch_caches_off,
)
from .grad_checks import gradient_refusal, repointed_leaf_refusal
from .input_fakes import InputFakes
from .input_nodes import DictInput, DTensorInput, InputNode, ObjectInput, SequenceInput, brings_proxy, iter_leaves
from .inputs import InputProxifier
from .method_checks import effects_refused, retained_outputs
from .module_state import ModuleState, ModuleUpdate, module_tensors
from .objects import AttributeUpdate
from .outlining import outline
from .outputs import OutputCollector, OutputNode
from .outside_memory import outside_memory
from .placements import describe_placements, respec_refusal
from .python_state import PythonState
from .recorder import OpRecorder, Recording
from .size_text import sizes_as_values_in_user_text
from .snapshots import ALL_LEVELS, LibrarySetUp, user_data
from .tensor_attributes import attribute_writes_refused
from .traced_errors import refused_input_dims
from .verified import VerifyFailed


@dataclass
class CallInputs:
    """The inputs of a call: positional, keyword, and a module's parameters and buffers."""

    args: InputNode
    kwargs: InputNode
    params: list[tuple[str, InputNode]] = field(default_factory=list)
    buffers: list[tuple[str, InputNode]] = field(default_factory=list)
    attributes: list[tuple[str, InputNode]] = field(default_factory=list)  # tensors in a module's __dict__
    # The Python values the code can read (globals, closure cells, module attributes),
    # guarded like the arguments.
    python_state: PythonState = field(default_factory=PythonState)

    def nodes(self) -> list[InputNode]:
        module_state = self.params + self.buffers + self.attributes
        return [self.args, self.kwargs] + [n for _, n in module_state]


@dataclass
class CapturedCall:
    trace: Trace
    inputs: CallInputs
    output: OutputNode
    # The tensors the program closes over, as the prologue holds them: each captured tensor,
    # or the closed-over DTensor whose local tensor it is.
    captured: list[torch.Tensor]
    grad_enabled: bool
    global_state: GlobalState
    meshes: list  # the DeviceMeshes of the DTensor inputs, without repeats
    shape_env: ShapeEnv | None  # the symbols and guards of symbolic sizes
    # For a call that needs gradients: the trace holds the forward and then the backward,
    # and this says where one ends and what the other takes and gives.
    backward: BackwardCapture | None = None
    # The input objects the epilogue receives (to update or to return), and the updates.
    objects: list[ObjectInput] = field(default_factory=list)
    updates: list[AttributeUpdate] = field(default_factory=list)
    # Attributes the forward assigned on the module's submodules, made again after each call.
    module_updates: list[ModuleUpdate] = field(default_factory=list)
    input_fakes: InputFakes | None = None  # the fakes of the real tensors that entered the trace
    dtensor_writes: list = field(default_factory=list)  # (``Proxifier.written_dtensors``): versions to count

    @property
    def python_state(self) -> PythonState:
        """The Python values the code can read, guarded by the prologue."""
        return self.inputs.python_state


_tracing: list[object] = []  # the recordings of the calls being traced now (nested jitted calls inline)


def is_tracing() -> bool:
    """Whether a call is being traced now (a jitted function it calls runs inline, then)."""
    return bool(_tracing)


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
    """Trace ``fn(*args, **kwargs)`` (or ``module(*args, **kwargs)``) into a per-rank trace; with
    ``symbolic`` the call's tensors' sizes are symbols (not the module's). Repeated blocks are
    recorded once (``blocks.py``; traced again with every block traced where one's backward cannot
    be). Where DTensor cannot propagate a sharding with a symbolic size (a ``_StridedShard``'s split
    factor), traced again with the input dims of the symbols it named as they are (a batch), then,
    where that is not enough, with all sizes as they are: narrower entries, guarded exactly."""
    static: frozenset = frozenset()
    while True:
        try:
            return _capture_replaying(fn, args, kwargs, module, symbolic, static)
        except Exception as error:
            if (refusal := storage_refusal(error)) is not None:  # (``vmap`` over the call: no storage)
                raise refusal from error
            if not symbolic or isinstance(error, TracingError) or not dtensor_refused_symbols(error):
                raise
            if (named := refused_input_dims(error)) <= static:
                return _capture_replaying(fn, args, kwargs, module, False)
            static |= named


def _capture_replaying(fn, args: tuple, kwargs: dict, module, symbolic: bool, static=frozenset()) -> CapturedCall:
    try:
        return _capture(fn, args, kwargs, module, symbolic, REPLAY_BLOCKS, static=static)
    except (BlockReplayFailed, VerifyFailed):
        return _capture(fn, args, kwargs, module, symbolic, False, static=static)


def _capture(
    fn, args: tuple, kwargs: dict, module: torch.nn.Module | None, symbolic: bool, replay: bool, static=frozenset()
) -> CapturedCall:
    # A ShapeEnv under either cache option: numbers read from tensor data are its
    # (unbacked) symbols. Only under symbolic values do the inputs' sizes get symbols.
    recording = Recording(FakeTensorMode(shape_env=decided_by_values(ShapeEnv())), static)
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
        for kind, named in module_tensors(module):
            for name, tensor in named:
                # A tensor under a second name (tied weights, an argument the module also
                # holds) is the same input, guarded to be the same object at each call.
                proxy, node = proxifier.proxify(tensor, InputPath(kind).key(name), name)
                getattr(inputs, kind).append((name, node))
                state.setdefault(id(tensor), proxy)

    grad_enabled, global_state = torch.is_grad_enabled(), GlobalState.now()
    random_states = RandomStates()
    held_flags = proxifier.held_flags()
    collector = OutputCollector(proxifier.objects, [traced for traced, _ in proxifier.traced_dtensors])
    module_state = ModuleState(module, state) if module is not None else None
    recording.snapshot = snapshot = user_data(
        fn, module_state and module_state.modules, module_state and module_state.paths
    )
    if module_state is not None:
        inputs.python_state = PythonState.of_module(module)
        inputs.python_state.reads += option_reads(module)
    else:
        inputs.python_state = PythonState.of_function(fn)
    for where, hook in code_around_ops():
        inputs.python_state.follow(hook, where)
    inputs.python_state.follow_inputs(inputs.nodes())
    if module_state is None:
        refuse_fsdp_reached([reached for _, reached in inputs.python_state.modules])
    reached = [module] if module is not None else [m for _, m in inputs.python_state.modules]
    refuse_data_parallel(reached, "the module" if module is not None else "a module the function calls")
    collector.reads = inputs.python_state.reads
    proxifier.refuse_other_paths(inputs.python_state.reads, inputs.python_state)
    for read in inputs.python_state.reads:
        if read.contents:  # a global dict of settings: its items changed in place are seen, and put back
            snapshot.add(read.value, read.where, depth=ALL_LEVELS)  # as deep as it is guarded
    for path, reached in inputs.python_state.modules:
        if module_state is None or id(reached) not in module_state.paths:
            # A module the code reaches (a global model a loss function calls) is not an
            # input: its attributes must not change (nor keep a proxy), like other user data.
            snapshot.add(vars(reached), f"the attributes of the module {path}")
    module_updates: list[ModuleUpdate] = []
    backward = None
    replay_notes, stretches = [], None
    _tracing.append(recording)
    # Libraries see a compiler tracing them, as under torch.compile (core/compiling.py).
    with (
        compiling(),
        sizes_as_values_in_user_text(),
        assumptions_unlogged(),
        enable_python_dispatcher(),
        eager_paths(),
        CallAnnotator(recording, replay),  # (traced again where a replay or check failed: no alias made again)
        OpRecorder(recording),
        seeding_refused(inputs.python_state.reads),
        torch_caches_off(),
        decomposed_strategies_untraced(),
        autocast_regions(autocast_entered := []),
        outside_memory(collector.existed),
        effects_refused(),
        symbolic_splits(recording),
    ):
        finished, cached = False, cached_stand_ins(inputs.python_state)
        try:
            if module_state is not None:
                with (
                    module_state,
                    FSDPTracing(module) as fsdp,
                    _repeated_blocks(recording, module_state, fsdp, replay) as blocks,
                ):
                    result = module(*proxy_args, **proxy_kwargs)
                    if blocks is not None:
                        replay_notes, stretches = blocks.notes(), blocks.stretches
                    closed = recording.closed_over_differentiable()
                    training = grad_enabled and bool(proxifier.differentiable or closed)
                    if not training:
                        proxifier.objects.return_as_given(proxifier.traced_dtensors)
                    module_updates = module_state.updates(collector.describe, training)
            else:
                result = fn(*proxy_args, **proxy_kwargs)
                closed = recording.closed_over_differentiable()
                training = grad_enabled and bool(proxifier.differentiable or closed)
                if not training:
                    proxifier.objects.return_as_given(proxifier.traced_dtensors)
            proxifier.objects.containers_returned = not training  # (else rebuilt: a new list, as before)
            output = collector.describe(result)
            gradient_refusal(held_flags, recording.captured_flags, collector.values, training)
            respec_refusal(proxifier.respecced() or recording.respecced())
            attribute_writes_refused(proxifier.traced_tensors(), collector.values)
            retained_outputs(recording, collector.values)
            updates = proxifier.objects.updates(collector.describe)
            collector.link_views()
            if training and proxifier.objects.needed:
                raise TracingError(
                    "dtcompile.jit: a call that needs gradients returns or changes an input object "
                    f"({proxifier.objects.needed[0].path}); that is supported only without gradients"
                )
            if training:
                managed = module_state is not None and bool(fsdp.managed)
                # (before the backward is traced: a checkpoint's recompute enters regions too)
                backward_autocast = () if autocast_entered else autocast_devices()
                repointed_leaf_refusal(recording.bound_symbols, proxifier.differentiable + closed)
                with module_state.again() if module_state is not None else contextlib.nullcontext():
                    backward = refusing_recomputes(
                        managed, capture_backward, recording, proxifier.differentiable + closed, collector.values
                    )
                # (code of the user's in the backward, a hook, runs under the backward's autocast in eager)
                backward.autocast_allowed = () if backward.users_code else backward_autocast
                if module_state is not None:
                    backward.recompute_from = frozenset(fsdp.recompute_from)
            checks_first(recording)  # branches taken on tensor data, checked before anything runs
            finished = True
        except GuardOnDataDependentSymNode as error:  # a number read from data, asked about in Python
            readers = [recording.read_by[s] for s in sorted(error.cond.free_symbols, key=str) if s in recording.read_by]
            reader = readers[0] if readers else recording.current_call
            raise data_dependent_error(reader, branch_refused(recording, error.cond)) from error
        except Exception as error:
            if (refusal := object_collective_refusal(error) or storage_refusal(error)) is None:
                error.input_sizes = recording.input_sizes  # (a symbol DTensor refuses: its input dim, kept next)
                raise
            raise refusal from error
        finally:
            put_back_cached(cached)
            _tracing.pop()
            recording.forget_values()
            collector.release_masks()
            changed = snapshot.put_back()
            if not finished:  # (a context manager of the code's, left by the error: ``cfg.x = v`` not undone)
                inputs.python_state.put_back_changed()
            left = state_put_back(grad_enabled, global_state)  # even where tracing failed
            drawn = random_states.changed() + generators_made(recording.constants, snapshot, inputs.python_state.reads)
    if drawn:
        raise TracingError(
            f"dtcompile.jit: the traced code used {drawn[0]} (it is put back). A compiled program runs the "
            "Python code once, while tracing: a number drawn would be a constant of the program, a seed set "
            "once. Draw numbers with torch's random ops, and seed outside the call"
        )
    left += modes_left_changed(global_state)
    if left:
        raise TracingError(
            f"dtcompile.jit: the traced code changed {left[0]} and left it so. A compiled program "
            "runs the Python code once, while tracing, so it would not change it at each call: set it before "
            "the call, or restore it inside (a with block)"
        )
    changed, set_once = inputs.python_state.changes_put_back(changed)
    if (setup := snapshot.library_setup + set_once) and not changed:
        raise LibrarySetUp(f"the call's first run {setup[0]}, once, as eager's does")
    if module_state is not None and module_state.refused:
        raise TracingError(module_state.refused)
    if changed:
        hook = "hook" in changed[0]  # (one in the backward: no assignment of it is replayed)
        where = "" if hook else ", a Python value outside its inputs"
        instead = "" if hook else ", or pass the object in the call (its attribute assignments are replayed after it)"
        raise TracingError(
            f"dtcompile.jit: the traced code changed {changed[0]}{where}. A compiled program runs the Python code "
            "once, while tracing, so such side effects would not happen at each call"
            f"{'' if 'not put back' in changed[0] else ' (the change was undone)'}. Return the values instead{instead}"
        )
    inputs.python_state.after_tracing(module_updates, recording)

    leaves = [n for top in inputs.nodes() for n in iter_leaves(top) if brings_proxy(n)]
    proxies = [n.proxy for n in leaves] + recording.captured_proxies
    outputs = tuple(collector.proxies)
    if backward is not None:
        proxies += backward.cotangents
        outputs += tuple(g for g in backward.grads if g is not None)
    symbols, outlined = outline(recording.bound_symbols, outputs, stretches, proxies, training=backward is not None)
    trace = Trace(
        fn_name="computation",
        inputs=proxies,
        bound_symbols=symbols,
        output=outputs,
        title="computation, as recorded below DTensor" + (" (forward, then backward)" if backward else ""),
        header_notes=[_rank_line(), *replay_notes, *outlined],
        input_notes={n.proxy.label: _input_note(n) for n in leaves},
        globals={label: (constant.value, None) for label, constant in recording.constants.items()},
    )
    verify(trace)
    meshes = list({id(node.spec.mesh): node.spec.mesh for node in proxifier.dtensor_inputs}.values())
    dtensor_writes = proxifier.written_dtensors(recording)
    return CapturedCall(
        trace,
        inputs,
        output,
        recording.captured_held,
        grad_enabled,
        global_state,
        meshes,
        recording.fake_mode.shape_env,
        backward,
        proxifier.objects.needed,
        updates,
        module_updates,
        recording.fakes,
        dtensor_writes,
    )


def _repeated_blocks(recording: Recording, module_state: ModuleState, fsdp: FSDPTracing, replay: bool):
    """Repeated blocks recorded once (``blocks.py``); not under FSDP2 (its hooks swap parameters)."""
    if not replay or fsdp.managed:
        return contextlib.nullcontext()
    return RepeatedBlocks(recording, module_state)


REPLAY_BLOCKS = True  # False traces every block (tests compare the two programs)


def _input_note(node) -> str:
    if isinstance(node, DTensorInput):
        shape = ", ".join(str(s) for s in node.spec.tensor_meta.shape)
        return f"{node.proxy.provenance}  local of DTensor[{shape}] {describe_placements(node.spec.placements)}"
    return str(node.proxy.provenance)
