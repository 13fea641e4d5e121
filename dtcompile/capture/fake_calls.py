"""An op run on fake tensors while tracing, as eager would run it: its errors told as
dtcompile's (an output that depends on the data, an op torch cannot trace, a layout
dtcompile does not trace) and its outputs given eager's strides."""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._pytree import tree_flatten

from ..core import TracingError, data_dependent_error
from ..core.provenance import InputPath
from ..core.view_strides import with_eager_strides

_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


@contextlib.contextmanager
def fake_errors_unlogged():
    """FakeTensorMode logs a traceback for every op that raises, then re-raises. The
    error reaches the user as eager's own; the log would only print it twice."""
    disabled = _FAKE_TENSOR_LOG.disabled
    _FAKE_TENSOR_LOG.disabled = True
    try:
        yield
    finally:
        _FAKE_TENSOR_LOG.disabled = disabled


def run_on_fakes(fake_mode: FakeTensorMode, func, args: tuple, kwargs: dict, call: str | None):
    """``func`` on fake ``args``: its fake outputs, with eager's strides. ``call``: the
    torch-level call that ran it, for the errors."""
    call = call or str(func)
    # A view of an inference tensor is one, as eager makes it, outside inference mode too
    # (autograd refuses to save it); a fake made outside the mode would not be.
    inference = _views_an_inference_tensor(func, args) and not torch.is_inference_mode_enabled()
    try:
        with fake_mode, fake_errors_unlogged(), torch.inference_mode() if inference else contextlib.nullcontext():
            out = func(*args, **kwargs)
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise data_dependent_error(call, f"the output of {func}, whose shape or value depends on the data") from error
    except UnsupportedOperatorException as error:
        raise TracingError(
            f"dtcompile.jit: {call} runs {func}, which torch cannot trace (it has no fake or meta kernel)"
        ) from error
    except AssertionError as error:
        if not _raised_in_torchs_decompositions(error):
            raise
        # (torch 2.10's ``split`` of a size 0 asserts there, where its kernel raises)
        raise RuntimeError(
            f"{call}: {func} does not take these arguments ({str(error) or 'torch asserts against them'})"
        ) from error
    layouts = {x.layout for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)} - {torch.strided}
    if layouts:
        raise TracingError(
            f"dtcompile.jit: {call} makes a tensor of layout {layouts.pop()}, which dtcompile does not trace "
            "(only strided tensors)"
        )
    return with_eager_strides(fake_mode, func, args, out)


def _views_an_inference_tensor(func, args: tuple) -> bool:
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_inference():
        return False
    returns = getattr(func, "_schema", None) and func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _raised_in_torchs_decompositions(error: BaseException) -> bool:
    """Whether ``error`` was raised by torch's decompositions or references (what eager's
    kernel checks, they assert)."""
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__", "").startswith(("torch._decomp", "torch._refs", "torch._prims"))


@functools.cache
def _writes_in_place(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _layout_key(t: torch.Tensor) -> tuple:
    key = lambda n: n.node.expr if isinstance(n, torch.SymInt) else n  # noqa: E731 (no guard made)
    return (tuple(map(key, t.shape)), tuple(map(key, t.stride())), key(t.storage_offset()))


def _only_free_strides(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether only strides of dims of size 1 changed, which address nothing: the same
    memory, read the same (eager's ``adaptive_avg_pool2d(x, 1)`` restrides its channels-last
    mean in place so)."""
    (sizes, strides, offset), (new_sizes, new_strides, new_offset) = _layout_key(before), _layout_key(after)
    return (
        sizes == new_sizes
        and offset == new_offset
        and all(size == 1 or a == b for size, a, b in zip(sizes, strides, new_strides))
    )


def refuse_metadata_changes(func, proxies: list, call: str | None) -> None:
    """Refuse an op that changed the sizes or strides of a traced tensor in place
    (``y.unsqueeze_(0)``, ``x.t_()``, ``resize_``, ``set_``, an ``out=`` tensor resized): a
    proxy's metadata is fixed when it is made, so the code after it would read the old."""
    if not _writes_in_place(func):
        return
    with torch._C.DisableTorchFunction():
        for proxy in proxies:
            if _layout_key(proxy) != _layout_key(proxy.fake) and not _only_free_strides(proxy, proxy.fake):
                path = proxy.provenance if isinstance(proxy.provenance, InputPath) else None
                what = "a traced tensor" if path is None else f"{path}, a tensor of the call,"
                if path is not None and path.root == "captured":
                    what = "a tensor the call closes over"
                raise TracingError(
                    f"dtcompile.jit: {call or func} changes the sizes or strides of {what} in place (x.t_(), "
                    "unsqueeze_, resize_, set_, an out= tensor of another size), which dtcompile does not trace. "
                    "Use the out-of-place form (x = x.t()), or an out= tensor of the result's size"
                )


_NO_DATA = ("data is not allocated yet", "Cannot access storage of", "Cannot access data pointer of")


def functorch_refusal(detail: str) -> TracingError:
    """The clear error for a torch.func transform inside a compiled call or around one."""
    return TracingError(
        "dtcompile.jit: torch.func's transforms (grad, vjp, jacrev, hessian, vmap) and forward-mode AD cannot be "
        "traced, inside a compiled call or around one: the tensors they wrap hide the traced ones. Inside the call, compute "
        "gradients with torch.autograd.grad(..., create_graph=True); around it, compile the function the "
        f"transform calls, not the transform ({detail})"
    )


def storage_refusal(error: Exception) -> TracingError | None:
    """The clear error for code that reached a traced tensor's data outside torch's ops
    (``torch.Tensor([t0, t1])``, ``FloatTensor``, a closed-over sparse or MKL-DNN tensor,
    ``torch.func`` over a compiled call): a traced tensor has none; else None."""
    if isinstance(error, TracingError) or not isinstance(error, (RuntimeError, NotImplementedError)):
        return None
    if not any(text in str(error) for text in _NO_DATA):
        return None
    if any(name in str(error) for name in ("TensorWrapper", "BatchedTensorImpl")):  # torch.func's wrappers
        return functorch_refusal(str(error).splitlines()[0])
    return TracingError(
        f"dtcompile.jit: the traced code reads a tensor's data outside torch's ops ({str(error).splitlines()[0]}), "
        "which a traced tensor does not have: build tensors with torch.stack / torch.cat, keep sparse and "
        "MKL-DNN tensors outside the call"
    )


class DataReads:
    """The fakes torch holds a number read from their data on (``.item()``'s, ``nonzero``'s
    and ``unique``'s count: the same symbol for the next read). Torch forgets it when the
    fake's version changes, which a write recorded below autograd does not change: so each
    write forgets the reads of the fakes sharing its memory (``s.item(); s.add_(1);
    s.item()`` reads twice)."""

    _MEMOS = ("item_memo", "nonzero_memo", "unique_memo", "unique_consecutive_memo")

    def __init__(self):
        self.fakes: list[torch.Tensor] = []

    def after(self, func, args: tuple, kwargs: dict, read: bool) -> None:
        """Note the fakes ``func`` read a number of (``read``: its result holds a number read
        from data); forget those its write reached."""
        if read:
            self.fakes += [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if self.fakes and _writes_in_place(func):
            written = {x.untyped_storage()._cdata for x in _written(func, args, kwargs)}
            for fake in self.fakes:
                if fake.untyped_storage()._cdata in written:
                    for memo in self._MEMOS:
                        setattr(fake, memo, None)


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            written += [
                v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)
            ]
    return written
