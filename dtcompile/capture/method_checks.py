"""Tensor methods whose effect reaches past the call, checked where the traced code calls
them on a traced tensor (``CallAnnotator``): what a compiled call could not give is
refused, naming the method; what the traced tensor would answer wrongly is answered from
the call's tensor.

- ``backward()`` accumulates gradients into the leaves' ``.grad``, a side effect the
  compiled call would not have (``torch.autograd.grad`` returns them, and is traced).
- A hook registered on a tensor the call received stays on it after the call, and runs
  at every later backward through it; the traced one acts inside the call only.
- ``retain_grad()``: refused at the end of the trace where the tensor is an output
  (:func:`retained_outputs`); the gradient of another output never passes through it.
- ``untyped_storage()`` of a traced tensor is the trace's, not the call's: its size and
  address would be constants of the program.
- ``is_inference()`` of a tensor the call received is the call's tensor's (a proxy made
  inside ``inference_mode`` would say True of a normal tensor); the prologue guards it.
- What a tensor the call received is beside its metadata (``_is_view()``, ``_base``,
  ``_version``, ``is_shared()``), read by the user's code, is the caller's tensor's, which
  the traced tensor does not know; refused. ``is_set_to`` of a traced tensor has no
  kernel for it (nor does DLPack, refused where the tracer patches it).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ..core import TensorProxy, TracingError
from ..core.code_origin import framework_code, library_code
from ..core.errors import data_dependent_error
from ..core.provenance import InputPath
from ..core.proxy import TextRefusals
from .objects import MODULES_MADE
from .outside_effects import outside_effects_refused

_BACKWARDS = {torch.Tensor.backward, torch.autograd.backward}
_STORAGE_READS = {torch.Tensor.untyped_storage} | (
    {torch.Tensor.storage, torch.Tensor._typed_storage} if hasattr(torch.Tensor, "_typed_storage") else set()
)
_CALLER_READS = {torch.Tensor._is_view, torch.Tensor.is_shared}
# ``F.dropout`` and the ops it calls (p, training as defaulted, the training argument's
# name): eager's kernel returns the input itself, not a copy, where nothing is dropped (p
# 0, not training, no element); torch's decomposition, which tracing runs, copies it.
_DROPOUTS = {
    torch.nn.functional.dropout: (0.5, True, "training"),
    torch.dropout: (None, None, "train"),
    torch.dropout_: (None, None, "train"),
}
# Recurrent ops: with gradients, eager's composite takes another kernel than the one tracing
# (below autograd, on stand-ins) records, whose backward needs a workspace the trace lacks.
_RECURRENT = {torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu}
_PERSISTING = {torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.retain_grad}
CHECKED = (
    set(_DROPOUTS)
    | _BACKWARDS
    | _STORAGE_READS
    | _CALLER_READS
    | _PERSISTING
    | {torch.Tensor.is_inference, torch.Tensor.is_set_to}
    | {torch.Tensor.share_memory_, torch.Tensor.detach_}
    | _RECURRENT
)
# Attributes of a received tensor that are the caller's tensor's, not the traced one's.
CALLER_ATTRIBUTES = frozenset({"_base", "_version"})
NOT_ANSWERED = object()


def real_tensor(value) -> bool:
    """A real tensor (a closed-over one the traced code reaches as it is): not traced, not a fake."""
    return isinstance(value, torch.Tensor) and local_proxy(value) is None and not is_fake(value)


def local_proxy(value) -> TensorProxy | None:
    proxy = getattr(value, "_local_tensor", value)
    return proxy if isinstance(proxy, TensorProxy) else None


def received(value) -> InputPath | None:
    """Where a traced tensor (or a DTensor around one) came from in the call; None for
    one the traced code made."""
    proxy = local_proxy(value)
    provenance = getattr(proxy, "provenance", None)
    return provenance if isinstance(provenance, InputPath) else None


def received_base(value, recording) -> InputPath | None:
    """Where the tensor whose memory a traced tensor shares came from in the call, where
    the call received it: a view of it (or ``x.detach()``, ``x.data``) shares its version
    counter, and a view's ``_base`` is the caller's tensor's base."""
    proxy = local_proxy(value)
    if proxy is None:
        return None
    if received(proxy) is not None:
        return received(proxy)
    memory = proxy.memory
    found = (p for p in recording.input_proxies if p._fake is not None and p.memory == memory)
    return next((p.provenance for p in found if isinstance(p.provenance, InputPath)), None)


