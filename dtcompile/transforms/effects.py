"""What a pass may and may not do with a bound symbol."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..core import BoundSymbol, TensorProxy


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
    """For each tensor of ``trace``, the first tensor that shares its memory (itself for a
    fresh buffer). Read from the FakeTensors, which share storage exactly where eager's
    tensors would: views, in-place results and ops without alias annotations
    (``_unsafe_view``) included."""
    first: dict[StorageWeakRef, str] = {}
    base: dict[str, str] = {}
    tensors = [p for p in trace.inputs if isinstance(p, TensorProxy)]
    tensors += [p for bsym in trace.bound_symbols for p in bsym.output_tensors()]
    for proxy in tensors:
        key = StorageWeakRef(proxy.fake.untyped_storage())
        base[proxy.label] = first.setdefault(key, proxy.label)
    return base
