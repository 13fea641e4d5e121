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

from ..core import Note, TracingError
from ..core.torch_internals import ProcessGroup, completed_work, work_done
from .c10d_ops import RECORDED, Recorder, dense

# The ops whose first argument lists one tensor (or list) per device of the rank.
_ONE_PER_RANK = frozenset({"allreduce_", "broadcast_", "reduce_", "allgather_", "reduce_scatter_", "scatter_"})

_C10D_MODULE = "torch.distributed.distributed_c10d"
_DTENSOR_API = "torch.distributed.tensor._api"  # (where DTensor.from_local is)
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


def _object_collective_error(call: str, frames) -> TracingError:
    if any(f.f_code.co_name == "from_local" and f.f_globals.get("__name__") == _DTENSOR_API for f in frames):
        return TracingError(  # (torch's metadata check calls it, not the user's code)
            f"dtcompile.jit: DTensor.from_local(..., run_check=True) checks the local tensors' metadata "
            f"across ranks with {call}, which sends pickled Python objects and reads them back as values; "
            "it cannot be recorded in a compiled program: pass run_check=False (and shape= and stride= "
            "where the shards are uneven), or call from_local outside the compiled function"
        )
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
    return _object_collective_error(f"dist.{name}", frames)


# The collectives eager runs into a leaf that requires grad (checked one by one).
_PLAIN_WRITES = {"allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "alltoall_base_"}

# Collectives into another tensor whose eager gradient is the backend kernel's doing: Gloo
# writes a reduce-scatter's output with copies autograd records, its all-gather raises.
_BACKEND_GRADIENTS = {
    "_allgather_base_",
    "allgather_into_tensor_coalesced_",
    "_reduce_scatter_base_",
    "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_",
}


def _backend_gradient(op_name: str, arguments: list) -> bool:
    """Whether eager's gradient through the c10d op is the backend kernel's doing: those
    above, and an all-reduce by AVG (Gloo's is a sum and a division autograd records,
    NCCL's one op autograd does not see)."""
    if op_name in _BACKEND_GRADIENTS:
        return True
    if op_name not in ("allreduce_", "allreduce_coalesced_"):
        return False
    op = arguments[2]
    return (op.op() if isinstance(op, torch.ScriptObject) else int(op)) == int(dist.ReduceOp.AVG)


def _tensors(argument) -> list:
    """The tensors of a c10d op's argument: one, a list, or a list of lists."""
    items = argument if isinstance(argument, list) else [argument]
    return [t for item in items for t in (item if isinstance(item, list) else [item])]


# The process group's method ``dist.all_to_all_single`` calls: c10d's binding takes only
# ints as split sizes (torch 2.13 names it ``all_to_all_single``, 2.10 ``alltoall_base``).
_ALL_TO_ALL_METHODS = [name for name in ("all_to_all_single", "alltoall_base") if hasattr(ProcessGroup, name)][:1]


@contextlib.contextmanager
def symbolic_splits(recording):
    """While a call is traced: ``dist.all_to_all_single`` whose split sizes are numbers the
    program computes (read from a tensor a collective made: MoE's size exchange), which
    c10d's binding refuses before the op reaches the recording, is recorded as the op
    would be (its checks, no autograd). Replaced on the process group's class, so a name
    bound before the call (``from torch.distributed import all_to_all_single``) takes it
    too."""
    (name,) = _ALL_TO_ALL_METHODS
    original, descriptor = getattr(ProcessGroup, name), vars(ProcessGroup)[name]  # (put back as it was)

    def all_to_all_single(group, output, input, output_split_sizes, input_split_sizes, *options):
        sizes = [*(output_split_sizes or ()), *(input_split_sizes or ())]
        if not any(isinstance(size, torch.SymInt) for size in sizes):
            return original(group, output, input, output_split_sizes, input_split_sizes, *options)
        recording.c10d_calls += 1
        arguments = (output, input, group, list(output_split_sizes), list(input_split_sizes))
        with torch.no_grad():  # (the op's own below autograd: c10d ops have no autograd kernel)
            record_c10d(recording, torch.ops.c10d.alltoall_base_.default, arguments, {})
        return work_done([output])  # (complete: the recorded collective is waited for here)

    setattr(ProcessGroup, name, all_to_all_single)
    try:
        yield
    finally:
        setattr(ProcessGroup, name, descriptor)


def record_c10d(recording, func, args: tuple, kwargs: dict):
    """Record the c10d op ``func`` (its tensors already the trace's proxies) as functional
    collectives on ``recording``; return what the op returns to ``torch.distributed``: the
    tensors it wrote and a completed ``Work``."""
    call, name = _user_call()
    if name.endswith(("_object", "_object_list")):
        raise _object_collective_error(call, _stack())
    op_name = func._schema.name.split("::")[-1]
    if op_name in _REFUSED:
        raise TracingError(f"dtcompile.jit: {call} is {_REFUSED[op_name]}; it cannot be recorded in a compiled program")
    handler = RECORDED.get(op_name)
    if handler is None:
        raise TracingError(f"dtcompile.jit: {call} (c10d.{op_name}) cannot be recorded in a compiled program")
    schema = func._schema.arguments
    arguments = list(args) + [kwargs[a.name] for a in schema[len(args) :] if a.name in kwargs]
    if op_name in _ONE_PER_RANK and len(arguments[0]) > 1:  # (torch.distributed's own pass one)
        raise TracingError(
            f"dtcompile.jit: {call} with {len(arguments[0])} tensors per rank (a ProcessGroup method given a list): "
            "c10d's multi-tensor form, which reduces or gathers across them, is not recorded. Pass one tensor"
        )
    if (
        _backend_gradient(op_name, arguments)
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in _tensors(args[1 if op_name in _BACKEND_GRADIENTS else 0]))
    ):
        raise TracingError(
            f"dtcompile.jit: {call} of a tensor that requires grad: eager's gradient through it is whatever the "
            "backend's kernel does (Gloo's and NCCL's differ); use the differentiable collectives "
            "(torch.distributed.nn.functional, or DTensor), or call it under torch.no_grad()"
        )
    tensors = [t for a in arguments[:2] for t in _tensors(a)]
    if any(isinstance(t, torch.Tensor) and not dense(t) for t in tensors):
        raise TracingError(
            f"dtcompile.jit: {call} on a view with gaps between its elements (x[:, 1], x[::2]): the backend "
            "reads and writes the memory from its first element on, which the program would not. Pass a "
            "contiguous tensor (.contiguous(), then copy the result back)"
        )
    start = len(recording.bound_symbols)
    written = args[0]
    flat = _tensors(written)
    if not torch.is_inference_mode_enabled() and any(isinstance(t, torch.Tensor) and t.is_inference() for t in flat):
        raise TracingError(  # (an in-place copy into one raises torch's error at each call)
            f"dtcompile.jit: {call} writes an inference tensor outside inference mode: c10d's kernel writes it, "
            "the program's copy cannot. Call the compiled function under torch.inference_mode(), or pass a tensor "
            "made outside it"
        )
    # c10d ops have no autograd kernel: eager's in-place collectives (and all_to_all_single)
    # write a leaf that requires grad as a plain tensor (its gradient then as if they had
    # not run); the others raise autograd's error, as the recorded copy does.
    leaf = (
        op_name in _PLAIN_WRITES
        and torch.is_grad_enabled()
        and any(isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad for t in flat)
    )
    with torch.no_grad() if leaf else contextlib.nullcontext():
        handler(Recorder(recording, call), *arguments)
    note = Note(f"{call}({', '.join(f'{{{i}}}' for i in range(len(flat)))})", tuple(flat))
    for bsym in recording.bound_symbols[start:]:
        if bsym.note is None:
            bsym.note = note
    work = completed_work(flat, recording.works)
    returns = func._schema.returns
    return work if len(returns) == 1 else (written, work)