def non_leaf_argument(recording, leaves: list) -> str | None:
    """Where the argument among ``leaves`` is (or the one it is a view of: by memory, or a
    DTensor's autograd base), that the call received as a tensor requiring grad that is not a
    leaf; None if none. Its stand-in is a leaf: torch's error about an in-place write to it
    speaks of a leaf the caller does not have."""
    for leaf in leaves:
        with torch._C.DisableTorchFunction():
            base = leaf._base if isinstance(leaf, torch.Tensor) else None
        for proxy in (p for p in map(local_proxy, (leaf, base)) if p is not None):
            for p in [proxy] if proxy.label in recording.real_of else recording.input_proxies:
                real = recording.dtensor_of.get(p.label, recording.real_of.get(p.label))  # (a DTensor's own flags)
                shared = p is proxy or (p._fake is not None and p.memory == proxy.memory)
                if real is not None and real.requires_grad and not real.is_leaf and shared:
                    return str(p.provenance).removesuffix("._local_tensor")
    return None


def check_method(func, args: tuple, recording, kwargs: dict) -> object:
    """Refuse ``func`` where the traced code calls it on a traced tensor and a compiled
    call could not do what it does; the answer of ``is_inference``, or a dropout's that
    drops nothing (its input); else NOT_ANSWERED."""
    if func in _DROPOUTS:
        return _dropped_nothing(func, args, kwargs)
    if func in _RECURRENT and torch.is_grad_enabled() and any(t.requires_grad for t in _tensors((args, kwargs))):
        raise TracingError(f"dtcompile.jit: torch.{func.__name__} with gradients is not supported yet (without, it is)")
    if func in _BACKWARDS:
        if _called_by_user(func):
            raise _backward_refusal(func)
        return NOT_ANSWERED
    tensor = args[0] if args else None
    proxy = local_proxy(tensor)
    if proxy is None:
        leaf_retained = func is torch.Tensor.retain_grad and real_tensor(tensor) and tensor.is_leaf  # (a no-op)
        if func in _PERSISTING and real_tensor(tensor) and not leaf_retained and _called_by_user(func):
            raise TracingError(
                f"dtcompile.jit: {_name(func)} on a tensor the call closes over: in eager it stays on it after "
                "the call (once more at each call), which a compiled call cannot do. Call it outside the call"
            )
        return NOT_ANSWERED
    path = received(tensor)
    if func is torch.Tensor.register_hook and path is not None:
        raise TracingError(
            f"dtcompile.jit: Tensor.register_hook on {_where(path)}, a tensor the call received: in eager the hook "
            "stays on it after the call and runs at every later backward through it, which a compiled call "
            "cannot do. Register the hook outside the call"
        )
    if func is torch.Tensor.retain_grad:
        real = recording.real_of.get(proxy.label)
        if path is not None and not (tensor is proxy and real is not None and real.is_leaf):
            raise TracingError(
                f"dtcompile.jit: retain_grad() on {_where(path)}, a tensor the call received that is not a leaf: in "
                "eager it keeps the gradient of every later backward through it, which a compiled call cannot do. "
                "Call retain_grad() before the call"
            )
        recording.retained.add(proxy.label)
    elif func in _STORAGE_READS and _called_by_user(func):
        raise TracingError(
            f"dtcompile.jit: {_name(func)} of a traced tensor: a compiled program's tensors have no storage "
            "while tracing, so what the code reads of it (its size, its address) would be the trace's, not the "
            "call's"
        )
    elif func is torch.Tensor.is_inference and path is not None and proxy.label in recording.real_of:
        return recording.real_of[proxy.label].is_inference()
    elif func in _CALLER_READS and _called_by_user(func) and (shared := received_base(tensor, recording)) is not None:
        raise caller_read_refusal(f"{func.__name__}()", shared)
    elif func is torch.Tensor.detach_ and path is not None:
        real = recording.real_of.get(proxy.label)
        if real is not None and real._is_view():  # eager's error: the trace's tensor is no view
            raise RuntimeError(
                "Can't detach views in-place. Use detach() instead. If you are using DistributedDataParallel "
                "(DDP) for training, and gradient_as_bucket_view is set as True, gradients are views of DDP "
                "buckets, and hence detach_() cannot be called on these gradients. To fix this error, please "
                "refer to the Optimizer.zero_grad() function in torch/optim/optimizer.py as the solution."
            )
    elif func is torch.Tensor.share_memory_:
        raise TracingError(
            "dtcompile.jit: Tensor.share_memory_ of a traced tensor: it moves the tensor's storage, which a "
            "compiled program cannot record. Call it before the call"
        )
    elif func is torch.Tensor.is_set_to:
        raise TracingError(
            "dtcompile.jit: Tensor.is_set_to of a traced tensor: whether two tensors are set to the same memory is "
            "not known while tracing. Compare them before the call"
        )
    return NOT_ANSWERED


