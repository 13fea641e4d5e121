"""What a pass may and may not do with a bound symbol."""

from __future__ import annotations

import torch

from ..core import BoundSymbol


def mutates(bsym: BoundSymbol) -> bool:
    """True for in-place and ``out=`` ops: they change a tensor other symbols may read."""
    return bsym.op is not None and bsym.op._schema.is_mutable


def is_random(bsym: BoundSymbol) -> bool:
    """True for ops that draw from a generator: dropping or merging them changes the stream."""
    return bsym.op is not None and torch.Tag.nondeterministic_seeded in bsym.op.tags


def has_side_effects(bsym: BoundSymbol) -> bool:
    if bsym.op is None:
        return not bsym.symbol.pure  # a symbol of our own (prims) says whether it is pure
    return mutates(bsym) or is_random(bsym)


def returns_alias(bsym: BoundSymbol) -> bool:
    """True when an output may share memory with an input (views, in-place results)."""
    if bsym.op is None:
        return True
    return any(ret.alias_info is not None for ret in bsym.op._schema.returns)


def storage_bases(trace) -> dict[str, str]:
    """For each value of ``trace``, the value whose memory it shares: itself for a trace
    input or a fresh result, its first tensor argument's base for a view or an in-place
    result."""
    base = {p.label: p.label for p in trace.inputs}
    for bsym in trace.bound_symbols:
        inputs = bsym.input_tensors()
        aliasing = bool(inputs) and (returns_alias(bsym) or mutates(bsym))
        for out in bsym.output_tensors():
            base[out.label] = base.get(inputs[0].label, inputs[0].label) if aliasing else out.label
    return base
