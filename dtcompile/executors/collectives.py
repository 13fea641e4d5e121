"""The collectives executor: DTensor's functional collectives on the mesh's process groups.

DTensor records a collective as a functional op (``_c10d_functional.all_reduce``: a new
tensor) and a ``wait_tensor``. This executor runs the pair as an async call on the process
group the DeviceMesh already holds (Gloo on CPU, NCCL on GPU) and an explicit
``work.wait()``: an all_reduce as the group's own ``allreduce`` (what ``dist.all_reduce``
ends in, without its Python checks: about 20 us less per call on Gloo), the others through
torch.distributed. Either way the c10d op runs through the dispatcher, so debugging tools
such as CommDebugMode see each collective. (The in-place functional ``all_reduce_``, which
Inductor's programs call, is invisible to CommDebugMode, and was not measurably faster.)
An all_reduce works in place when its input is a buffer the trace made and nothing reads
afterwards; otherwise it reduces a contiguous copy, which is what the functional op
returns. Collectives it does not know stay functional ops.

The pairs are made in ``partition``, which sees the whole trace: each start outputs the
collective's output tensor and its work handle (a ``FutureProxy``), and each wait reads
them, so the work handles are values of the execution trace and ``verify`` checks that a
wait follows its start. ``lower`` gets symbols that are already what runs.

Programs look their process groups up by name at each call (0.1 us) instead of holding
them: a held group outlives ``destroy_process_group``, and Gloo's worker threads then
die with the interpreter at exit (SIGABRT, pytorch/pytorch#190489).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core import BoundSymbol, FutureProxy, NoProvenance, Symbol, TensorProxy, Trace
from ..core.op_classes import group_name
from ..core.printing import python_literal
from ..core.proxy import is_contiguous_stride
from ..core.torch_internals import allgather_into, resolve_process_group
from .base import Executor, LoweringContext

functional = torch.ops._c10d_functional
_REDUCE_OPS = {"sum": "SUM", "product": "PRODUCT", "min": "MIN", "max": "MAX"}
# FSDP2's gradient reduce-scatter averages over the dp ranks; c10d runs AVG for a
# reduce-scatter on Gloo and NCCL (the functional op calls the same backend op), not for
# an all_reduce on Gloo.
_REDUCE_SCATTER_OPS = {**_REDUCE_OPS, "avg": "AVG"}
_DIST = ("dist", dist, "torch.distributed")
_TORCH = (("torch", torch, "torch"),)
# Printed as torch's own function, which it is (core/torch_internals.py).
_PROCESS_GROUP = ("process_group", resolve_process_group, "torch.distributed.distributed_c10d._resolve_process_group")
_ALLGATHER = ("allgather_into", allgather_into, "from dtcompile.core.torch_internals import allgather_into")


def _allreduce_options() -> dict[str, object]:
    options = {}
    for name in _REDUCE_OPS.values():
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, name)
        options[name] = opts
    return options


# ``process_group(name).allreduce([t], options)``: what ``dist.all_reduce`` ends in, without
# its Python checks and logging wrappers (about 20 us a call on Gloo).
ALLREDUCE_OPTIONS = _allreduce_options()
_OPTIONS = ("allreduce_options", ALLREDUCE_OPTIONS, "dtcompile.executors.collectives.ALLREDUCE_OPTIONS")
# An all_reduce of two ranks on Gloo runs as an exchange: each rank gathers both tensors
# (one round trip, where Gloo's ring all_reduce takes two) and combines them itself. With
# two operands the combination is the same number on both ranks and the same as Gloo's,
# whatever the order (a + b == b + a exactly in IEEE arithmetic): about 25 % less time per
# Llama decode step on 2 ranks. Dtypes whose sum Gloo might round otherwise stay.
_EXCHANGE_COMBINE = {"sum": "add", "product": "mul"}
_TINY, _ONE = 5e-324, 1.0  # (globals, so that Python does not fold their product)


def exchange_combined(combine, gathered: torch.Tensor) -> torch.Tensor:
    """An exchange's two tensors combined as Gloo's worker thread would: keeping denormals
    where the calling thread flushes them (``torch.set_flush_denormal(True)``, which
    Python's floats obey too), since Gloo's threads do not. (Where both ranks hold a NaN of
    another sign, the sign of the sum is not Gloo's: Gloo's depends on where the element
    falls among its chunks.)"""
    if _TINY * _ONE != 0.0:
        return combine(gathered[0], gathered[1])
    torch.set_flush_denormal(False)
    try:
        return combine(gathered[0], gathered[1])
    finally:
        torch.set_flush_denormal(True)


_EXCHANGE_DTYPES = {torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8}
# Newer releases rename two collectives and deprecate the old names.
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@dataclass(frozen=True)
class StartCollective(Symbol):
    """``work = dist.<collective>(..., async_op=True)``. Outputs ``(tensor, work)``: the
    collective's output, not ready until waited (for an exchange: the ``(2, ...)`` buffer
    both ranks' tensors are gathered into), and its work handle, a :class:`FutureProxy`."""

    kind: str = ""
    group: str = ""  # the process group's name
    in_place: bool = False
    exchange: bool = False  # an all_reduce of two ranks, run as a gather of both tensors
    strided: bool = False  # an exchange of a tensor that is not contiguous (gathered as a contiguous copy)

    def lines(self, bsym: BoundSymbol) -> list[str]:
        source = bsym.args[0].label
        out, work = (proxy.label for proxy in bsym.output)
        async_args = f"group=process_group({self.group!r}), async_op=True"
        if self.exchange:
            flat = f"{source}.contiguous().view(-1)" if self.strided else f"{source}.view(-1)"
            gather = f"allgather_into(process_group({self.group!r}), {out}.view(-1), {flat})"
            return [f"{out} = {source}.new_empty((2, *{source}.shape))", f"{work} = {gather}"]
        if self.kind == "all_reduce":
            start = f"process_group({self.group!r}).allreduce([{{}}], allreduce_options[{_REDUCE_OPS[bsym.args[1]]!r}])"
            if self.in_place:
                return [f"{work} = {start.format(source)}", f"{out} = {source}"]
            return [f"{out} = {source}.clone(memory_format=torch.contiguous_format)", f"{work} = {start.format(out)}"]
        # Output sizes from the input's, at run time: they may be symbolic.
        if self.kind == "all_gather_into_tensor":
            size = f"({source}.shape[0] * {python_literal(bsym.args[1])}, *{source}.shape[1:])"
            if bsym.args[0].ndim == 0:  # gathered into one row per rank (torch 2.10's argmax of a DTensor)
                size = f"({python_literal(bsym.args[1])},)"
            return [
                f"{out} = {source}.new_empty({size})",
                f"{work} = dist.{_ALL_GATHER}({out}, {source}, {async_args})",
            ]
        if self.kind == "reduce_scatter_tensor":
            op = f"dist.ReduceOp.{_REDUCE_SCATTER_OPS[bsym.args[1]]}"
            size = f"({source}.shape[0] // {python_literal(bsym.args[2])}, *{source}.shape[1:])"
            return [
                f"{out} = {source}.new_empty({size})",
                f"{work} = dist.{_REDUCE_SCATTER}({out}, {source}, op={op}, {async_args})",
            ]
        if self.kind == "all_to_all_single":
            out_splits, in_splits = python_literal(bsym.args[1]), python_literal(bsym.args[2])
            rows = f"sum({out_splits})" if bsym.args[1] else f"{source}.shape[0]"
            return [
                f"{out} = {source}.new_empty(({rows}, *{source}.shape[1:]))",
                f"{work} = dist.all_to_all_single({out}, {source}, {out_splits}, {in_splits}, {async_args})",
            ]
        raise AssertionError(self.kind)


@dataclass(frozen=True)
class WaitCollective(Symbol):
    """``work.wait()``, reading ``(work, tensor)``: the start's work handle and output. The
    collective's result is then ready under the wait's name (for an exchange: the
    combination of the two gathered tensors)."""

    combine: str = ""  # an exchange's combining function (``add``), or empty

    def lines(self, bsym: BoundSymbol) -> list[str]:
        work, tensor = (proxy.label for proxy in bsym.args)
        if self.combine:
            combine = f"exchange_combined(torch.{self.combine}, {tensor})"
            return [f"{work}.wait()", f"{bsym.output.label} = {combine}"]
        return [f"{work}.wait()", f"{bsym.output.label} = {tensor}"]


class CollectivesExecutor(Executor):
    """Claims DTensor's functional collectives and their waits. ``partition`` pairs each
    collective it runs with its waits: the start outputs a work handle, the waits read it.
    What ``lower`` then gets is already what runs."""

    name = "collectives"
    _KINDS = {
        functional.all_reduce.default: "all_reduce",
        functional.all_gather_into_tensor.default: "all_gather_into_tensor",
        functional.reduce_scatter_tensor.default: "reduce_scatter_tensor",
        functional.all_to_all_single.default: "all_to_all_single",
    }

    def claims(self, bsym: BoundSymbol) -> bool:
        return bsym.op in self._KINDS or bsym.op is functional.wait_tensor.default

    def partition(self, trace: Trace, earlier: list[Executor]) -> Trace:
        """``trace`` with each collective this executor runs replaced by its start, and
        each of its waits by a wait on the start's work handle. A collective stays
        functional where an executor in ``earlier`` claims it or one of its waits."""
        context = LoweringContext(trace)
        taken = {p.label for p in trace.inputs} | {p.label for b in trace.bound_symbols for p in b.output_proxies()}
        readers: dict[str, list[BoundSymbol]] = defaultdict(list)
        for bsym in trace.bound_symbols:
            for proxy in bsym.input_proxies():
                readers[proxy.label].append(bsym)
        started: dict[str, BoundSymbol] = {}  # a collective's output -> its start
        symbols: list[BoundSymbol] = []
        for index, bsym in enumerate(trace.bound_symbols):
            if bsym.op is functional.wait_tensor.default and bsym.args[0].label in started:
                symbols.append(_wait(bsym, started[bsym.args[0].label]))
                continue
            start = None
            if bsym.op in self._KINDS and not _claimed(bsym, readers, earlier):
                start = _start(bsym, index, context, readers, taken)
            if start is not None:
                started[bsym.output.label] = start
            symbols.append(bsym if start is None else start)  # None: runs as the functional op
        return trace.derive(trace.title, symbols)

    def lower(self, bsym: BoundSymbol, index: int, context: LoweringContext) -> list[BoundSymbol]:
        return [bsym]  # a start or wait from ``partition``, or a functional op that runs as recorded


def _claimed(bsym: BoundSymbol, readers, earlier: list[Executor]) -> bool:
    """Whether an executor before this one claims the collective or a symbol that reads its
    output (its wait): the pair is then left as recorded."""
    return any(e.claims(b) for e in earlier for b in [bsym, *readers[bsym.output.label]])


def _fresh(label: str, taken: set[str]) -> str:
    """``label``, or ``label`` with a number added where the trace has that name already."""
    name, n = label, 0
    while name in taken:
        n += 1
        name = f"{label}{n}"
    taken.add(name)
    return name


def _start(bsym: BoundSymbol, index: int, context: LoweringContext, readers, taken: set[str]) -> BoundSymbol | None:
    """The start of a functional collective, or None where the functional op runs it."""
    source = bsym.args[0]
    kind = CollectivesExecutor._KINDS[bsym.op]
    reduce_op = bsym.args[1] if kind in ("all_reduce", "reduce_scatter_tensor") else "sum"
    contiguous = isinstance(source, TensorProxy) and is_contiguous_stride(source.shape, source.stride())
    known = _REDUCE_SCATTER_OPS if kind == "reduce_scatter_tensor" else _REDUCE_OPS
    if reduce_op not in known or source.dtype.is_complex:
        return None
    group = group_name(bsym)
    # Whether it is an exchange may not depend on this rank's strides: a peer whose tensor
    # is laid out otherwise must run the same collective (an all_reduce met a gather: a hang).
    # Its result is contiguous, as the functional op's is.
    exchange = kind == "all_reduce" and _exchange_fits(bsym, reduce_op, group, readers)
    if not contiguous and not exchange:
        return None
    in_place = kind == "all_reduce" and not exchange and context.dead_after(source, index)
    made_by = NoProvenance(str(bsym.op))
    work = FutureProxy(_fresh(f"{bsym.output.label}_work", taken), made_by)
    tensor = bsym.output
    if exchange:  # both ranks' tensors, gathered
        with source.fake.fake_mode:
            both = source.fake.new_empty((2, *source.fake.shape))
        tensor = TensorProxy(both, _fresh(f"{bsym.output.label}_both", taken), made_by)
    symbol = StartCollective(
        name=kind,
        globals=(_DIST, _PROCESS_GROUP, _OPTIONS, _ALLGATHER) if kind == "all_reduce" else (_DIST, _PROCESS_GROUP),
        kind=kind,
        group=group,
        in_place=in_place,
        exchange=exchange,
        strided=exchange and not contiguous,
    )
    return BoundSymbol(symbol, bsym.args, bsym.kwargs, (tensor, work), bsym.note, bsym.op)


def _wait(bsym: BoundSymbol, start: BoundSymbol) -> BoundSymbol:
    """The wait of a started collective: it reads the start's work handle and output."""
    tensor, work = start.output
    combine = _EXCHANGE_COMBINE[start.args[1]] if start.symbol.exchange else ""
    exchange = (
        ("exchange_combined", exchange_combined, "from dtcompile.executors.collectives import exchange_combined"),
    )
    wait = WaitCollective("wait", globals=_TORCH + exchange if combine else _TORCH, combine=combine)
    return BoundSymbol(wait, (work, tensor), {}, bsym.output, bsym.note, bsym.op)


def _exchange_fits(bsym: BoundSymbol, reduce_op: str, group: str, readers) -> bool:
    """Whether an all_reduce runs as an exchange (see ``_EXCHANGE_COMBINE``): a sum or
    product of a dtype Gloo adds exactly as torch does, on a Gloo group of two ranks, whose
    result only its wait reads."""
    if reduce_op not in _EXCHANGE_COMBINE or bsym.args[0].dtype not in _EXCHANGE_DTYPES:
        return False
    pg = resolve_process_group(group)
    if pg.size() != 2 or dist.get_backend(pg) != "gloo":
        return False
    waits = readers[bsym.output.label]
    return len(waits) == 1 and waits[0].op is functional.wait_tensor.default
