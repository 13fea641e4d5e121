"""Collectives the traced code calls itself (``dist.all_reduce(y)``), recorded.

Hugging Face's tensor parallelism and hand-written (Megatron-style) TP call
``torch.distributed`` on plain local tensors. Those calls reach the recorder as c10d ops
(``c10d.allreduce_``: in place, returning a ``Work``). Each is recorded as what DTensor's
own collectives are recorded as, a functional collective and its wait
(``_c10d_functional.all_reduce`` then ``wait_tensor``), followed by a ``copy_`` of the
result into the tensor the call wrote. The passes and the collectives executor then treat
it like any of DTensor's: the ranks compare it at compile time, the executor runs it on
the group (in place when nothing else reads the input).

The call returns a completed ``Work`` whose ``result()`` and ``get_future()`` hold the
tensors it wrote: ``async_op=True`` with ``work.wait()`` works, and the recorded
collective is already complete at its ``wait_tensor``, which comes right after it (eager
lets code read the buffer only after ``wait``, so waiting early changes no value).

The rooted ``scatter`` and ``reduce`` (``torch.distributed.nn.functional`` uses them) are
recorded as a ``broadcast`` of the root's list, of which each rank keeps its piece, and an
``all_reduce`` that only the root writes. What cannot be recorded raises
:class:`TracingError` naming the call: point-to-point ``send``/``recv``, ``gather``
(rooted: the other ranks have no buffer for it), barriers (they
order processes, not data), and object collectives (``all_gather_object``: pickled Python
objects, read back as values).
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..core import Note, TracingError
from ..core.torch_internals import completed_work, unboxed_process_group

aten = torch.ops.aten
functional = torch.ops._c10d_functional

_C10D_MODULE = "torch.distributed.distributed_c10d"
# ReduceOp's numbers, as a c10d op receives them, and the functional collectives' names.
_REDUCE_NAMES = {int(v): k.lower() for k, v in dist.ReduceOp.RedOpType.__members__.items()}
_REFUSED = {
    "send": "point-to-point communication",
    "recv_": "point-to-point communication",
    "recv_any_source_": "point-to-point communication",
    # Recorded as an all-gather, the other ranks' programs would hold one whose result
    # nothing reads, and lose it to dead-code elimination: the ranks would not agree.
    "gather_": "a rooted collective (use all_gather)",
    "barrier": "a barrier: it orders processes, not data (call it outside the compiled function)",
    "monitored_barrier_": "a barrier: it orders processes, not data (call it outside the compiled function)",
    "allgather_coalesced_": "a deprecated collective (use all_gather_into_tensor)",
}


def is_c10d_op(func) -> bool:
    return getattr(func, "namespace", None) == "c10d"


def _public_c10d_name(frames) -> str | None:
    """The outermost public function of torch.distributed among ``frames``."""
    name = None
    for frame in frames:
        if frame.f_globals.get("__name__") == _C10D_MODULE and not frame.f_code.co_name.startswith("_"):
            name = frame.f_code.co_name
    return name


def _stack():
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _user_call() -> tuple[str, str]:
    """The ``torch.distributed`` function the traced code called, as ``dist.<name>``; and
    its bare name."""
    name = _public_c10d_name(_stack())
    if name is None:  # a c10d op called some other way (torch.ops.c10d...)
        return "a torch.distributed collective", ""
    return f"dist.{name}", name


def _object_collective_error(call: str) -> TracingError:
    return TracingError(
        f"dtcompile.jit: {call} sends pickled Python objects between ranks and reads them back as values; "
        "it cannot be recorded in a compiled program (call it outside the compiled function)"
    )


def object_collective_refusal(error: Exception) -> TracingError | None:
    """The clear error for an object collective (``dist.all_gather_object``) that failed
    while traced before it reached a collective (pickling into a traced tensor); else None."""
    if isinstance(error, TracingError):
        return None
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    name = _public_c10d_name(reversed(frames))
    if name is None or not name.endswith(("_object", "_object_list")):
        return None
    return _object_collective_error(f"dist.{name}")


class _Recorder:
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


def _all_reduce(r: _Recorder, tensors, pg, reduce_op, *rest):
    group, _ = r.group(pg)
    op = r.reduce_op(reduce_op)
    if _overlapping(tensors):  # ``[y, y]``, overlapping slices (disjoint pieces of one buffer are fine)
        raise TracingError(f"dtcompile.jit: {r.call} of tensors that share memory: reduced once in eager, twice here")
    for t in tensors:
        r.write(t, r.waited(functional.all_reduce.default, r.memory(t), op, group), memory=True)


def _all_gather_base(r: _Recorder, output, input, pg, *rest):
    group, size = r.group(pg)
    _expect(r, output, [size * input.shape[0], *input.shape[1:]], input.dtype, "the output")
    r.write(output, r.waited(functional.all_gather_into_tensor.default, input, size, group))


def _all_gather(r: _Recorder, output_lists, inputs, pg, *rest):
    group, size = r.group(pg)
    for outputs, input in zip(output_lists, inputs):
        if len(outputs) != size:
            raise RuntimeError(f"{r.call}: the output list holds {len(outputs)} tensors for a group of {size}")
        for output in outputs:
            _expect(r, output, list(input.shape), input.dtype, "each output")
        _contiguous(r, outputs, "the outputs")
        r.scatter_rows(r.waited(functional.all_gather_into_tensor.default, r.flat([input]), size, group), outputs)


def _all_gather_coalesced(r: _Recorder, outputs, inputs, pg, *rest):
    for output, input in zip(outputs, inputs):
        _all_gather_base(r, output, input, pg)


def _reduce_scatter_base(r: _Recorder, output, input, pg, reduce_op, *rest):
    group, size = r.group(pg)
    op = r.reduce_op(reduce_op)
    _expect(r, input, [size * output.shape[0], *output.shape[1:]], output.dtype, "the input")
    r.write(output, r.waited(functional.reduce_scatter_tensor.default, input, op, size, group))


def _reduce_scatter(r: _Recorder, outputs, input_lists, pg, reduce_op, *rest):
    group, size = r.group(pg)
    op = r.reduce_op(reduce_op)
    for output, inputs in zip(outputs, input_lists):
        if len(inputs) != size:
            raise RuntimeError(f"{r.call}: the input list holds {len(inputs)} tensors for a group of {size}")
        for input in inputs:
            _expect(r, input, list(output.shape), output.dtype, "each input")
        _contiguous(r, inputs, "the inputs")
        r.write(output, r.waited(functional.reduce_scatter_tensor.default, r.flat(inputs), op, size, group))


def _reduce_scatter_coalesced(r: _Recorder, outputs, inputs, pg, reduce_op, *rest):
    for output, input in zip(outputs, inputs):
        _reduce_scatter_base(r, output, input, pg, reduce_op)


def _broadcast(r: _Recorder, tensors, pg, root_rank, root_tensor, *rest):
    group, _ = r.group(pg)  # root_rank is the group's rank, as the functional op takes it
    for t in tensors:
        r.write(t, r.waited(functional.broadcast.default, r.memory(t), root_rank, group), memory=True)


def _reduce(r: _Recorder, tensors, pg, reduce_op, root_rank, *rest):
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


def _scatter(r: _Recorder, outputs, input_lists, pg, root_rank, *rest):
    """The root's list broadcast whole, each rank's piece taken from it."""
    group, size = r.group(pg)
    rank = r.rank(pg)
    for i, output in enumerate(outputs):
        n = output.numel()
        source = r.flat(input_lists[i]) if input_lists else r.op(aten.new_empty.default, output, [size * n])
        everything = r.waited(functional.broadcast.default, source, root_rank, group)
        r.write(output, r.op(aten.slice.Tensor, everything, 0, rank * n, (rank + 1) * n), memory=True)


def _all_to_all_base(r: _Recorder, output, input, pg, output_splits, input_splits, *rest):
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
    result = r.waited(functional.all_to_all_single.default, input, list(output_splits), list(input_splits), group)
    r.write(output, result)


def _all_to_all(r: _Recorder, outputs, inputs, pg, *rest):
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


def _contiguous(r: _Recorder, tensors: list, what: str) -> None:
    """The list forms' tensors are contiguous: Gloo copies a transposed one into its flat
    buffer in a layout of its own, which the program does not reproduce."""
    if not all(t.is_contiguous() for t in tensors):
        raise TracingError(f"dtcompile.jit: {r.call} with a non-contiguous tensor among {what}: pass contiguous ones")


def _expect(r: _Recorder, tensor, shape: list, dtype, what: str) -> None:
    """Eager's check of a buffer's size and dtype (Gloo raises; the functional
    collective would reshape a buffer of another shape, or cast another dtype)."""
    if tensor.dtype != dtype or list(tensor.shape) != shape:
        raise RuntimeError(
            f"{r.call}: {what} is {tensor.dtype} of shape {list(tensor.shape)}, where the collective takes {dtype} "
            f"of shape {shape}"
        )


def _overlapping(tensors: list) -> bool:
    """Whether two of these (dense) tensors hold some of the same elements."""
    spans = sorted((getattr(t, "memory", id(t)), t.storage_offset(), t.storage_offset() + t.numel()) for t in tensors)
    return any(a[0] == b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:]))


def _dense(tensor) -> bool:
    """Whether a tensor's elements fill its memory without gaps or overlaps (any order)."""
    with torch._C.DisableTorchFunction():
        return torch._prims_common.is_non_overlapping_and_dense_or_false(tensor)


