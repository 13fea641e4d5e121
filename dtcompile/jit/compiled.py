"""A compiled function: its cache of entries, the compilation pipeline and its stats.

Per call: run the prologue of each entry until one accepts the call (a hit), then the
entry's computation and epilogue. No entry accepts: trace, run the passes, lower onto
the executors, check that the ranks agree, and add the entry (a miss).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..capture import capture_call
from ..core import Trace, verify
from ..core.codegen import GeneratedFunction
from ..executors import lower, resolve_executors
from ..transforms import cse, dce, remove_identity_views
from .consistency import check_ranks_agree
from .epilogue import build_epilogue
from .prologue import build_prologue

CACHE_OPTIONS = ("constant values", "no caching", "symbolic values")


@dataclass
class CacheEntry:
    prologue: GeneratedFunction
    computation: object  # the compiled execution trace
    epilogue: GeneratedFunction
    traces: list[Trace]
    compile_seconds: float


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
        if cache == "symbolic values":
            raise NotImplementedError(
                'dtcompile.jit: cache="symbolic values" is not implemented yet; use "constant values" '
                '(one compilation per input shape) or "no caching"'
            )
        self.fn = fn
        self.module = module
        self.cache = cache
        self.executors = resolve_executors(executors)
        self.entries: list[CacheEntry] = []
        self.stats = CompileStats()
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__

    def __call__(self, module, args: tuple, kwargs: dict):
        for entry in self.entries:
            inputs = entry.prologue.fn(module, args, kwargs)
            if inputs is not None:
                self.stats.hits += 1
                return entry.epilogue.fn(entry.computation(*inputs))
        entry = self.compile(args, kwargs)
        inputs = entry.prologue.fn(module, args, kwargs)
        if inputs is None:
            raise AssertionError(
                f"dtcompile: the prologue of a fresh entry rejected the call it was compiled for:\n{entry.prologue}"
            )
        return entry.epilogue.fn(entry.computation(*inputs))

    def compile(self, args: tuple, kwargs: dict) -> CacheEntry:
        start = time.perf_counter()
        captured = capture_call(self.fn, args, kwargs, module=self.module)
        traces = [captured.trace]
        for transform in (remove_identity_views, cse, dce):
            traces.append(transform(traces[-1]))
            verify(traces[-1])
        labels = group_labels(captured.meshes)
        check_ranks_agree(traces[-1], captured.meshes, labels, self.name)
        execution = lower(traces[-1], self.executors)
        execution.header_notes += [
            f"process group {name!r}: mesh dim {label}, ranks {dist.get_process_group_ranks(_resolve_process_group(name))}"
            for name, label in labels.items()
        ]
        traces.append(execution)
        entry = CacheEntry(
            prologue=build_prologue(captured.inputs, captured.grad_enabled, captured.captured, self.module),
            computation=execution.compile(),
            epilogue=build_epilogue(captured.output),
            traces=traces,
            compile_seconds=time.perf_counter() - start,
        )
        self.stats.misses += 1
        self.stats.compile_seconds.append(entry.compile_seconds)
        self.stats.last = entry
        if self.cache != "no caching":
            self.entries.append(entry)
        return entry