def caller_read_refusal(what: str, path: InputPath) -> TracingError:
    whose = (
        "a tensor the call closes over" if path.root == "captured" else f"{_where(path)}, a tensor the call received"
    )
    return TracingError(
        f"dtcompile.jit: the traced code reads {what} of {whose}: that is the "
        "caller's tensor's (whether it is a view, of what, how often it was written in place, whether it is in "
        "shared memory), which a compiled program does not know. Read it before the call"
    )


AUTOGRAD_ATTRIBUTES = frozenset({"is_leaf", "grad_fn"})


def autograd_attribute(attribute: str, tensor, recording) -> object:
    """``is_leaf`` or ``grad_fn`` of a tensor the call received, read by the user's code:
    the traced tensor is a leaf of the trace's graph, where the caller's may not be. A
    plain tensor's ``is_leaf`` is the caller's; ``grad_fn`` of a non-leaf, and either of a
    DTensor that requires grad (its graph is on the caller's DTensor), are refused."""
    path = received(tensor)
    if path is None or not tensor.requires_grad:
        return NOT_ANSWERED
    real = None if local_proxy(tensor) is not tensor else recording.real_of.get(tensor.label)
    if real is not None and (real.is_leaf or attribute == "is_leaf"):
        return real.is_leaf if attribute == "is_leaf" else NOT_ANSWERED
    raise TracingError(
        f"dtcompile.jit: the traced code reads .{attribute} of {_where(path)}, a tensor of the call that requires "
        "grad: the traced tensor is a leaf of the trace's own graph, not the caller's. Read it before the call"
    )


def retained_outputs(recording, outputs: list) -> None:
    """Refuse an output on which the traced code called ``retain_grad()``: a compiled
    call's outputs are outputs of one autograd node, so the gradient of another output
    never passes through it."""
    for value in outputs:
        proxy = local_proxy(value)
        if proxy is not None and proxy.label in recording.retained:
            raise TracingError(
                "dtcompile.jit: the traced code calls retain_grad() on a tensor it returns; a compiled call's "
                "outputs are outputs of one autograd node, so a gradient computed from another output would not "
                "reach its .grad. Compute what needs that gradient outside the call"
            )


