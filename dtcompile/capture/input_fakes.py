"""The fake tensor of each real tensor that enters a trace (an argument, a parameter, a
buffer, a closed-over tensor).

The fake mode's converter walks a real tensor's whole description (about 0.3 ms each):
most of a deep model's inputs are parameters, so it was a tenth of a 32-layer compile.
A leaf tensor that fills its storage, of a storage met first here, is made from its
metadata instead (``fake_like``, a sixth of that) and given to the converter's memo, so
that converting the real tensor again gives the same fake. Aliasing is kept: a storage
is either made here, and every later tensor of it is made in that fake's storage (which
covers it), or converted, and the converter knows the storage; a tensor of a storage
made here gets static sizes even where symbolic ones were asked (guarded exactly: a
narrower program, never a wrong one).

Such a fake is made when first asked for (``deferred``): a deep model's later blocks are
calls of the first one's program, and their parameters' proxies never need fakes. Until
then its storage is pending; any conversion or view of that storage makes it first.

With symbolic sizes, the converter gives tensors of equal sizes and strides the same
symbols (duck sizing) at about 1 ms a tensor: a KV cache's 64 layers at 32 decoder
layers. A later such tensor that fills a storage of its own takes the first one's
symbolic metadata instead (``deferred(real, like)``), which is what the converter would
have made for it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from ..core import TracingError
from ..core.torch_internals import dispatch_modes_off, fake_in_storage, fake_like, storage_id

_CONVERTED = object()  # a storage the converter has met


class InputFakes:
    def __init__(self, fake_mode):
        self.fake_mode = fake_mode
        self._storages: dict[int, object] = {}  # storage id -> the fake made here first, or _CONVERTED
        self._symbolic: dict[tuple, torch.Tensor] = {}  # metadata -> the first such fake with symbolic sizes

    def forget(self) -> None:
        """Let go of the weak references the converter holds to the real tensors: torch
        refuses to swap a tensor anything refers to weakly (``torch.utils.swap_tensors``,
        ``module.to()`` under ``set_swap_module_params_on_conversion``). Called once the
        program is built: nothing converts them again."""
        describer = self.fake_mode.fake_tensor_converter.meta_converter.describer
        describer.lookup_tensor.clear()
        describer.lookup_storage.clear()
        self._storages.clear()  # (its pending fakes refer back to it: no cycle left for the collector)

    def deferred(self, real: torch.Tensor, like: torch.Tensor | None = None):
        """For a tensor whose fake :meth:`static` would make from its metadata (or that of
        ``like``, a fake with its sizes as symbols): a function making that fake, which can
        be called later (the storage waits for it); else None."""
        if storage_id(real) in self._storages or not _fills_storage(real):
            return None
        pending = _Pending(self, real, like)
        self._storages[storage_id(real)] = pending
        return pending

    def symbolic(self, real: torch.Tensor, context):
        """A fake of ``real`` with its sizes as symbols (``context``: which), or a function
        making it later, where an earlier tensor like it has one (see the module docstring)."""
        key = (real.shape, real.stride(), real.dtype, real.device, real.requires_grad)
        like = self._symbolic.get(key) if _fills_storage(real) else None
        made = like is not None and self.deferred(real, like)
        if made:
            return made
        fake = self.converted(real, symbolic_context=context)
        if _fills_storage(real):
            self._symbolic.setdefault(key, fake)
        return fake

    def static(self, real: torch.Tensor) -> torch.Tensor:
        """A fake of ``real`` with its sizes."""
        with _untraced():
            return self._static(real)

    def _static(self, real: torch.Tensor) -> torch.Tensor:
        first = self._first(real)
        if first is None and _fills_storage(real):
            return self._made(real, None)
        return self._converted(real, static_shapes=True)

    def converted(self, real: torch.Tensor, **options) -> torch.Tensor:
        """The converter's fake of ``real`` (``options``: its sizes' symbolic context), or,
        for a storage made here, a fake in that storage with ``real``'s sizes."""
        with _untraced():
            return self._converted(real, **options)

    def _converted(self, real: torch.Tensor, **options) -> torch.Tensor:
        if isinstance(real, AsyncCollectiveTensor):  # (a DTensor's, from ``redistribute(async_op=True)``)
            real = real.trigger_wait()  # its data, waited for, as eager's first op on it waits: a plain fake
        first = self._first(real)
        if first is not None and first is not _CONVERTED:
            if real.is_nested or real.is_quantized or real.layout is not torch.strided:
                raise TracingError(f"dtcompile: a {real.layout} tensor shares memory with another input; not supported")
            return self._made(real, first)
        self._storages[storage_id(real)] = _CONVERTED
        if _history_refused(real):  # (as a leaf, as made: eager's code runs on it)
            return self.fake_mode.from_tensor(real.detach(), **options).requires_grad_(real.requires_grad)
        return self.fake_mode.from_tensor(real, **options)

    def _first(self, real: torch.Tensor):
        """What ``real``'s storage met first: a fake made here (made now if pending),
        ``_CONVERTED``, or None."""
        first = self._storages.get(storage_id(real))
        return first() if isinstance(first, _Pending) else first

    def _made(self, real: torch.Tensor, base: torch.Tensor | None, like: torch.Tensor | None = None) -> torch.Tensor:
        if base is None:
            fake = fake_like(self.fake_mode, real if like is None else like, None, real.requires_grad)
        else:  # with its bits: a view of a complex tensor's ``.imag`` has the negative bit
            fake = fake_in_storage(self.fake_mode, real, base)
            torch._C._set_conj(fake, real.is_conj())
            torch._C._set_neg(fake, real.is_neg())
        if type(real) is torch.nn.Parameter:
            fake._is_param = True  # as the converter marks it: ``isinstance(p, Parameter)``
        if getattr(real, "_is_buffer", False):  # ``nn.Buffer``'s marks, as the converter forwards them
            fake._is_buffer = True
            if hasattr(real, "persistent"):
                fake.persistent = real.persistent
        if base is None:
            self._storages[storage_id(real)] = fake
        self.fake_mode.fake_tensor_converter.set_tensor_memo(real, fake)
        return fake


