"""The executor interface and the lowering of a trace onto an ordered list of executors.

Each bound symbol goes to the first executor that claims it; the executor returns the
bound symbols that run it (usually one, with a faster or more specific symbol). A symbol
no executor claims runs through its OpOverload, as recorded. The lowered trace prints as
the Python that runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.utils._pytree import tree_flatten

from ..core import BoundSymbol, TensorProxy, Trace
from ..core.block_call import BlockCall
from ..transforms import storage_bases


class NoExecutorError(RuntimeError):
    """No executor in the list claims a symbol."""


@dataclass
class LoweringContext:
    """Facts about the whole trace that any executor may need to lower one symbol (what
    concerns one executor's symbols only belongs in the trace, made in its ``partition``)."""

    trace: Trace
    last_use: dict[str, int] = field(default_factory=dict)  # label -> index of its last reader
    base: dict[str, str] = field(default_factory=dict)  # label -> the label whose memory it views
    fresh_bases: set[str] = field(default_factory=set)  # bases made inside the trace

    def __post_init__(self):
        never = len(self.trace.bound_symbols)
        leaves, _ = tree_flatten(self.trace.output)
        self.base = storage_bases(self.trace)
        inputs = {p.label for p in self.trace.inputs}
        self.fresh_bases = {label for label, base in self.base.items() if label == base and label not in inputs}
        for index, bsym in enumerate(self.trace.bound_symbols):
            for proxy in bsym.input_proxies():
                self.last_use[proxy.label] = index
        for leaf in leaves:
            if isinstance(leaf, TensorProxy):
                self.last_use[leaf.label] = never

    def dead_after(self, proxy: TensorProxy, index: int) -> bool:
        """True when ``proxy``'s memory is made in the trace and nothing reads it, or any
        view of it, after symbol ``index``: its buffer may be reused in place."""
        base = self.base.get(proxy.label)
        if base not in self.fresh_bases:
            return False
        return all(self.last_use.get(label, -1) <= index for label, b in self.base.items() if b == base)


class Executor:
    """What an executor does: claim symbols and lower each one it claims; and, before
    that, replace regions of the trace by symbols of its own (``partition``: a fusion's
    ops by one call, a collective and its wait by a start and a wait on its work handle;
    by default none, executors that run one op at a time leave the trace as it is)."""

    name: str

    def partition(self, trace: Trace, earlier: list[Executor]) -> Trace:
        """The trace with the regions this executor runs replaced, leaving alone what an
        executor in ``earlier`` claims."""
        return trace

    def claims(self, bsym: BoundSymbol) -> bool:
        raise NotImplementedError

    def lower(self, bsym: BoundSymbol, index: int, context: LoweringContext) -> list[BoundSymbol]:
        raise NotImplementedError


def lower(trace: Trace, executors: list[Executor]) -> Trace:
    """The execution trace: every symbol replaced by what its executor runs.

    Executors that run regions of the trace (fusions, collectives and their waits) first
    replace each region with symbols of their own (``partition``), leaving alone what an
    executor before them in the list claims; the symbols are then lowered one by one."""
    for position, executor in enumerate(executors):
        trace = executor.partition(trace, executors[:position])
    context = LoweringContext(trace)
    lowered: list[BoundSymbol] = []
    for index, bsym in enumerate(trace.bound_symbols):
        if isinstance(bsym.symbol, BlockCall):
            lowered.append(bsym)  # runs the block's program, lowered on its own (jit/compiled.py)
            continue
        for executor in executors:
            if executor.claims(bsym):
                lowered.extend(executor.lower(bsym, index, context))
                break
        else:
            if bsym.op is None:
                raise NoExecutorError(
                    f"no executor in {[e.name for e in executors]} can run {bsym.symbol.name} ({bsym.note})"
                )
            lowered.append(bsym)  # runs through its OpOverload, exactly as recorded
    names = ", ".join(e.name for e in executors)
    execution = trace.derive(f"execution trace (what runs), executors: {names}", lowered)
    execution.frees_values = True  # each value freed after its last use, as eager frees it
    return execution
