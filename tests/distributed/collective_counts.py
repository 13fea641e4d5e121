"""Counting collectives, in eager DTensor (CommDebugMode) and in compiled traces, by the
name of the functional collective DTensor records."""

from collections import Counter

from torch.distributed.tensor.debug import CommDebugMode

from dtcompile.core.block_call import with_block_symbols

# The functional collectives DTensor records, and the c10d ops that run them.
FUNCTIONAL_TO_C10D = {
    "all_reduce": "allreduce_",
    "all_gather_into_tensor": "_allgather_base_",
    "reduce_scatter_tensor": "_reduce_scatter_base_",
    "all_to_all_single": "alltoall_base_",
}


def comm_counts(mode: CommDebugMode) -> Counter:
    """Collectives seen by CommDebugMode, by functional name, whether they ran as
    functional collectives (eager DTensor) or as c10d calls (the compiled program; an
    all_reduce of two Gloo ranks runs as an all_gather, see ``executed_counts``)."""
    c10d = {v: k for k, v in FUNCTIONAL_TO_C10D.items()}
    counts = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        counts[c10d.get(name, name)] += n
    return counts


def trace_collectives(trace) -> list:
    """The collectives a trace issues (its functional collective symbols, before or after
    lowering), those of the repeated blocks it calls at each call."""
    symbols = with_block_symbols(trace.bound_symbols, lowered=trace.title.startswith("execution"))
    return [b for b in symbols if b.op is not None and b.op._opname in FUNCTIONAL_TO_C10D]


def trace_counts(trace) -> Counter:
    return Counter(b.op._opname for b in trace_collectives(trace))


def executed_counts(trace) -> Counter:
    """The collectives an execution trace runs, by functional name: an all_reduce the
    collectives executor runs as an exchange (two Gloo ranks) is an all_gather."""
    counts = Counter()
    for bsym in trace_collectives(trace):
        exchange = getattr(bsym.symbol, "exchange", False)
        counts["all_gather_into_tensor" if exchange else bsym.op._opname] += 1
    return counts
