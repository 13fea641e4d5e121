"""A DTensor the traced code closes over (a model's parameter, reached by a loss function
that calls the model; a global) reaches the trace as its stand-in
(``Recording.capture_dtensor``: a DTensor around the captured proxy of its local tensor)
whatever way the code takes to it, so that its ops are recorded, read at every call, and
differentiated. ``CallAnnotator`` swaps it among a torch-level call's arguments; this
module covers the ways that call no torch function, or run where the annotator is off:

- DTensor's own methods that compute (``redistribute``, ``to_local``, ``full_tensor``)
  call autograd Functions, not torch functions, as does a user's Function given the
  DTensor: DTensors are swapped at every Function's ``apply``
  (``core/trace_hooks.function_applies``), however the code reached it (a method, a
  reference made before the call);
- a tensor attribute computed by an op (``w.T``) is a property read;
- the backward's Python code (a Function's ``backward``, a tensor hook) runs inside
  ``torch.autograd.grad``, which torch hands to the annotator with the annotator
  taken off: :func:`grad_under` runs it with the annotator on.

Run on the real DTensor instead, its gradient was lost, or its value at the first call
baked in.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from ..core import TensorProxy, TracingError
from ..core.trace_hooks import function_applies, function_mode_on_in_grad
from .block_training import BlockReplayFailed


def writes_in_place(func, kwargs: dict) -> bool:
    """Whether a torch-level call writes into an argument (``add_``, ``x += y``,
    ``x[i] = y``, ``out=``): a closed-over tensor that is not a leaf is changed as it is,
    so that the change of its graph is seen and refused (``grad_checks``), not made on a
    stand-in."""
    name = getattr(func, "__name__", "")
    return "out" in kwargs or name == "__setitem__" or name in _IN_PLACE_OPERATORS or (name[-1:] == "_" != name[-2:-1])


_IN_PLACE_OPERATORS = frozenset(
    f"__i{op}__" for op in "add sub mul matmul truediv floordiv mod pow and or xor lshift rshift".split()
)


def needs_stand_in(value) -> bool:
    """Whether the traced code gets a stand-in for ``value``: a DTensor it closes over (see
    above), or a plain tensor it closes over that requires grad and is not a leaf (``Wv =
    W[1]``, a tied head's ``emb.weight.T``). The stand-in is a leaf, so the program's
    gradient for it is its own, which autograd carries into ``W`` through its graph after
    the call, as eager's does; run on the real one, the traced backward carried it there
    too, and ``W`` got it twice where the code also read ``W``."""
    if isinstance(value, DTensor):
        return not isinstance(value._local_tensor, TensorProxy)
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, TensorProxy)
        and value.requires_grad
        and value.grad_fn is not None
        and not is_fake(value)
    )


# Tensor attributes computed by an op (a view): on a closed-over DTensor, from its stand-in.
COMPUTED_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


def stand_in(recording, value, writes: bool = False):
    """What the traced code gets for ``value`` (``needs_stand_in``): its stand-in, or itself;
    with ``writes`` (the call writes into its arguments), a plain tensor itself."""
    if not needs_stand_in(value) or (writes and not isinstance(value, DTensor)):
        return value
    with torch._C.DisableTorchFunction():  # (from a Function's ``apply``, the annotator is on)
        if isinstance(value, DTensor):
            return recording.capture_dtensor(value)
        return recording.capture(value)  # a proxy that requires grad: a leaf


# Tensor methods that read a tensor's data out of torch. A plain tensor the code closes over
# (a global refilled between calls) is read through its captured proxy, as an argument is: a
# number read at each call (``tolist``), or refused (``numpy``). Run on it under tracing's
# dispatch mode, they read the memory of a proxy its ``detach()`` made.
DATA_READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__dlpack__})


def read_through_proxy(recording, value):
    """What a data read (``DATA_READS``) by the traced code reads for ``value``."""
    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor) or is_fake(value):
        return stand_in(recording, value)
    if isinstance(value, TensorProxy) or value.device.type == "meta":
        return value
    with torch._C.DisableTorchFunction():
        return recording.capture(value)


@contextlib.contextmanager
def stand_ins_at_entry_points(recording):
    """``stand_in`` for each argument of an autograd Function applied by the tracing
    thread (an eager call from another thread keeps its own)."""
    thread = threading.get_ident()

    def swap(value):
        return stand_in(recording, value) if threading.get_ident() == thread else value

    with function_applies(swap):
        yield


def grad_under(mode, func, args: tuple, kwargs: dict, on_dtensors: bool, users: bool = False):
    """``torch.autograd.grad`` (the traced backward, or the code's own) with ``mode`` on
    while the engine runs the backward's Python code. On DTensors it is a DTensor call, as
    any other: the real tensors torch's and DTensor's own code makes in it are theirs
    (``arange(n).tolist()`` of a _StridedShard), run as they are; the user's code there
    (a Function's ``backward``, a hook) is annotated, its real tensors the program's."""
    if users:  # (the code's own call; the traced backward's is dtcompile's, on what it traced)
        args, kwargs = _inputs_as_traced(mode.recording, args, kwargs)
        if mode.memo.aliases_kept and kwargs.get("create_graph", args[4] if len(args) > 4 else False):
            # A gradient the forward goes on with (a penalty): a replayed block's recorded
            # backward has no graph of its own to differentiate again. Traced with none.
            raise BlockReplayFailed("torch.autograd.grad(..., create_graph=True) in the call")
    mode.in_backward += 1
    mode.recording.dtensor_calls += on_dtensors
    try:
        with function_mode_on_in_grad(mode):
            return func(*args, **kwargs)
    finally:
        mode.recording.dtensor_calls -= on_dtensors
        mode.in_backward -= 1


def _inputs_as_traced(recording, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``torch.autograd.grad``'s arguments with the tensors it differentiates with respect
    to as the traced code has them: a closed-over DTensor's or non-leaf's stand-in (the
    real one is in no traced graph). A tensor whose gradient eager carries through the
    real graph of a closed-over non-leaf (``base`` of ``W = base * 2``) is refused: the
    program's graph begins at the stand-in."""
    given = args[1] if len(args) > 1 else kwargs.get("inputs")
    if given is None:
        return args, kwargs
    single = isinstance(given, torch.Tensor)
    inputs = [stand_in(recording, t) for t in ((given,) if single else given)]
    reached = [t for t in recording.captured if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for t in inputs:
        if isinstance(t, torch.Tensor) and not isinstance(t, TensorProxy) and _reaches(reached, t):
            raise TracingError(
                "dtcompile.jit: torch.autograd.grad with respect to a tensor the call reaches only through a "
                "tensor it closes over that is made by autograd-recorded ops outside it (W = base * 2, then "
                "autograd.grad(loss, base)): its gradient runs through that graph, outside the program. Pass the "
                "tensor the call uses (W) in the call, or differentiate with respect to it"
            )
    inputs = inputs[0] if single else type(given)(inputs) if isinstance(given, (list, tuple)) else inputs
    if len(args) > 1:
        return (args[0], inputs, *args[2:]), kwargs
    return args, {**kwargs, "inputs": inputs}


def _reaches(tensors: list, target: torch.Tensor) -> bool:
    """Whether autograd's graph of any of ``tensors`` reaches ``target``."""
    stack = [t.grad_fn for t in tensors if t is not target]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node is target.grad_fn or getattr(node, "variable", None) is target:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False
