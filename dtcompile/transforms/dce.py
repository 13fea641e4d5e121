"""Dead-code elimination: drop symbols whose outputs nobody uses."""

from __future__ import annotations

from torch.utils._pytree import tree_flatten

from ..core import TensorProxy, Trace
from .effects import has_side_effects


def dce(trace: Trace) -> Trace:
    """Keep a symbol when it has side effects or a kept symbol (or the output) reads it."""
    leaves, _ = tree_flatten(trace.output)
    live = {x.label for x in leaves if isinstance(x, TensorProxy)}
    kept = []
    for bsym in reversed(trace.bound_symbols):
        if has_side_effects(bsym) or any(p.label in live for p in bsym.output_proxies()):
            kept.append(bsym)
            live.update(p.label for p in bsym.input_proxies())
    kept.reverse()
    return trace.derive(f"{trace.fn_name}, after dead-code elimination", kept)
