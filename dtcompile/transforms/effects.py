"""What a pass may and may not do with a bound symbol."""

from __future__ import annotations

import torch

from ..core import BoundSymbol, TensorProxy
from ..core.op_classes import mutates


def is_random(bsym: BoundSymbol) -> bool:
    """True for ops that draw from a generator: dropping or merging them changes the stream."""
    return bsym.op is not None and torch.Tag.nondeterministic_seeded in bsym.op.tags


def has_side_effects(bsym: BoundSymbol) -> bool:
    if bsym.op is None:
        return not bsym.symbol.pure  # a symbol of our own (prims) says whether it is pure
    # An op that returns nothing is there for what it checks (``_linalg_check_errors``: eager's
    # LinAlgError for a matrix that is not positive-definite; ``_assert_async``).
    return mutates(bsym) or is_random(bsym) or not bsym.op._schema.returns


def storage_bases(trace, inputs_may_alias: bool = False) -> dict[str, str]:
    """For each tensor of ``trace``, the first tensor that shares its memory (itself for a
    fresh buffer). Read from the FakeTensors, which share storage exactly where eager's
    tensors would: views, in-place results and ops without alias annotations
    (``_unsafe_view``) included.

    With ``inputs_may_alias``, every input's memory is one class: what the call passes in
    may share memory in ways the trace did not see (``f(z, z)``, two views of one tensor,
    DTensors around one local tensor), so a pass that reasons about writes treats a write to
    one input as a write to all of them. The traced program runs its ops in eager's order,
    so with passes that do this, it computes eager's values whatever the inputs share."""
    first: dict[object, str] = {}  # memory (``TensorProxy.memory``) -> first tensor in it
    base: dict[str, str] = {}
    inputs = [p for p in trace.inputs if isinstance(p, TensorProxy)]
    tensors = inputs + [p for bsym in trace.bound_symbols for p in bsym.output_tensors()]
    for proxy in tensors:
        base[proxy.label] = first.setdefault(proxy.memory, proxy.label)
    if inputs_may_alias and inputs:
        shared = {base[p.label] for p in inputs}
        merged = base[inputs[0].label]
        base = {label: merged if b in shared else b for label, b in base.items()}
    return base
