"""A compiled function: its cache of entries, the compilation pipeline and its stats.

Per call: run the prologue of each entry, the most recently used first, until one accepts
the call (a hit), then the entry's program. No entry accepts: trace, run the passes, lower
onto the executors, check that the ranks agree (``consistency/``: a rank that fails while
compiling tells the others), and add the entry (a miss). A call that needs gradients runs
a forward and a backward program in one autograd Function (``training.py``)."""

from __future__ import annotations

import gc
import os
import threading
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..capture import CapturedCall, capture_call, is_tracing, ranks_meet_before_live_collectives
from ..capture.global_state import autocast_devices, autocast_off
from ..core import DataCheckFailed, TensorProxy, Trace, verify
from ..core.block_call import block_programs
from ..core.codegen import GeneratedFunction
from ..core.torch_internals import dispatch_modes_off, resolve_process_group, shape_guards
from ..executors import lower, resolve_executors
from ..transforms import has_symbolic_sizes, pipelines, saved_note, split_forward_backward
from .check import checked_call, running_eager
from .consistency import (
    GuardsDiffer,
    RankAgreement,
    calls_checked,
    check_hit,
    code_identity,
    explain_stall,
    group_labels,
    post_miss,
)
from .epilogue import build_epilogue
from .program_run import eager_after_failing, run_eagerly, run_entry
from .prologue import build_prologue
from .saved_hooks import OuterCheckpointsAside
from .saved_reads import backward_reads
from .training import TrainingProgram

ENTRIES_WARNING = 32  # entries of one function after which a warning says so
CACHE_OPTIONS = ("constant values", "no caching", "symbolic values")
CHECK_OPTIONS = (None, "eager")


@dataclass
class CacheEntry:
    prologue: GeneratedFunction
    run: Callable[[tuple], object]  # the prologue's result -> the call's result
    epilogue: GeneratedFunction
    traces: list[Trace]
    compile_seconds: float
    reference: Trace | None = None  # the recorded program, runnable, for ``check="eager"``; None: training
    ranks: tuple[int, ...] = ()  # the ranks that checked they agree on this entry's program
    digest: str = ""  # the digest of what they agreed on
    group_labels: dict[str, str] = field(default_factory=dict)  # process group name -> mesh dim
    python_reads: list = field(default_factory=list)  # the Python values its code could read (``Read``)
    autocast: tuple[str, ...] = ()  # the devices autocast was on for (guarded), off while it runs


class InferenceProgram:
    """The computation, then the epilogue. The prologue's result holds the computation's
    inputs and, after them when the call has any, the objects the epilogue updates."""

    __slots__ = ("computation", "epilogue", "inputs")

    def __init__(self, computation, epilogue: GeneratedFunction, inputs: int | None):
        self.computation = computation
        self.epilogue = epilogue.fn
        self.inputs = inputs  # how many of the prologue's values the computation takes; None: all

    def __call__(self, values: tuple):
        n = self.inputs
        if n is None:
            return self.epilogue(self.computation(*values), ())
        return self.epilogue(self.computation(*values[:n]), values[n:])


@dataclass(frozen=True)
class CallTimes:
    """Where one call's time went, in seconds."""

    guards: float  # the prologues tried: guards and unpacking of the inputs
    computation: float  # the per-rank program
    epilogue: float  # wrapping outputs as DTensors, rebuilding the result, updating input objects


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: list[float] = field(default_factory=list)
    last: CacheEntry | None = None


_ONE_CALL_AT_A_TIME, _CHECKPOINTS_ASIDE = threading.RLock(), OuterCheckpointsAside()


