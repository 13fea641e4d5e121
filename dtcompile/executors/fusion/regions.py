"""Partitioning a per-rank trace into fusion regions.

A region is a run of symbols that the fusion executor can run, taken in trace order.
A symbol the fusion cannot take does not always end the region:

- a pure op that reads nothing the region makes (a matmul on other values, a size
  computation, a view of a value from before) moves before the region;
- a view of a value the region makes that the fusion cannot take (a ``view`` with a
  symbolic ``-1``) moves after it, unless an op of the region reads it.

Anything else ends the region: a collective, an in-place or random op, an op another
executor claims first, an op that reads what the region makes. So regions grow past the
matmuls of a layer and gather its elementwise work around them.

A region returns the values that symbols after it (or the trace's output) read. A view
among those is not returned from the fusion, whose outputs are fresh memory: the view
runs after the fusion, on the fusion's output (or input) it views, so the memory sharing
eager has between a view and its base is kept. Views that only the symbols after the
fusion read leave the region altogether.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch.utils._pytree import tree_flatten

from ...core import BoundSymbol, TensorProxy, Trace
from ...core.op_classes import makes_view
from ...core.prims import ShapeQuery, SizeExpression
from ...transforms.effects import has_side_effects
from .translate import VIEWS


@dataclass
class Region:
    symbols: list[BoundSymbol]  # the fused ops, in trace order
    outputs: list[TensorProxy] = field(default_factory=list)  # what the fusion returns
    views_after: list[BoundSymbol] = field(default_factory=list)  # views run again after the fusion
    unfused: list[BoundSymbol] = field(default_factory=list)  # the run as the trace had it

    @property
    def compute_ops(self) -> int:
        return sum(1 for b in self.symbols if b.op not in VIEWS)


def _movable(bsym: BoundSymbol) -> bool:
    """A symbol whose place among pure ops does not matter: no effects, no collective."""
    if isinstance(bsym.symbol, (ShapeQuery, SizeExpression)):
        return True
    return bsym.op is not None and bsym.op.namespace == "aten" and not has_side_effects(bsym)


def partition(trace: Trace, fusible: Callable[[BoundSymbol], bool]) -> list[BoundSymbol | Region]:
    """The trace's symbols in order, with each run of fusible symbols as a :class:`Region`."""
    last_reader: dict[str, int] = {}
    for index, bsym in enumerate(trace.bound_symbols):
        for proxy in bsym.input_proxies():
            last_reader[proxy.label] = index
    never = len(trace.bound_symbols)
    for leaf in tree_flatten(trace.output)[0]:
        if isinstance(leaf, TensorProxy):
            last_reader[leaf.label] = never

    items: list[BoundSymbol | Region] = []
    current: list[BoundSymbol] = []
    before: list[BoundSymbol] = []  # symbols that move before the current region
    after: list[BoundSymbol] = []  # views that move after it
    made: set[str] = set()  # labels the current region defines
    later: set[str] = set()  # labels the views moved after it define
    end = -1  # index of the current region's last symbol

    def close() -> None:
        items.extend(before)
        if current:
            read_after = {p.label for bsym in after for p in bsym.input_proxies()}
            items.append(_region(list(current), last_reader, end, read_after))
        items.extend(after)
        for pending in (before, after, current, made, later):
            pending.clear()

    for index, bsym in enumerate(trace.bound_symbols):
        reads = {p.label for p in bsym.input_proxies()}
        if reads & later:
            close()
        outside = not reads & made
        if fusible(bsym) and not (bsym.op in VIEWS and outside):
            current.append(bsym)
            made.update(p.label for p in bsym.output_proxies())
            end = index
        elif current and outside and _movable(bsym):
            before.append(bsym)
        elif current and makes_view(bsym.op):
            after.append(bsym)
            later.update(p.label for p in bsym.output_proxies())
        else:
            close()
            items.append(bsym)
    close()
    return items


def _region(symbols: list[BoundSymbol], last_reader: dict[str, int], end: int, read_after: set[str]) -> Region:
    made = {p.label: bsym for bsym in symbols for p in bsym.output_tensors()}
    needed = {label for label in made if last_reader.get(label, -1) > end or label in read_after}
    views_after: list[BoundSymbol] = []
    for bsym in reversed(symbols):
        if bsym.op in VIEWS and bsym.output.label in needed:
            views_after.insert(0, bsym)
            needed.discard(bsym.output.label)
            source = bsym.args[0]
            if source.label in made:
                needed.add(source.label)
    # Views that no op of the region reads run only after it.
    kept: list[BoundSymbol] = []
    read_inside: set[str] = set()
    for bsym in reversed(symbols):
        if bsym.op in VIEWS and not any(p.label in read_inside for p in bsym.output_proxies()):
            continue
        kept.insert(0, bsym)
        read_inside.update(p.label for p in bsym.input_proxies())
    outputs = [p for bsym in kept for p in bsym.output_tensors() if p.label in needed]
    return Region(kept, outputs, views_after, symbols)