class _Pending:
    """A fake made from its tensor's metadata when first asked for (``InputFakes.deferred``)."""

    def __init__(self, fakes: InputFakes, real: torch.Tensor, like: torch.Tensor | None):
        self.fakes, self.real, self.like, self.fake = fakes, real, like, None

    def __call__(self) -> torch.Tensor:
        if self.fake is None:
            with _untraced(), torch.inference_mode(False):  # (first read inside the call's inference mode)
                self.fake = self.fakes._made(self.real, None, self.like)
        return self.fake


def _history_refused(t: torch.Tensor) -> bool:
    """A view made under no_grad whose base was written since: autograd refuses its history."""
    try:
        _ = t.grad_fn
    except RuntimeError:
        return True
    return False


def _plain(t: torch.Tensor) -> bool:
    """A dense leaf tensor whose fake is its metadata: no bits, grad history or nesting."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout is torch.strided
        and not _history_refused(t)
        and t.is_leaf
        and not t.is_nested
        and not t.is_quantized
        and not t.is_inference()
        and not t.is_conj()
        and not t.is_neg()
        and t.grad is None
    )


def _fills_storage(t: torch.Tensor) -> bool:
    """Not a view, at offset 0, and as many bytes as its storage holds (a storage resized
    to nothing, as FSDP2's unsharded parameters are between steps, is not)."""
    if not _plain(t) or t._base is not None or t.storage_offset() != 0 or t.numel() == 0:
        return False
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() == extent * t.element_size()


@contextlib.contextmanager
def _untraced():
    """No torch function or dispatch mode of the trace sees a conversion: converting a view
    replays its view op on its base's fake, and a real tensor met while tracing (a
    closed-over DTensor's unevenly sized shard, a view of a padded buffer) is converted
    with the trace's modes active; recorded, that op would give a proxy for a fake."""
    with torch._C.DisableTorchFunction(), dispatch_modes_off():
        yield
