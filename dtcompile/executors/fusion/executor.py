"""The fusion executor: regions of a per-rank trace run as fusions.

Before the symbols are lowered one by one, :meth:`FusionExecutor.partition` replaces
each region (``regions.py``) with one call of a fused program, translated from the
region's aten ops (``translate.py``) and compiled by a backend: ``nvfuser_direct`` on
CUDA, or ``reference`` (the same program op by op with torch, for testing anywhere).
Compiled fusions are kept in one cache for the process, keyed by the backend and the
program's text, which names the inputs' dtype, rank, broadcast dims, contiguity and
stride order: identical layers share a fusion, and nvFuser compiles each once.

Outputs have the traced strides: the backend is asked for each output's layout, and a
result that comes back otherwise is copied into it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ...core import BoundSymbol, Symbol, Trace
from ...core.printing import output_target
from ..base import Executor
from . import nvfuser_direct, reference
from .layout import dense_order, in_layout
from .program import FusionProgram, program_to_data
from .regions import Region, partition
from .translate import MATMUL_OPS, VIEWS, translatable, translate


class FusionBackend(Protocol):
    """What the executor needs of a backend (each backend is a module of this package)."""

    name: str

    def available(self) -> tuple[bool, str]: ...  # whether it can run here, and why (not)

    def supports_device(self, device) -> bool: ...

    def compile(self, program: FusionProgram) -> Callable[[tuple], list]: ...  # inputs -> outputs


BACKENDS: dict[str, FusionBackend] = {backend.name: backend for backend in (nvfuser_direct, reference)}


class FusionCache:
    """Compiled fusions by (backend, program text), shared by every compiled function."""

    def __init__(self):
        self.fusions: dict[tuple[str, str], object] = {}
        self.hits = 0
        self.misses = 0

    def get(self, backend, program: FusionProgram):
        key = (backend.name, program.text())
        fusion = self.fusions.get(key)
        if fusion is None:
            self.misses += 1
            _record(program)
            fusion = self.fusions[key] = backend.compile(program)
        else:
            self.hits += 1
        return fusion

    def __len__(self) -> int:
        return len(self.fusions)

    def clear(self) -> None:
        self.fusions.clear()
        self.hits = self.misses = 0


CACHE = FusionCache()
# A folder where each process appends every program it compiles, as JSON lines: how
# scripts/nvfuser_check.sh collects the programs the executor forms, to build them with
# nvFuser's own frontend in another Python environment.
RECORD_ENV = "DTCOMPILE_FUSION_RECORD"


def _record(program: FusionProgram) -> None:
    folder = os.environ.get(RECORD_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as file:
            file.write(json.dumps(program_to_data(program)) + "\n")


class FusedCall:
    """Runs one compiled fusion and gives each output the traced layout."""

    __slots__ = ("fusion", "orders", "program")

    def __init__(self, fusion, program: FusionProgram):
        self.fusion = fusion
        self.program = program
        self.orders = [o.order for o in program.outputs]

    def __call__(self, *inputs):
        results = self.fusion(inputs)
        return tuple(in_layout(r, order) for r, order in zip(results, self.orders))

    def __repr__(self) -> str:
        return f"<fusion of {len(self.program.ops)} primitives>"


@dataclass(frozen=True)
class FusionRegion(Symbol):
    """``(t7, t9) = fusion2(t1, t3)``: a region run as one fusion; prints the trace's ops
    it holds as comments above the call."""

    backend: str = ""
    contents: tuple[str, ...] = ()

    def lines(self, bsym: BoundSymbol) -> list[str]:
        inputs = ", ".join(p.label for p in bsym.args)
        header = f"# {self.name}: {self.backend} fusion of {len(self.contents)} ops"
        return [
            header,
            *(f"#   {line}" for line in self.contents),
            f"{output_target(bsym.output)} = {self.name}({inputs})",
        ]


class FusionExecutor(Executor):
    """Runs regions of the trace as fusions; claims nothing else.

    ``backend``: ``"nvfuser_direct"`` or ``"reference"``. ``fuse_matmul``: put mm/bmm/
    addmm into regions too (off by default: cuBLAS through the torch executor is the
    safe choice until nvFuser's matmul scheduling is measured on the target GPU).
    ``min_ops``: regions with fewer ops that compute (views aside) are left unfused; one
    op gains nothing from a fusion.
    """

    def __init__(self, backend: str = "nvfuser_direct", *, fuse_matmul: bool = False, min_ops: int = 2):
        if backend not in BACKENDS:
            raise ValueError(f"dtcompile: unknown fusion backend {backend!r}; available: {sorted(BACKENDS)}")
        self.backend = BACKENDS[backend]
        self.name = "nvfuser" if backend == "nvfuser_direct" else f"nvfuser:{backend}"
        self.fuse_matmul = fuse_matmul
        self.min_ops = min_ops
        self.available, self.reason = self.backend.available()

    def claims(self, bsym: BoundSymbol) -> bool:
        return isinstance(bsym.symbol, FusionRegion)

    def lower(self, bsym: BoundSymbol, index: int, context) -> list[BoundSymbol]:
        return [bsym]

    def fusible(self, bsym: BoundSymbol, earlier) -> bool:
        if bsym.op is None or not translatable(bsym):
            return False
        if bsym.op in MATMUL_OPS and not self.fuse_matmul:
            return False
        tensors = bsym.input_tensors() + bsym.output_tensors()
        if not all(self.backend.supports_device(t.device) for t in tensors):
            return False
        if any(t.is_conj() or t.is_neg() for t in tensors):
            return False  # a fusion reads and writes memory as it is, not through these bits
        if bsym.op not in VIEWS and any(dense_order(t.shape, t.stride()) is None for t in bsym.output_tensors()):
            return False  # a fusion writes dense outputs only
        return not any(executor.claims(bsym) for executor in earlier)

    def partition(self, trace: Trace, earlier) -> Trace:
        """``trace`` with each region replaced by a fusion call (and the views after it)."""
        if not self.available:
            notes = [f"executor {self.name} unavailable: {self.reason}; its ops run on the next executors"]
            fused = trace.derive(trace.title, list(trace.bound_symbols))
            fused.header_notes += notes
            return fused
        symbols: list[BoundSymbol] = []
        count = fused_ops = 0
        failures: list[str] = []
        proxies = {p.label: p for p in trace.inputs}
        proxies.update((p.label, p) for bsym in trace.bound_symbols for p in bsym.output_proxies())
        for item in partition(trace, lambda b: self.fusible(b, earlier)):
            if not isinstance(item, Region):
                symbols.append(item)
            elif item.compute_ops < self.min_ops or not item.outputs:
                symbols.extend(item.unfused)
            else:
                try:
                    call = self._fusion_call(item, f"fusion{count}", proxies)
                except Exception as error:  # the backend could not build it: torch runs the region
                    failures.append(
                        f"a region of {len(item.symbols)} ops was left unfused: {self.backend.name} could not "
                        f"build it ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
                    )
                    symbols.extend(item.unfused)
                    continue
                symbols.append(call)
                symbols.extend(item.views_after)
                count += 1
                fused_ops += len(item.symbols)
        fused = trace.derive(trace.title, symbols)
        fusions = "1 fusion" if count == 1 else f"{count} fusions"
        fused.header_notes.append(f"{self.name} ({self.backend.name} backend): {fusions} of {fused_ops} ops")
        fused.header_notes += failures
        return fused

    def _fusion_call(self, region: Region, name: str, proxies: dict) -> BoundSymbol:
        program, input_labels = translate(region.symbols, region.outputs)
        fusion = FusedCall(CACHE.get(self.backend, program), program)
        contents = tuple(line for bsym in region.symbols for line in bsym.lines())
        symbol = FusionRegion(name, globals=((name, fusion, None),), backend=self.backend.name, contents=contents)
        return BoundSymbol(symbol, tuple(proxies[label] for label in input_labels), {}, tuple(region.outputs))
