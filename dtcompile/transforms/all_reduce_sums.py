"""Fewer collectives: all-reduces whose results are only summed become one all-reduce.

DTensor reduces each partial value on its own. A tensor-parallel block's backward shows
why that costs: the input gradients of q, k and v are each all-reduced (one per
``from_local`` of the column-parallel inputs), then added. A sum commutes with an
all-reduce(sum), so ``all_reduce(a) + all_reduce(b)`` is ``all_reduce(a + b)``: one
collective instead of two, which is what hand-written Megatron code does. The results
agree to float rounding (the additions happen in another order), not bit for bit, and
where the partial values cancel (``1e8 + 1`` on one rank, ``-1e8`` on the other) not at
all: so it runs only where asked for (:data:`ENABLED`, ``DTCOMPILE_COMBINE_ALL_REDUCES=1``);
by default each value is reduced as eager reduces it.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from ..core import BoundSymbol, NoProvenance, Note, TensorProxy, Trace, aten_symbol, is_proxy
from ..core.symbolic import known_shape_equal
from .effects import mutates

# Every rank must agree (each compares its program with the others'): set it on all of them.
ENABLED = os.environ.get("DTCOMPILE_COMBINE_ALL_REDUCES", "") == "1"

functional = torch.ops._c10d_functional
aten = torch.ops.aten


@dataclass
class _Reduced:
    """A value made by ``wait_tensor(all_reduce(partial, "sum", group))``."""

    partial: TensorProxy
    group: str
    start: BoundSymbol  # the all_reduce
    wait: BoundSymbol


def _reduced_values(trace: Trace, uses: Counter) -> dict[str, _Reduced]:
    started: dict[str, BoundSymbol] = {}
    reduced: dict[str, _Reduced] = {}
    for bsym in trace.bound_symbols:
        if bsym.op is functional.all_reduce.default and bsym.args[1] == "sum" and isinstance(bsym.args[0], TensorProxy):
            started[bsym.output.label] = bsym
        elif bsym.op is functional.wait_tensor.default:
            start = started.get(bsym.args[0].label)
            if start is not None and uses[start.output.label] == 1:
                reduced[bsym.output.label] = _Reduced(start.args[0], start.args[2], start, bsym)
    return reduced


def _is_plain_sum(bsym: BoundSymbol, reduced: dict[str, _Reduced], uses: Counter) -> bool:
    if bsym.op is not aten.add.Tensor or bsym.kwargs.get("alpha", 1) != 1 or len(bsym.args) != 2:
        return False
    left, right = bsym.args
    if not all(isinstance(x, TensorProxy) and x.label in reduced and uses[x.label] == 1 for x in (left, right)):
        return False
    shapes = known_shape_equal(left.shape, right.shape) and known_shape_equal(left.shape, bsym.output.shape)
    same = shapes and left.dtype == right.dtype == bsym.output.dtype
    return same and reduced[left.label].group == reduced[right.label].group


def combine_all_reduces(trace: Trace) -> Trace:
    """Replace ``add(wait(all_reduce(a)), wait(all_reduce(b)))`` by
    ``wait(all_reduce(add(a, b)))`` where nothing else reads the two reduced values,
    repeatedly, so a chain of sums needs a single all-reduce (where :data:`ENABLED`)."""
    if not ENABLED:
        return trace.derive(f"{trace.fn_name}, summed all-reduces (not combined: eager's sums)", trace.bound_symbols)
    if any(mutates(b) for b in trace.bound_symbols):
        # A partial value changed between its all-reduce and the sum: not the same sum.
        return trace.derive(
            f"{trace.fn_name}, summed all-reduces (skipped: the trace mutates tensors)", trace.bound_symbols
        )
    uses = Counter(p.label for b in trace.bound_symbols for p in b.input_proxies())
    uses.update(p.label for p in tree_flatten(trace.output)[0] if is_proxy(p))  # a returned value is a use
    reduced = _reduced_values(trace, uses)
    fresh = itertools.count()
    dropped: set[int] = set()
    replaced: dict[int, list[BoundSymbol]] = {}
    for bsym in trace.bound_symbols:
        if not _is_plain_sum(bsym, reduced, uses):
            continue
        left, right = (reduced.pop(x.label) for x in bsym.args)
        dropped.update(id(b) for b in (left.start, left.wait, right.start, right.wait))
        out = bsym.output
        made_by = NoProvenance("combine_all_reduces")
        with out.fake.fake_mode:  # fresh buffers of their own, as the ops make
            partial_fake, started_fake = torch.empty_like(out.fake), torch.empty_like(out.fake)
        partial = TensorProxy(partial_fake, f"{out.label}_partial{next(fresh)}", made_by)
        started = TensorProxy(started_fake, f"{out.label}_reducing{next(fresh)}", made_by)
        note = Note(
            f"sum of all-reduces, reduced once: {bsym.note}" if bsym.note else "sum of all-reduces, reduced once"
        )
        add = BoundSymbol(
            aten_symbol(aten.add.Tensor), (left.partial, right.partial), {}, partial, note, aten.add.Tensor
        )
        start = BoundSymbol(
            aten_symbol(functional.all_reduce.default),
            (partial, "sum", left.group),
            {},
            started,
            note,
            functional.all_reduce.default,
        )
        wait = BoundSymbol(
            aten_symbol(functional.wait_tensor.default), (started,), {}, out, note, functional.wait_tensor.default
        )
        replaced[id(bsym)] = [add, start, wait]
        reduced[out.label] = _Reduced(partial, left.group, start, wait)
    kept = []
    for bsym in trace.bound_symbols:
        if id(bsym) in dropped:
            continue
        kept.extend(replaced.get(id(bsym), [bsym]))
    # A combined sum can itself be summed again: drop the replaced symbols a later
    # combination made redundant.
    kept = [b for b in kept if id(b) not in dropped]
    return trace.derive(f"{trace.fn_name}, after combining summed all-reduces", kept)