_RECORDED = {
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


@contextlib.contextmanager
def symbolic_splits():
    """While a call is traced: ``dist.all_to_all_single`` whose split sizes are numbers the
    program computes (read from a tensor a collective made: MoE's size exchange) runs as
    the functional collective, which takes them; c10d's own takes only ints."""
    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        sizes = [*(output_split_sizes or ()), *(input_split_sizes or ())]
        if not any(isinstance(size, torch.SymInt) for size in sizes):
            return original(output, input, output_split_sizes, input_split_sizes, group, async_op)
        group = group if group is not None else dist.group.WORLD
        result = funcol.all_to_all_single(input, output_split_sizes, input_split_sizes, group)
        output.copy_(funcol.wait_tensor(result))
        return completed_work() if async_op else None

    dist.all_to_all_single = all_to_all_single
    try:
        yield
    finally:
        dist.all_to_all_single = original


def record_c10d(recording, func, args: tuple, kwargs: dict):
    """Record the c10d op ``func`` (its tensors already the trace's proxies) as functional
    collectives on ``recording``; return what the op returns to ``torch.distributed``: the
    tensors it wrote and a completed ``Work``."""
    call, name = _user_call()
    if name.endswith(("_object", "_object_list")):
        raise _object_collective_error(call)
    op_name = func._schema.name.split("::")[-1]
    if op_name in _REFUSED:
        raise TracingError(f"dtcompile.jit: {call} is {_REFUSED[op_name]}; it cannot be recorded in a compiled program")
    handler = _RECORDED.get(op_name)
    if handler is None:
        raise TracingError(f"dtcompile.jit: {call} (c10d.{op_name}) cannot be recorded in a compiled program")
    schema = func._schema.arguments
    arguments = list(args) + [kwargs[a.name] for a in schema[len(args) :] if a.name in kwargs]
    tensors = [
        t
        for a in arguments[:2]
        for t in (a if isinstance(a, list) else [a])
        for t in (t if isinstance(t, list) else [t])
    ]
    if any(isinstance(t, torch.Tensor) and not _dense(t) for t in tensors):
        raise TracingError(
            f"dtcompile.jit: {call} on a view with gaps between its elements (x[:, 1], x[::2]): the backend "
            "reads and writes the memory from its first element on, which the program would not. Pass a "
            "contiguous tensor (.contiguous(), then copy the result back)"
        )
    start = len(recording.bound_symbols)
    handler(_Recorder(recording, call), *arguments)
    written = args[0]
    flat = [
        t for t in (written if isinstance(written, list) else [written]) for t in (t if isinstance(t, list) else [t])
    ]
    note = Note(f"{call}({', '.join(f'{{{i}}}' for i in range(len(flat)))})", tuple(flat))
    for bsym in recording.bound_symbols[start:]:
        if bsym.note is None:
            bsym.note = note
    work = completed_work(flat, recording.works)
    returns = func._schema.returns
    return work if len(returns) == 1 else (written, work)