@contextlib.contextmanager
def effects_refused():
    """While a call is traced: ``torch.autograd.backward`` called by the user's code is
    refused (torch 2.10 does not pass it through the torch function modes, so the
    ``CallAnnotator`` does not see it), and so are the effects of ``outside_effects.py``;
    and, after the traced call, a refusal the user's
    code caught (``except Exception`` around ``x.numpy()``; ``logging`` reports a failed
    message and goes on) is raised: else the compiled call would take the way the code
    went on at every call, where eager takes the other."""
    TextRefusals.active += 1
    outermost = TextRefusals.active == 1
    if outermost:
        TracingError.made = []
    guards_on_data, guard_init = [], GuardOnDataDependentSymNode.__init__

    def noted_guard(error, *args, **kwargs):  # (torch's, raised by ``bool(n > 2)`` of a number read from data)
        guard_init(error, *args, **kwargs)
        guards_on_data.append(error)

    original = torch.autograd.backward
    dlpack = torch.utils.dlpack.to_dlpack

    def backward(*args, **kwargs):
        if _called_by_user(backward):
            raise _backward_refusal(original)
        return original(*args, **kwargs)

    def to_dlpack(tensor, *args, **kwargs):
        if local_proxy(tensor) is not None or is_fake(tensor):  # (it reads the storage, which a proxy lacks)
            raise TracingError(
                "dtcompile.jit: to_dlpack of a traced tensor: the data leaves torch, which a compiled program "
                "cannot record. Hand it over outside the call"
            )
        return dlpack(tensor, *args, **kwargs)

    torch.autograd.backward = backward
    torch.utils.dlpack.to_dlpack = torch.to_dlpack = to_dlpack
    GuardOnDataDependentSymNode.__init__ = noted_guard
    module_init = torch.nn.Module.__init__

    def noted_module_init(module, /, *args, **kwargs):  # (one the call returns or keeps is refused)
        module_init(module, *args, **kwargs)
        MODULES_MADE.add(module)

    torch.nn.Module.__init__ = noted_module_init
    try:
        with outside_effects_refused():
            yield
    finally:
        torch.nn.Module.__init__ = module_init
        torch.autograd.backward = original
        torch.utils.dlpack.to_dlpack = torch.to_dlpack = dlpack
        GuardOnDataDependentSymNode.__init__ = guard_init
        TextRefusals.active -= 1
        swallowed = TracingError.made[:1] if outermost else []
        if outermost:
            TracingError.made = None
    if swallowed:
        raise swallowed[0]
    for error in guards_on_data:  # torch catches some itself, on its own frames only
        if _caught_by_user(error):
            raise data_dependent_error(None, f"Python control flow on {error.cond}, a number read from tensor data")


def _caught_by_user(error: BaseException) -> bool:
    """Whether an exception that was caught passed through the user's code on its way:
    its traceback runs from the frame that caught it to the one that raised it."""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not library_code(tb.tb_frame.f_globals.get("__name__", ""), code.co_filename):
            return True
        tb = tb.tb_next
    return False


def _backward_refusal(func) -> TracingError:
    return TracingError(
        f"dtcompile.jit: the traced code calls {_name(func)}: it accumulates gradients into the leaves' .grad, a "
        "side effect a compiled call does not have. Return the loss and call backward outside the call, or use "
        "torch.autograd.grad inside it"
    )


def _where(path: InputPath) -> str:
    text = str(path)
    return text.removesuffix("._local_tensor")


def _name(func) -> str:
    owner = "Tensor" if getattr(torch.Tensor, func.__name__, None) is func else "torch.autograd"
    return f"{owner}.{func.__name__}"


# torch's Python methods of a tensor that call the one checked for its caller (torch's
# own ``_typed_storage`` is invisible to torch function modes: it calls ``untyped_storage``).
_TENSOR_WRAPPERS = frozenset({"_typed_storage", "storage", "is_shared", "share_memory_"})


def _called_by_user(func) -> bool:
    """Whether the code that called ``func`` (past torch's dispatch to this mode and
    ``func``'s own frame) is the user's, not torch's (checkpoint's backward) or
    dtcompile's."""
    frame = sys._getframe(2)
    code = getattr(func, "__code__", None)
    while frame is not None and (
        frame.f_globals.get("__name__") in ("torch.overrides", __name__, "dtcompile.capture.annotator")
        or frame.f_code is code
        or (frame.f_globals.get("__name__") == "torch._tensor" and frame.f_code.co_name in _TENSOR_WRAPPERS)
    ):
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    return not framework_code(module)


def _tensors(tree) -> list:
    return [x for x in torch.utils._pytree.tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _dropped_nothing(func, args: tuple, kwargs: dict) -> object:
    """The input of a dropout that drops nothing, as eager's kernel returns it; else
    NOT_ANSWERED (a probability out of range: eager's error, as eager raises it)."""
    default_p, default_training, training_name = _DROPOUTS[func]
    tensor = args[0] if args else kwargs.get("input")
    p = args[1] if len(args) > 1 else kwargs.get("p", default_p)
    training = args[2] if len(args) > 2 else kwargs.get(training_name, default_training)
    if not isinstance(tensor, torch.Tensor) or type(p) not in (int, float) or not 0 <= p <= 1:
        return NOT_ANSWERED
    empty = any(type(size) is int and size == 0 for size in tensor.shape)
    idle = type(training) in (bool, int) and not training
    return tensor if p == 0 or idle or empty else NOT_ANSWERED
