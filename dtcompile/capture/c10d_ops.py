r"""How each c10d op the traced code calls (``c10d.py``) is recorded: as functional
collectives and their waits, then ``copy_``\ s of the results into the tensors the op
writes, as DTensor's own collectives are recorded."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import TracingError
from ..core.torch_internals import non_overlapping_and_dense, unboxed_process_group

aten = torch.ops.aten
functional = torch.ops._c10d_functional

# ReduceOp's numbers, as a c10d op receives them, and the functional collectives' names.
_REDUCE_NAMES = {int(v): k.lower() for k, v in dist.ReduceOp.RedOpType.__members__.items()}


class Recorder:
    """Records one c10d call as functional collectives through the recording."""

    def __init__(self, recording, call: str):
        self.recording = recording
        self.call = call

    def op(self, func, *args):
        return self.recording.record(func, args, {})

    def rank(self, pg) -> int:
        return unboxed_process_group(pg).rank()

    def group(self, pg) -> tuple[str, int]:
        group = unboxed_process_group(pg)
        return group.group_name, group.size()

    def reduce_op(self, op) -> str:
        number = op.op() if isinstance(op, torch.ScriptObject) else int(op)
        name = _REDUCE_NAMES.get(number, str(number))
        if name not in ("sum", "avg", "product", "min", "max", "band", "bor", "bxor"):
            raise TracingError(f"dtcompile.jit: {self.call} with ReduceOp {name.upper()} cannot be recorded")
        return name

    def waited(self, collective, *args):
        return self.op(functional.wait_tensor.default, self.op(collective, *args))

    def memory(self, tensor) -> object:
        """A buffer the backend reads and writes in place (``all_reduce``, ``broadcast``,
        ``scatter``'s output) as a 1-D view in the order of its memory, as Gloo does,
        whatever its strides (a transpose; they may differ between ranks, and the
        collective has the same shape on each)."""
        if not tensor.is_contiguous():
            order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), d))
            tensor = self.op(aten.permute.default, tensor, order)
        return self.op(aten.view.default, tensor, [-1])

    def write(self, target, result, memory: bool = False) -> None:
        """``target.copy_(result)``, ``result`` viewed as ``target``'s shape; with
        ``memory``, into ``target``'s memory in order (:meth:`memory`)."""
        if memory:
            target, result = self.memory(target), self.op(aten.reshape.default, result, [-1])
        if tuple(result.shape) != tuple(target.shape):
            result = self.op(aten.reshape.default, result, list(target.shape))
        self.op(aten.copy_.default, target, result)

    def flat(self, tensors: list) -> object:
        """The tensors flattened and joined into one 1-D tensor."""
        flat = [self.op(aten.reshape.default, t, [-1]) for t in tensors]
        return flat[0] if len(flat) == 1 else self.op(aten.cat.default, flat)

    def scatter_rows(self, result, targets: list) -> None:
        """Write consecutive pieces of the 1-D ``result`` into ``targets``, in order."""
        start = 0
        for target in targets:
            end = start + target.numel()
            self.write(target, self.op(aten.slice.Tensor, result, 0, start, end))
            start = end


def _all_reduce(r: Recorder, tensors, pg, reduce_op, *rest):
    group, _ = r.group(pg)
    op = r.reduce_op(reduce_op)
    # Each reduced before any is written, as Gloo reduces a flat copy of them all: tensors
    # that share memory (``[y, y[:]]``, overlapping slices, at this call or a later one's)
    # are each reduced once.
    results = [r.waited(functional.all_reduce.default, r.memory(t), op, group) for t in tensors]
    for t, result in zip(tensors, results):
        r.write(t, result, memory=True)


def _all_gather_base(r: Recorder, output, input, pg, *rest):
    group, size = r.group(pg)
    _expect(r, output, [size * input.shape[0], *input.shape[1:]], input.dtype, "the output")
    r.write(output, r.waited(functional.all_gather_into_tensor.default, input, size, group))


def _all_gather(r: Recorder, output_lists, inputs, pg, *rest):
    group, size = r.group(pg)
    for outputs, input in zip(output_lists, inputs):
        if len(outputs) != size:
            raise RuntimeError(f"{r.call}: the output list holds {len(outputs)} tensors for a group of {size}")
        for output in outputs:
            _expect(r, output, list(input.shape), input.dtype, "each output")
        _contiguous(r, outputs, "the outputs")
        r.scatter_rows(r.waited(functional.all_gather_into_tensor.default, r.flat([input]), size, group), outputs)


def _all_gather_coalesced(r: Recorder, outputs, inputs, pg, *rest):
    for output, input in zip(outputs, inputs):
        _all_gather_base(r, output, input, pg)


def _reduce_scatter_base(r: Recorder, output, input, pg, reduce_op, *rest):
    group, size = r.group(pg)
    op = r.reduce_op(reduce_op)
    _expect(r, input, [size * output.shape[0], *output.shape[1:]], output.dtype, "the input")
    r.write(output, r.waited(functional.reduce_scatter_tensor.default, input, op, size, group))


def _reduce_scatter(r: Recorder, outputs, input_lists, pg, reduce_op, *rest):
    group, size = r.group(pg)
    op = r.reduce_op(reduce_op)
    for output, inputs in zip(outputs, input_lists):
        if len(inputs) != size:
            raise RuntimeError(f"{r.call}: the input list holds {len(inputs)} tensors for a group of {size}")
        for input in inputs:
            _expect(r, input, list(output.shape), output.dtype, "each input")
        _contiguous(r, [*inputs, output], "the inputs and output")
        r.write(output, r.waited(functional.reduce_scatter_tensor.default, r.flat(inputs), op, size, group))


def _reduce_scatter_coalesced(r: Recorder, outputs, inputs, pg, reduce_op, *rest):
    for output, input in zip(outputs, inputs):
        _reduce_scatter_base(r, output, input, pg, reduce_op)


def _broadcast(r: Recorder, tensors, pg, root_rank, root_tensor, *rest):
    group, _ = r.group(pg)  # root_rank is the group's rank, as the functional op takes it
    for t in tensors:
        r.write(t, r.waited(functional.broadcast.default, r.memory(t), root_rank, group), memory=True)


def _reduce(r: Recorder, tensors, pg, reduce_op, root_rank, *rest):
    """An all-reduce the root keeps. The others leave their tensor as it was (eager leaves
    what the backend leaves there: partial sums on Gloo) but write an empty slice of it, so
    that their all-reduce, read by nothing else, stays in their programs like the root's."""
    group, _ = r.group(pg)
    op = r.reduce_op(reduce_op)
    for t in tensors:
        result = r.waited(functional.all_reduce.default, r.memory(t), op, group)
        if r.rank(pg) == root_rank:
            r.write(t, result, memory=True)
        else:
            empty = r.op(aten.slice.Tensor, r.flat([result]), 0, 0, 0)
            r.op(aten.copy_.default, r.op(aten.slice.Tensor, r.flat([t]), 0, 0, 0), empty)


def _scatter(r: Recorder, outputs, input_lists, pg, root_rank, *rest):
    """The root's list broadcast whole, each rank's piece taken from it."""
    group, size = r.group(pg)
    rank = r.rank(pg)
    for i, output in enumerate(outputs):
        n = output.numel()
        _contiguous(r, input_lists[i] if input_lists else [], "the scatter list")
        source = r.flat(input_lists[i]) if input_lists else r.op(aten.new_empty.default, output, [size * n])
        everything = r.waited(functional.broadcast.default, source, root_rank, group)
        r.write(output, r.op(aten.slice.Tensor, everything, 0, rank * n, (rank + 1) * n), memory=True)


def _all_to_all_base(r: Recorder, output, input, pg, output_splits, input_splits, *rest):
    group, size = r.group(pg)
    if _overlapping([output, input]):  # eager's backend writes rows the program would still read
        raise TracingError(f"dtcompile.jit: {r.call} into a tensor that shares memory with its input")
    for what, t in (("input", input), ("output", output)):
        if not t.is_contiguous():  # (eager: "Tensors must be contiguous" for the input, rows of memory for the output)
            raise TracingError(f"dtcompile.jit: {r.call} with a non-contiguous {what}: pass a contiguous tensor")
    if list(output.shape[1:]) != list(input.shape[1:]):
        raise TracingError(
            f"dtcompile.jit: {r.call} into an output of shape {list(output.shape)} from an input of shape "
            f"{list(input.shape)}: rows of another shape are not recorded; give the output the input's rows"
        )
    if not input_splits:
        input_splits = [input.shape[0] // size] * size
    if not output_splits:
        output_splits = [output.shape[0] // size] * size
    for what, t, splits in (("output", output, output_splits), ("input", input, input_splits)):
        # Eager's check (Gloo's, NCCL's); with split sizes read from data, a check at run
        # time, which lets the output's rows be compared with the sum below.
        torch._check(
            sum(splits) == t.shape[0],
            lambda what=what: f"{r.call}: the {what} split sizes do not sum to the {what}'s rows",
        )
    result = r.waited(functional.all_to_all_single.default, input, list(output_splits), list(input_splits), group)
    r.write(output, result)


def _all_to_all(r: Recorder, outputs, inputs, pg, *rest):
    group, _ = r.group(pg)
    for what, t in [*(("each output", o) for o in outputs), *(("each input", i) for i in inputs[1:])]:
        _expect(r, t, list(inputs[0].shape), inputs[0].dtype, what)  # Gloo's: all the same size
    _contiguous(r, [*outputs, *inputs], "the outputs and inputs")
    result = r.waited(
        functional.all_to_all_single.default,
        r.flat(inputs),
        [o.numel() for o in outputs],
        [i.numel() for i in inputs],
        group,
    )
    r.scatter_rows(result, outputs)


def _contiguous(r: Recorder, tensors: list, what: str) -> None:
    """The list forms' tensors are contiguous: Gloo copies a transposed one into its flat
    buffer in a layout of its own, which the program does not reproduce."""
    if not all(t.is_contiguous() for t in tensors):
        raise TracingError(f"dtcompile.jit: {r.call} with a non-contiguous tensor among {what}: pass contiguous ones")


def _expect(r: Recorder, tensor, shape: list, dtype, what: str) -> None:
    """Eager's check of a buffer's size and dtype (Gloo raises; the functional
    collective would reshape a buffer of another shape, or cast another dtype)."""
    if tensor.dtype != dtype or list(tensor.shape) != shape:
        raise RuntimeError(
            f"{r.call}: {what} is {tensor.dtype} of shape {list(tensor.shape)}, where the collective takes {dtype} "
            f"of shape {shape}"
        )


def _overlapping(tensors: list) -> bool:
    """Whether two of these (dense) tensors hold some of the same elements."""
    by_memory: dict = {}  # (a memory is an int or a tuple: grouped, not ordered)
    for t in tensors:
        by_memory.setdefault(getattr(t, "memory", id(t)), []).append(
            (t.storage_offset(), t.storage_offset() + t.numel())
        )
    return any(b[0] < a[1] for spans in by_memory.values() for a, b in zip(sorted(spans), sorted(spans)[1:]))


def dense(tensor) -> bool:
    """Whether a tensor's elements fill its memory without gaps or overlaps (any order)."""
    with torch._C.DisableTorchFunction():
        return non_overlapping_and_dense(tensor)


RECORDED = {
    "allreduce_": _all_reduce,
    "allreduce_coalesced_": _all_reduce,
    "_allgather_base_": _all_gather_base,
    "allgather_": _all_gather,
    "allgather_into_tensor_coalesced_": _all_gather_coalesced,
    "_reduce_scatter_base_": _reduce_scatter_base,
    "reduce_scatter_": _reduce_scatter,
    "reduce_scatter_tensor_coalesced_": _reduce_scatter_coalesced,
    "broadcast_": _broadcast,
    "scatter_": _scatter,
    "reduce_": _reduce,
    "alltoall_base_": _all_to_all_base,
    "alltoall_": _all_to_all,
}
