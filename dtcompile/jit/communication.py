"""The collectives of a compiled program, listed: ``dtcompile.collectives(jm)``.

Read from the execution traces (what runs), one row per collective a program starts:
its kind (the functional collective it runs, ``all_gather_into_tensor``), its process
group with the mesh dim it belongs to, the bytes this rank hands it and gets back (from
the proxies' shapes and dtypes), and whether it overlaps compute: whether local ops that
compute something (not views, not other collectives' starts and waits) run between its
start and its wait. A started collective (the collectives executor's ``StartCollective``)
and a functional one left as recorded (an ``avg`` reduce-scatter) are listed alike: both
are asynchronous until their wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core import BoundSymbol, TensorProxy, Trace
from ..core.block_call import BlockCall
from ..core.op_classes import group_name, is_collective, is_communication, is_wait, makes_view
from ..core.symbolic import is_symbolic, symbolic_expr
from ..core.torch_internals import resolve_process_group

# The positional argument holding the reduce op, per functional collective.
_REDUCE_OP_ARGUMENT = {"all_reduce": 1, "reduce_scatter_tensor": 1, "all_reduce_coalesced": 1}


@dataclass(frozen=True)
class Collective:
    """One collective of a compiled program (see the module docstring).

    ``bytes`` is the size of the tensor this rank hands the collective (its shard for an
    all-gather, the full tensor for a reduce-scatter or all-reduce); ``output_bytes`` that
    of its result. Under symbolic sizes both are the expression (a string such as
    ``'512*s0'``) and ``symbolic`` is True. ``overlapped_ops`` counts the computing ops
    between its start and its wait."""

    program: str  # "forward", "backward", or "computation" (a call without gradients)
    kind: str  # the functional collective: all_reduce, all_gather_into_tensor, reduce_scatter_tensor, ...
    group: str  # the process group's name
    mesh_dim: str  # the mesh dim whose group it is (``dp``, ``tp``), or "?" when unknown
    ranks: tuple[int, ...]  # the group's ranks
    reduce_op: str | None  # "sum", "avg", ... for reductions
    dtype: torch.dtype
    input_shape: tuple
    output_shape: tuple
    bytes: int | str
    output_bytes: int | str
    symbolic: bool
    overlapped_ops: int
    result: str  # the name of its result in the program

    @property
    def overlaps(self) -> bool:
        """Whether compute runs while the collective is in flight."""
        return self.overlapped_ops > 0

    def __str__(self) -> str:
        reduce = f" {self.reduce_op}" if self.reduce_op else ""
        size = f"{self.bytes} bytes" + (" (symbolic)" if self.symbolic else "")
        overlap = (
            f"overlaps {self.overlapped_ops} op{'s' if self.overlapped_ops > 1 else ''}"
            if self.overlaps
            else "no overlap"
        )
        return (
            f"{self.program:<8} {self.kind}{reduce} on {self.mesh_dim} (group {self.group!r}, ranks {list(self.ranks)}): "
            f"{_shape(self.input_shape)} -> {_shape(self.output_shape)} {str(self.dtype).removeprefix('torch.')}, "
            f"{size}, {overlap} -> {self.result}"
        )


def _shape(shape: tuple) -> str:
    return f"[{', '.join(str(s) for s in shape)}]"


def _nbytes(proxy: TensorProxy) -> tuple[int | str, bool]:
    numel = 1
    for size in proxy.shape:
        numel = numel * size
    total = numel * proxy.element_size()
    if is_symbolic(total):
        return str(symbolic_expr(total)), True
    return int(total), False


def _computes(bsym: BoundSymbol) -> bool:
    """A symbol that does local work: not a collective's start or wait, not a view, not a
    rename (``t1 = t0``)."""
    op = bsym.op
    if op is not None and (is_communication(op) or makes_view(op)):
        return False
    return op is not None or bool(bsym.input_tensors())


def _ranks(group: str) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(resolve_process_group(group)))
    except (KeyError, ValueError, RuntimeError):  # not a live group (a fake one torn down)
        return ()


def program_collectives(trace: Trace, labels: dict[str, str]) -> list[Collective]:
    """The collectives ``trace`` (an execution trace) starts, in order; ``labels`` maps
    group names to mesh dims."""
    symbols = trace.bound_symbols
    rows = []
    for index, bsym in enumerate(symbols):
        if isinstance(bsym.symbol, BlockCall):  # the block's own, at each call
            rows += program_collectives(bsym.symbol.block.traces[-1], labels)
            continue
        if not is_collective(bsym.op):
            continue
        made = {p.label for p in bsym.output_proxies()}
        wait_index, result = None, bsym.output_tensors()[0]
        for later in range(index + 1, len(symbols)):
            candidate = symbols[later]
            if is_wait(candidate.op) and made & {p.label for p in candidate.input_proxies()}:
                wait_index, result = later, candidate.output_tensors()[0]
                break
        end = len(symbols) if wait_index is None else wait_index
        overlapped = sum(1 for b in symbols[index + 1 : end] if _computes(b))
        source = bsym.args[0]
        sources = source if isinstance(source, (list, tuple)) else [source]
        kind = bsym.op._opname
        group = group_name(bsym)
        position = _REDUCE_OP_ARGUMENT.get(kind)
        sizes = [_nbytes(s) for s in sources]
        in_bytes = sizes[0][0] if len(sizes) == 1 else _sum(b for b, _ in sizes)
        out_bytes, out_symbolic = _nbytes(result)
        rows.append(
            Collective(
                program=trace.fn_name,
                kind=kind,
                group=str(group),
                mesh_dim=labels.get(group, "?"),
                ranks=_ranks(group),
                reduce_op=bsym.args[position] if position is not None else None,
                dtype=sources[0].dtype,
                input_shape=tuple(sources[0].shape),
                output_shape=tuple(result.shape),
                bytes=in_bytes,
                output_bytes=out_bytes,
                symbolic=any(s for _, s in sizes) or out_symbolic,
                overlapped_ops=overlapped,
                result=result.label,
            )
        )
    return rows


def _sum(values) -> int | str:
    values = list(values)
    if all(isinstance(v, int) for v in values):
        return sum(values)
    return " + ".join(str(v) for v in values)