class CompiledFunction:
    """The compiled form of one function or module, with its cache."""

    def __init__(self, fn, *, module: torch.nn.Module | None, cache: str, executors, check: str | None = None):
        if cache not in CACHE_OPTIONS:
            raise ValueError(f"dtcompile.jit: cache must be one of {CACHE_OPTIONS}, not {cache!r}")
        if (check := os.environ.get("DTCOMPILE_CHECK") or None if check is None else check) not in CHECK_OPTIONS:
            raise ValueError(f"dtcompile.jit: check must be one of {CHECK_OPTIONS}, not {check!r}")
        self.check = check
        self.fn = fn
        self.module = module
        self.cache = cache
        self.executor_spec = executors  # as given: a copy of the function is compiled with the same
        self.executors = resolve_executors(executors)  # checks the names now; see executors_for
        self.entries: list[CacheEntry] = []
        self.stats = CompileStats()
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__
        self.symbolic = cache == "symbolic values"
        # Names the compiled code alike on every rank, whatever else each rank jits.
        self.identity = code_identity(fn, module)
        self.calls_checked = calls_checked()  # DTCOMPILE_RANK_CHECK=calls: the ranks agree at every call
        self.failed_trace: BaseException | None = None  # what the last failed compile raised

    def _lookup(self, module, args: tuple, kwargs: dict, failed=()):
        """The entry whose prologue accepts the call, and the prologue's result; or None.
        The entry found goes first in the list: calls come in runs (decode steps). Entries
        in ``failed`` (their check of a branch on data failed for this call) are passed by."""
        entries = self.entries
        for i, entry in enumerate(entries):
            if any(entry is f for f in failed):
                continue
            inputs = entry.prologue.fn(module, args, kwargs)
            if inputs is not None:
                if self.calls_checked:  # before any collective of the entry runs
                    check_hit(self.identity, self.name, entry.ranks, entry.digest)
                self.stats.hits += 1
                if i:
                    entries.insert(0, entries.pop(i))
                return entry, inputs
        return None

    def __call__(self, module, args: tuple, kwargs: dict):
        with _ONE_CALL_AT_A_TIME, _CHECKPOINTS_ASIDE:  # (tracing swaps a module's tensors: one call at a time)
            return self._call(module, args, kwargs)

    def _call(self, module, args: tuple, kwargs: dict):
        if is_tracing() or running_eager():
            # Called by code being traced (a jitted layer inside a jitted model): part of the
            # outer program, so it runs as written, on the outer trace's proxies. (Or by the
            # eager reference of a checked call: eager too.)
            return self.fn(*args, **kwargs)
        if self.check is not None:
            return checked_call(self, module, args, kwargs, lambda: self.fn(*args, **kwargs))
        try:
            return self.run(module, args, kwargs)[2]
        except Exception as error:
            failed, self.failed_trace = self.failed_trace, None
            if error is not failed or not eager_after_failing(error):
                raise
        return run_eagerly(self.name, self.fn, args, kwargs, failed)

    def run(self, module, args: tuple, kwargs: dict) -> tuple[CacheEntry, tuple, object]:
        """Run the call on the entry that accepts it, compiled if none does, passing by
        entries whose check of a branch on data fails; the entry, the prologue's result
        and the call's result."""
        failed: list[CacheEntry] = []  # entries whose check of a branch on data failed
        while (found := self._lookup(module, args, kwargs, failed)) is not None:
            entry, inputs = found
            try:
                return entry, inputs, run_entry(entry, inputs)
            except DataCheckFailed:  # raised before the program did anything
                self.stats.hits -= 1  # the entry did not serve the call after all
                failed.append(entry)
            except RuntimeError as error:  # a collective that timed out: did a peer compile instead?
                explain_stall(self.identity, self.name, entry.ranks, error)
                raise
        entry, inputs = self.entry_for(module, args, kwargs, failed)
        return entry, inputs, run_entry(entry, inputs)

    def entry_for(self, module, args: tuple, kwargs: dict, failed=()) -> tuple[CacheEntry, tuple]:
        """The entry that accepts the call, compiled if none does, and the prologue's result
        (``failed``: entries whose check of a branch on data this call failed)."""
        found = self._lookup(module, args, kwargs, failed)
        if found is not None:
            return found
        entry = self.compile(args, kwargs)
        inputs = entry.prologue.fn(module, args, kwargs)
        if inputs is None:
            raise AssertionError(
                f"dtcompile: the prologue of a fresh entry rejected the call it was compiled for:\n{entry.prologue}"
            )
        return entry, inputs

    def timed_call(self, module, args: tuple, kwargs: dict) -> tuple[object, CallTimes]:
        """A call that hits the cache, timed part by part (see :class:`CallTimes`)."""
        start = time.perf_counter()
        found = self._lookup(module, args, kwargs)
        guarded = time.perf_counter()
        if found is None:
            raise RuntimeError(
                f"dtcompile.timed_call: no compiled entry of {self.name} accepts this call; call it first"
            )
        program, inputs = found[0].run, found[1]
        if not isinstance(program, InferenceProgram):
            raise RuntimeError("dtcompile.timed_call: times calls without gradients only")
        n = program.inputs
        outs = program.computation(*(inputs if n is None else inputs[:n]))
        computed = time.perf_counter()
        result = program.epilogue(outs, () if n is None else inputs[n:])
        done = time.perf_counter()
        return result, CallTimes(guarded - start, computed - guarded, done - computed)

    def compile(self, args: tuple, kwargs: dict) -> CacheEntry:
        agreement = RankAgreement(self.identity, self.name, args, kwargs, self.module, self)
        if self.calls_checked:
            post_miss(self.identity)
        try:
            with _compiling():
                try:
                    return self._compile(args, kwargs, agreement, self.symbolic)
                except GuardsDiffer:  # every rank: its sizes as they are, so that all judge alike
                    agreement = RankAgreement(self.identity, self.name, args, kwargs, self.module, self)
                    return self._compile(args, kwargs, agreement, False)
        except BaseException as error:
            agreement.report_failure(error)  # the ranks compiling with this one raise now
            self.failed_trace = error
            raise

    def _compile(self, args: tuple, kwargs: dict, agreement: RankAgreement, symbolic: bool) -> CacheEntry:
        start = time.perf_counter()
        with ranks_meet_before_live_collectives(agreement.meet):
            captured = capture_call(self.fn, args, kwargs, module=self.module, symbolic=symbolic)
        labels = group_labels(captured.meshes, captured.trace)
        executors = self.executors_for(captured)
        reference = None
        # Sizes are materialized under symbolic values, and wherever a number read from
        # tensor data sizes something (under either cache option).
        sized = symbolic or has_symbolic_sizes(captured.trace)
        with autocast_off(autocast := autocast_devices()):  # (the passes run ops; autocast's casts are traced)
            if captured.backward is None:
                run, epilogue, traces, to_check = self._inference(captured, labels, executors, sized)
                reference = traces[len(pipelines.sizes(sized))]
            else:
                run, epilogue, traces, to_check = self._training(captured, labels, executors, sized)
        entry = CacheEntry(
            prologue=build_prologue(
                captured.inputs,
                captured.grad_enabled,
                captured.global_state,
                list(zip(captured.captured, (p for p in captured.trace.inputs if p.provenance.root == "captured"))),
                self.module,
                unwrap_differentiable=captured.backward is None,
                shape_env=captured.shape_env if symbolic else None,
                objects=captured.objects,
                input_labels=_computation_inputs(captured),
                dtensor_writes=captured.dtensor_writes,
            ),
            run=run,
            epilogue=epilogue,
            traces=traces,
            compile_seconds=time.perf_counter() - start,
            reference=reference,
            group_labels=labels,
            python_reads=captured.python_state.reads,
            autocast=autocast,
        )
        captured.input_fakes.forget()  # (the program built: the real tensors are the caller's again)
        # Last, so that every way this rank can fail comes before the ranks meet.
        guards = list(map(str, shape_guards(captured.shape_env))) if symbolic else []
        entry.ranks, entry.digest = agreement.check(to_check, captured.meshes, labels, guards)
        self.stats.misses += 1
        self.stats.compile_seconds.append(entry.compile_seconds)
        self.stats.last = entry
        if self.cache != "no caching":
            self.entries.append(entry)
            if len(self.entries) == ENTRIES_WARNING:
                warnings.warn(self._many_entries(args, kwargs), stacklevel=3)
        return entry

    def _many_entries(self, args: tuple, kwargs: dict) -> str:
        """Why a function keeps compiling: the Python values its first entry read that changed
        since (a list the module holds, growing), or the first of its guards this call fails."""
        changed = [read.where for read in self.entries[0].python_reads if not read.unchanged()]
        refused = None if changed else self.entries[0].prologue.first_refusal(self.module, args, kwargs)
        cause = (
            f"Python values its code can read keep changing ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}): keep state that changes at every call off the module and "
            "out of the globals its code reads"
            if changed
            else f"this call fails its first entry's guard `{refused or 'on its inputs'}` (new sizes? try "
            'cache="symbolic values"; a number that changes at every call, an input object\'s counter, is guarded)'
        )
        return f"dtcompile: {self.name} has compiled {ENTRIES_WARNING} entries: {cause}; each call tries every entry's guards"

    def executors_for(self, captured: CapturedCall) -> list:
        """The executors given to ``jit``; by default, those for the devices of the call
        (nvFuser when a tensor is on CUDA and nvFuser can run)."""
        if self.executor_spec is not None:
            return self.executors
        devices = {p.device for p in captured.trace.inputs if isinstance(p, TensorProxy)}
        return resolve_executors(None, devices)

    def _lowered(self, trace: Trace, labels: dict[str, str], executors) -> Trace:
        execution = lower(trace, executors)
        verify(execution)  # names defined once, before use, in what runs too
        execution.header_notes += [
            f"process group {name!r}: mesh dim {label}, ranks {dist.get_process_group_ranks(resolve_process_group(name))}"
            for name, label in labels.items()
        ]
        return execution

    def _blocks(self, trace: Trace, labels, executors, passes: tuple) -> list[Trace]:
        """Each block program ``trace`` calls, passed, lowered and compiled once, before
        the trace that calls it is lowered (``core/block_call.py``); their traces."""
        traces = []
        for block in block_programs(trace):
            passed = pipelines.run_passes(block.trace, passes)
            block.checked = pipelines.before_finish(passed)
            execution = self._lowered(passed[-1], labels, executors)
            execution.steals_inputs = block.steals
            execution.title = f"block program {block.name}, {execution.title}"
            block.function = execution.compile()
            block.traces = passed + [execution]
            traces += block.traces
        return traces

    def _inference(self, captured: CapturedCall, labels, executors, sized: bool):
        traces = pipelines.run_passes(captured.trace, pipelines.inference_passes(sized))
        blocks = self._blocks(traces[-1], labels, executors, pipelines.inference_passes(sized))
        execution = self._lowered(traces[-1], labels, executors)
        epilogue = build_epilogue(captured.output, updates=captured.updates, module_updates=captured.module_updates)
        inputs = len(captured.trace.inputs) if captured.objects else None
        program = InferenceProgram(execution.compile(), epilogue, inputs)
        return program, epilogue, traces + blocks + [execution], [pipelines.before_finish(traces)]

    def _training(self, captured: CapturedCall, labels, executors, sized: bool):
        backward = captured.backward
        slots = _slot_count(captured)
        joint_traces = pipelines.run_passes(captured.trace, pipelines.JOINT)
        split = split_forward_backward(joint_traces[-1], backward.cotangents, slots, backward.recompute_from)
        forward_traces = pipelines.run_passes(split.forward, pipelines.half_passes(sized))
        backward_traces = pipelines.run_passes(split.backward, pipelines.half_passes(sized))
        block_passes = pipelines.block_training_passes(sized)
        forward_blocks = self._blocks(forward_traces[-1], labels, executors, block_passes)
        forward_execution = self._lowered(forward_traces[-1], labels, executors)
        forward_execution.header_notes.append(saved_note(forward_traces[-1], slots))
        backward_blocks = self._blocks(backward_traces[-1], labels, executors, block_passes)
        backward_execution = self._lowered(backward_traces[-1], labels, executors)
        backward_execution.steals_inputs = True  # saved values freed as the backward goes (training.py)
        # A gradient autograd computed none for comes as Zeros, made where first read.
        backward_execution.deferred_inputs = frozenset(c.label for c in backward.cotangents)
        inputs = captured.trace.inputs[: len(captured.trace.inputs) - len(backward.cotangents)]
        program = TrainingProgram.make(
            forward_execution.compile(),
            backward_execution,
            captured.output,
            inputs,
            backward,
            slots,
            captured.trace,
        )
        program.backward_reads = backward_reads(captured, backward, self.module)
        traces = [*joint_traces, *forward_traces, *forward_blocks, forward_execution]
        traces += [*backward_traces, *backward_blocks, backward_execution]
        to_check = [pipelines.before_finish(forward_traces), pipelines.before_finish(backward_traces)]
        return program, program.rebuild, traces, to_check


@contextmanager
def _compiling():
    """While compiling: Python's cyclic garbage collector off (tracing's objects set off full
    collections: a quarter of a decode step's compile time); the user's dispatch modes aside
    (they see the program run); torch.compile'd code run as written, and so traced."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with dispatch_modes_off(), torch.compiler.set_stance("force_eager"):
            yield
    finally:
        if collecting:
            gc.enable()


def _computation_inputs(captured: CapturedCall) -> list[str]:
    """The labels the computation takes from the prologue, in order (not a training trace's cotangents)."""
    labels = [p.label for p in captured.trace.inputs]
    if captured.backward is not None:
        labels = labels[: len(labels) - len(captured.backward.cotangents)]
    return labels


def _slot_count(captured: CapturedCall) -> int:
    """How many local outputs the forward returns before its saved values."""
    return len(captured.trace.output) - sum(1 for g in captured.backward.grads if g is not None)
