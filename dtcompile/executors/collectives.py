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

Programs look their process groups up by name at each call (0.1 us) instead of holding
them: a held group outlives ``destroy_process_group``, and Gloo's worker threads then
die with the interpreter at exit (SIGABRT, pytorch/pytorch#190489).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core import BoundSymbol, Symbol, TensorProxy
from ..core.op_classes import group_name
from ..core.printing import python_literal
from ..core.proxy import is_contiguous_stride
from ..core.torch_internals import resolve_process_group
from .base import Executor, LoweringContext

functional = torch.ops._c10d_functional
_REDUCE_OPS = {"sum": "SUM", "product": "PRODUCT", "min": "MIN", "max": "MAX"}
_DIST = ("dist", dist, "torch.distributed")
_TORCH = (("torch", torch, "torch"),)
# Printed as torch's own function, which it is (core/torch_internals.py).
_PROCESS_GROUP = ("process_group", resolve_process_group, "torch.distributed.distributed_c10d._resolve_process_group")


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
_EXCHANGE_DTYPES = {torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8}
# Newer releases rename two collectives and deprecate the old names.
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@dataclass(frozen=True)
class StartCollective(Symbol):
    """``work = dist.<collective>(..., async_op=True)``: the output is not ready until waited."""

    kind: str = ""
    work: str = ""
    group: str = ""  # the process group's name
    in_place: bool = False
    exchange: bool = False  # an all_reduce of two ranks, run as a gather of both tensors

    def lines(self, bsym: BoundSymbol) -> list[str]:
        source, out = bsym.args[0].label, bsym.output.label
        async_args = f"group=process_group({self.group!r}), async_op=True"
        if self.exchange:
            gather = f"process_group({self.group!r})._allgather_base({out}_both.view(-1), {source}.view(-1))"
            return [f"{out}_both = {source}.new_empty((2, *{source}.shape))", f"{self.work} = {gather}"]
        if self.kind == "all_reduce":
            start = f"process_group({self.group!r}).allreduce([{{}}], allreduce_options[{_REDUCE_OPS[bsym.args[1]]!r}])"
            if self.in_place:
                return [f"{self.work} = {start.format(source)}", f"{out} = {source}"]
            return [
                f"{out} = {source}.clone(memory_format=torch.contiguous_format)",
                f"{self.work} = {start.format(out)}",
            ]
        # Output sizes from the input's, at run time: they may be symbolic.
        if self.kind == "all_gather_into_tensor":
            size = f"({source}.shape[0] * {python_literal(bsym.args[1])}, *{source}.shape[1:])"
            return [
                f"{out} = {source}.new_empty({size})",
                f"{self.work} = dist.{_ALL_GATHER}({out}, {source}, {async_args})",
            ]
        if self.kind == "reduce_scatter_tensor":
            op = f"dist.ReduceOp.{_REDUCE_OPS[bsym.args[1]]}"
            size = f"({source}.shape[0] // {python_literal(bsym.args[2])}, *{source}.shape[1:])"
            return [
                f"{out} = {source}.new_empty({size})",
                f"{self.work} = dist.{_REDUCE_SCATTER}({out}, {source}, op={op}, {async_args})",
            ]
        if self.kind == "all_to_all_single":
            out_splits, in_splits = python_literal(bsym.args[1]), python_literal(bsym.args[2])
            rows = f"sum({out_splits})" if bsym.args[1] else f"{source}.shape[0]"
            return [
                f"{out} = {source}.new_empty(({rows}, *{source}.shape[1:]))",
                f"{self.work} = dist.all_to_all_single({out}, {source}, {out_splits}, {in_splits}, {async_args})",
            ]
        raise AssertionError(self.kind)


@dataclass(frozen=True)
class WaitCollective(Symbol):
    """``work.wait()``; the collective's output is then ready under its new name (for an
    exchange: the combination of the two gathered tensors)."""

    work: str = ""
    combine: str = ""  # an exchange's combining function (``add``), or empty

    def lines(self, bsym: BoundSymbol) -> list[str]:
        if self.combine:
            both = f"{bsym.args[0].label}_both"
            return [f"{self.work}.wait()", f"{bsym.output.label} = torch.{self.combine}({both}[0], {both}[1])"]
        return [f"{self.work}.wait()", f"{bsym.output.label} = {bsym.args[0].label}"]


class CollectivesExecutor(Executor):
    """Claims DTensor's functional collectives and their waits."""

    name = "collectives"
    _KINDS = {
        functional.all_reduce.default: "all_reduce",
        functional.all_gather_into_tensor.default: "all_gather_into_tensor",
        functional.reduce_scatter_tensor.default: "reduce_scatter_tensor",
        functional.all_to_all_single.default: "all_to_all_single",
    }

    def claims(self, bsym: BoundSymbol) -> bool:
        return bsym.op in self._KINDS or bsym.op is functional.wait_tensor.default

    def lower(self, bsym: BoundSymbol, index: int, context: LoweringContext) -> list[BoundSymbol]:
        if bsym.op is functional.wait_tensor.default:
            work = context.work_of.get(bsym.args[0].label)
            if work is None:  # the collective stayed functional
                return [bsym]
            combine = context.combine_of.get(bsym.args[0].label, "")
            wait = WaitCollective("wait", globals=_TORCH, work=work, combine=combine)
            return [BoundSymbol(wait, bsym.args, {}, bsym.output, bsym.note, bsym.op)]
        source = bsym.args[0]
        kind = self._KINDS[bsym.op]
        reduce_op = bsym.args[1] if kind in ("all_reduce", "reduce_scatter_tensor") else "sum"
        contiguous = isinstance(source, TensorProxy) and is_contiguous_stride(source.shape, source.stride())
        if not contiguous or reduce_op not in _REDUCE_OPS or source.dtype.is_complex:
            return [bsym]  # the functional op itself handles these
        work = f"{bsym.output.label}_work"
        context.work_of[bsym.output.label] = work
        group = group_name(bsym)
        exchange = kind == "all_reduce" and _exchange_fits(bsym, reduce_op, group, context)
        if exchange:
            context.combine_of[bsym.output.label] = _EXCHANGE_COMBINE[reduce_op]
        in_place = kind == "all_reduce" and not exchange and context.dead_after(source, index)
        symbol = StartCollective(
            name=kind,
            globals=(_DIST, _PROCESS_GROUP, _OPTIONS) if kind == "all_reduce" else (_DIST, _PROCESS_GROUP),
            kind=kind,
            work=work,
            group=group,
            in_place=in_place,
            exchange=exchange,
        )
        return [BoundSymbol(symbol, bsym.args, bsym.kwargs, bsym.output, bsym.note, bsym.op)]


def _exchange_fits(bsym: BoundSymbol, reduce_op: str, group: str, context: LoweringContext) -> bool:
    """Whether an all_reduce runs as an exchange (see ``_EXCHANGE_COMBINE``): a sum or
    product of a dtype Gloo adds exactly as torch does, on a Gloo group of two ranks, whose
    result only its wait reads."""
    if reduce_op not in _EXCHANGE_COMBINE or bsym.args[0].dtype not in _EXCHANGE_DTYPES:
        return False
    pg = resolve_process_group(group)
    if pg.size() != 2 or dist.get_backend(pg) != "gloo":
        return False
    label = bsym.output.label
    readers = [b for b in context.trace.bound_symbols if any(p.label == label for p in b.input_proxies())]
    return len(readers) == 1 and readers[0].op is functional.wait_tensor.default
