"""A compiled function: its cache of entries, the compilation pipeline and its stats.

Per call: run the prologue of each entry until one accepts the call (a hit), then the
entry's program. No entry accepts: trace, run the passes, lower onto the executors,
check that the ranks agree, and add the entry (a miss). A call that needs gradients
compiles a forward and a backward program run by one autograd Function (``training.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..capture import CapturedCall, DTensorInput, capture_call, iter_leaves
from ..core import TensorProxy, Trace, verify
from ..core.codegen import GeneratedFunction
from ..core.symbolic import as_constant, is_symbolic
from ..executors import lower, resolve_executors
from ..transforms import (
    combine_all_reduces,
    cse,
    dce,
    materialize_sizes,
    remove_identity_views,
    saved_note,
    split_forward_backward,
)
from .consistency import check_ranks_agree
from .epilogue import build_epilogue, build_output_wrapper
from .prologue import build_prologue
from .training import TrainingProgram

PASSES = (remove_identity_views, cse, combine_all_reduces, dce)
CACHE_OPTIONS = ("constant values", "no caching", "symbolic values")


@dataclass
class CacheEntry:
    prologue: GeneratedFunction
    run: Callable[[tuple], object]  # the prologue's result -> the call's result
    epilogue: GeneratedFunction
    traces: list[Trace]
    compile_seconds: float


class InferenceProgram:
    """The computation, then the epilogue."""

    __slots__ = ("computation", "epilogue")

    def __init__(self, computation, epilogue: GeneratedFunction):
        self.computation = computation
        self.epilogue = epilogue.fn

    def __call__(self, inputs: tuple):
        return self.epilogue(self.computation(*inputs))


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: list[float] = field(default_factory=list)
    last: CacheEntry | None = None


def group_labels(meshes) -> dict[str, str]:
    """A rank-independent label for each process group of the meshes: the mesh dim's name
    (``tp``), or ``mesh0.dim1`` for unnamed dims."""
    labels = {}
    for m, mesh in enumerate(meshes):
        names = mesh.mesh_dim_names
        for d in range(mesh.ndim):
            labels.setdefault(mesh.get_group(d).group_name, names[d] if names else f"mesh{m}.dim{d}")
    return labels


class CompiledFunction:
    """The compiled form of one function or module, with its cache."""

    def __init__(self, fn, *, module: torch.nn.Module | None, cache: str, executors):
        if cache not in CACHE_OPTIONS:
            raise ValueError(f"dtcompile.jit: cache must be one of {CACHE_OPTIONS}, not {cache!r}")
        self.fn = fn
        self.module = module
        self.cache = cache
        self.executors = resolve_executors(executors)
        self.entries: list[CacheEntry] = []
        self.stats = CompileStats()
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__
        self.symbolic = cache == "symbolic values"
        # Under symbolic values, every size the trace uses is computed in the trace first.
        self.sizes = (materialize_sizes,) if self.symbolic else ()

    def __call__(self, module, args: tuple, kwargs: dict):
        for entry in self.entries:
            inputs = entry.prologue.fn(module, args, kwargs)
            if inputs is not None:
                self.stats.hits += 1
                return entry.run(inputs)
        entry = self.compile(args, kwargs)
        inputs = entry.prologue.fn(module, args, kwargs)
        if inputs is None:
            raise AssertionError(
                f"dtcompile: the prologue of a fresh entry rejected the call it was compiled for:\n{entry.prologue}"
            )
        return entry.run(inputs)

    def compile(self, args: tuple, kwargs: dict) -> CacheEntry:
        start = time.perf_counter()
        captured = capture_call(self.fn, args, kwargs, module=self.module, symbolic=self.symbolic)
        labels = group_labels(captured.meshes)
        if captured.backward is None:
            run, epilogue, traces = self._inference(captured, labels)
        else:
            run, epilogue, traces = self._training(captured, labels)
        entry = CacheEntry(
            prologue=build_prologue(
                captured.inputs,
                captured.grad_enabled,
                captured.captured,
                self.module,
                unwrap_differentiable=captured.backward is None,
                shape_env=captured.shape_env,
            ),
            run=run,
            epilogue=epilogue,
            traces=traces,
            compile_seconds=time.perf_counter() - start,
        )
        self.stats.misses += 1
        self.stats.compile_seconds.append(entry.compile_seconds)
        self.stats.last = entry
        if self.cache != "no caching":
            self.entries.append(entry)
        return entry

    def _optimized(self, trace: Trace, passes) -> list[Trace]:
        traces = [trace]
        for transform in passes:
            traces.append(transform(traces[-1]))
            verify(traces[-1])
        return traces

    def _lowered(self, trace: Trace, labels: dict[str, str]) -> Trace:
        execution = lower(trace, self.executors)
        execution.header_notes += [
            f"process group {name!r}: mesh dim {label}, ranks {dist.get_process_group_ranks(_resolve_process_group(name))}"
            for name, label in labels.items()
        ]
        return execution

    def _inference(self, captured: CapturedCall, labels):
        traces = self._optimized(captured.trace, (*self.sizes, *PASSES))
        check_ranks_agree(traces[-1:], captured.meshes, labels, self.name)
        execution = self._lowered(traces[-1], labels)
        epilogue = build_epilogue(captured.output)
        return InferenceProgram(execution.compile(), epilogue), epilogue, traces + [execution]

    def _training(self, captured: CapturedCall, labels):
        backward = captured.backward
        slots = _slot_count(captured)
        joint_traces = self._optimized(captured.trace, (remove_identity_views, cse))
        split = split_forward_backward(joint_traces[-1], backward.cotangents, slots)
        forward_traces = self._optimized(split.forward, (*self.sizes, combine_all_reduces, dce))
        backward_traces = self._optimized(split.backward, (*self.sizes, combine_all_reduces, dce))
        check_ranks_agree([forward_traces[-1], backward_traces[-1]], captured.meshes, labels, self.name)
        forward_execution = self._lowered(forward_traces[-1], labels)
        forward_execution.header_notes.append(saved_note(forward_traces[-1], slots))
        backward_execution = self._lowered(backward_traces[-1], labels)
        inputs = captured.trace.inputs[: len(captured.trace.inputs) - len(backward.cotangents)]
        position = {p.label: i for i, p in enumerate(inputs)}
        differentiable_dtensors = {
            node.proxy.label
            for top in captured.inputs.nodes()
            for node in iter_leaves(top)
            if isinstance(node, DTensorInput) and node.requires_grad
        }
        with_grads = [
            (p, g, s) for p, g, s in zip(backward.differentiable, backward.grads, backward.grad_specs) if g is not None
        ]
        epilogue = build_epilogue(captured.output, wrap=False)
        program = TrainingProgram(
            forward=forward_execution.compile(),
            backward=backward_execution.compile(),
            wrap_outputs=build_output_wrapper(captured.output, slots),
            rebuild=epilogue,
            slots=slots,
            dtensor_inputs=sorted(position[label] for label in differentiable_dtensors),
            non_differentiable=[
                i
                for i in range(slots)
                if i not in set(backward.cotangent_slots) and isinstance(captured.trace.output[i], TensorProxy)
            ],
            cotangent_slots=backward.cotangent_slots,
            cotangent_specs=backward.cotangent_specs,
            cotangent_shapes=[tuple(as_constant(x) for x in c.shape) for c in backward.cotangents],
            grad_positions=[position[p.label] for p, _, _ in with_grads],
            grad_specs=[s for _, _, s in with_grads],
            grad_sizes_per_call=[
                s is not None and any(is_symbolic(x) for x in s.tensor_meta.shape) for _, _, s in with_grads
            ],
            inputs=len(inputs),
        )
        traces = [*joint_traces, *forward_traces, forward_execution, *backward_traces, backward_execution]
        return program, epilogue, traces


def _slot_count(captured: CapturedCall) -> int:
    """How many local outputs the forward returns before its saved values."""
    backward = captured.backward
    grads = sum(1 for g in backward.grads if g is not None)
    return len(captured.trace.output) - grads
