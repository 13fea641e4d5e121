"""Dead-code elimination: drop symbols whose outputs nobody uses.

Sizes follow one more rule, first producer wins: a symbol that produces a number the
trace already has (the same symbolic value, read from another tensor or computed
another way) is dropped and its uses read the first producer's number. Sizes are
materialized at every use (``sizes.py``); this leaves one producer per value, the
earliest, and removes duplicate shape queries.
"""

from __future__ import annotations

from ..core import FromData, Trace, is_proxy, renamed
from ..core.op_classes import is_communication
from ..core.proxy import NumberProxy
from ..core.symbol import leaves
from ..core.symbolic import is_symbolic, symbolic_expr
from .effects import has_side_effects


def _first_producers(trace: Trace) -> tuple[list, object]:
    """The trace's symbols without later producers of numbers already produced, and its
    output, renamed to the first producers."""
    first: dict[object, NumberProxy] = {}
    renames: dict[str, NumberProxy] = {}
    kept = []
    for bsym in trace.bound_symbols:
        bsym = bsym.with_inputs_renamed(renames) if renames else bsym
        output = bsym.output
        if isinstance(output, NumberProxy) and not has_side_effects(bsym):
            earlier = first.get(output.expr)
            if earlier is not None:
                renames[output.label] = earlier
                continue
            first[output.expr] = output
        kept.append(bsym)

    return kept, renamed(trace.output, renames)


def _symbols_used(values) -> set:
    """The size symbols in the symbolic numbers among ``values`` (not yet materialized)."""
    return {s for x in leaves(values) if is_symbolic(x) for s in symbolic_expr(x).free_symbols}


def dce(trace: Trace) -> Trace:
    """Keep a symbol when it has side effects, is a collective, or a kept symbol (or the output) reads it:
    by name, or, before sizes are materialized, a number read from data by its symbol."""
    symbols, output = _first_producers(trace)
    outputs = leaves(output)
    live = {x.label for x in outputs if is_proxy(x)}
    live_symbols = _symbols_used(outputs)
    kept = []
    for bsym in reversed(symbols):
        number = bsym.output if isinstance(bsym.output, NumberProxy) else None
        # (a bool read is ``Eq(u0, 1)``: by its symbol)
        read = (
            number is not None
            and isinstance(number.provenance, FromData)
            and bool(number.expr.free_symbols & live_symbols)
        )
        # A collective is kept though nothing reads it: every rank runs it in eager, and a
        # rank whose code does not use its result (``if rank == 0``) must still meet its peers.
        kept_anyway = has_side_effects(bsym) or is_communication(bsym.op)
        if read or kept_anyway or any(p.label in live for p in bsym.output_proxies()):
            kept.append(bsym)
            live.update(p.label for p in bsym.input_proxies())
            live_symbols |= _symbols_used((bsym.args, bsym.kwargs))
    kept.reverse()
    return trace.derive(f"{trace.fn_name}, after dead-code elimination", kept, output)
