"""Eager's strides where the fake mode's differ.

- A reshaping view: the fake mode's reshape (the Python reference, under the Python
  dispatcher) keeps a same-shaped source's strides, where eager's kernel computes them
  anew: the stride of a dim of size 1 is free, and eager gives it its own.
- A constant pad by sizes that are symbolic: eager's kernel returns a clone of the input
  (in its layout: a transposed input stays transposed) where no pad is positive, and a
  tensor in the input's suggested memory format otherwise; the fake mode's meta, not to
  specialize, takes the second for any symbolic pad. The branch is taken here as eager's
  kernel takes it, on the traced sizes, and so guarded (``n % 4`` padded to a multiple of
  4 is 0 at some lengths).
- Batch norm on CPU: its kernels (forward and backward) give an output contiguous in the
  input's suggested memory format (channels-last for a channels-last 4-D or 5-D input,
  else row-major), where the fake mode keeps the input's strides (a transposed input).

Strides are part of what a trace promises (passes drop a view whose result has its
source's strides, a later ``view`` needs them), so the recorder and the type check both
take eager's.
"""

from __future__ import annotations

import torch
from torch._dispatch.python import no_python_dispatcher

from .symbol import leaves
from .symbolic import is_symbolic, known_equal, size_hint, symbolic_expr
from .torch_internals import dispatch_modes_off, fake_in_storage

_RESHAPING_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


_BATCH_NORM_BACKWARD = torch.ops.aten.native_batch_norm_backward.default  # its input: the second argument
_BATCH_NORMS = frozenset(
    getattr(packet, overload)
    for packet in (
        torch.ops.aten.native_batch_norm,
        torch.ops.aten._native_batch_norm_legit,  # ``no_stats`` too: training without running stats
        torch.ops.aten._native_batch_norm_legit_no_training,
        torch.ops.aten._native_batch_norm_legit_functional,
    )
    for overload in packet.overloads()
    if overload != "out"
) | {_BATCH_NORM_BACKWARD}


def with_eager_strides(fake_mode, func, fake_args: tuple, fake_out):
    """``fake_out`` with the strides eager's kernel gives it (see the module docstring)."""
    if func in _BATCH_NORMS:
        return _batch_norm_strides(fake_mode, fake_args[1 if func is _BATCH_NORM_BACKWARD else 0], fake_out)
    if func is _CONSTANT_PAD and any(isinstance(p, torch.SymInt) for p in fake_args[1]):
        return _constant_pad_strides(fake_mode, fake_args[0], fake_args[1], fake_out)
    return with_eager_view_strides(fake_mode, func, fake_args, fake_out)


def _batch_norm_strides(fake_mode, source, fake_out):
    """Batch norm's first output, contiguous in the suggested memory format of ``source``
    (its input; the backward's input), on CPU."""
    out = fake_out[0]
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        return fake_out
    format = torch.contiguous_format
    if source.dim() in (4, 5) and source.is_contiguous(memory_format=_CHANNELS_LAST[source.dim()]):
        format = _CHANNELS_LAST[source.dim()]
    if out.is_contiguous(memory_format=format):
        return fake_out
    with fake_mode:
        eager = torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=format)
    return (eager.requires_grad_(out.requires_grad) if out.requires_grad else eager, *fake_out[1:])


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}

_CONSTANT_PAD = torch.ops.aten.constant_pad_nd.default


def _constant_pad_strides(fake_mode, source, pad, fake_out):
    """A constant pad with symbolic pads: where none is positive (a branch on the sizes,
    guarded), eager's kernel returns a clone of the input narrowed by the negative pads."""
    if not all(p <= 0 for p in pad):  # (as eager's kernel asks: the first positive pad decides)
        return fake_out
    with fake_mode, torch._C.DisableTorchFunction(), no_python_dispatcher(), torch.no_grad():
        narrowed = source.detach()
        rank = source.dim()
        for i in range(rank - len(pad) // 2, rank):
            before, after = pad[2 * (rank - i - 1)], pad[2 * (rank - i - 1) + 1]
            narrowed = narrowed.narrow(i, -before, narrowed.shape[i] + before)
            narrowed = narrowed.narrow(i, 0, narrowed.shape[i] + after)
        stride = narrowed.clone().stride()
        if all(known_equal(a, b) for a, b in zip(stride, fake_out.stride())):
            return fake_out
        fake = fake_out.detach().as_strided(fake_out.shape, stride, fake_out.storage_offset())
    return fake.requires_grad_(fake_out.requires_grad) if fake_out.requires_grad else fake


def with_eager_view_strides(fake_mode, func, fake_args: tuple, fake_out):
    """``fake_out`` with the strides eager's kernel gives a view (a reshape). The fake
    mode's reshape keeps a same-shaped source's strides, where eager computes them anew:
    a ``[1, 3]`` slice of a ``[1, 4]`` tensor, viewed as ``[1, 3]``, has strides ``(4, 1)``
    as a fake and ``(3, 1)`` in eager (the stride of a dim of size 1 is free). Computed
    on a meta tensor where every size is known."""
    if func not in _RESHAPING_VIEWS or not isinstance(fake_out, torch.Tensor):
        return fake_out
    source = fake_args[0]
    metadata = (*source.shape, *source.stride(), source.storage_offset(), *leaves(fake_args[1:]))
    if any(is_symbolic(x) or isinstance(x, torch.SymInt) for x in metadata):
        return _symbolic_size_one_strides(fake_mode, func, fake_args, fake_out)
    # Plain meta tensors, through the C++ kernels (the Python dispatcher's reshape is the fake's).
    with torch._C.DisableTorchFunction(), dispatch_modes_off(), no_python_dispatcher():
        meta = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device="meta")
        eager = func(meta, *fake_args[1:])
        if eager.stride() == fake_out.stride():
            return fake_out
        like = torch.empty_strided(eager.shape, eager.stride(), dtype=eager.dtype, device="meta")
        like = like.as_strided(eager.shape, eager.stride(), fake_out.storage_offset())
    fake = fake_in_storage(fake_mode, like, fake_out)
    return fake.requires_grad_(fake_out.requires_grad) if fake_out.requires_grad else fake


def _symbolic_size_one_strides(fake_mode, func, fake_args: tuple, fake_out):
    """Under symbolic sizes: eager's kernel gives a dim of size 1 the stride of the dims
    inside it (the next dim's stride times its size; ``matmul`` folds a ``[b, 1, k]`` input
    into one ``mm`` only then), where the fake keeps the source's. Taken where eager's
    kernel, run on the traced sizes, gives the same."""
    shape, stride = list(fake_out.shape), list(fake_out.stride())
    for i in range(len(shape) - 2, -1, -1):
        if symbolic_expr(shape[i]) == 1:
            stride[i] = stride[i + 1] * shape[i + 1]
    if all(known_equal(a, b) for a, b in zip(stride, fake_out.stride())):
        return fake_out
    hints = [size_hint(x) for x in (*fake_args[0].shape, *fake_args[0].stride(), *shape, *stride)]
    args = [size_hint(x) if isinstance(x, torch.SymInt) else x for x in fake_args[1]] if len(fake_args) > 1 else None
    if any(h is None for h in hints) or args is None or any(a is None for a in args):
        return fake_out
    rank = fake_args[0].dim()
    with torch._C.DisableTorchFunction(), dispatch_modes_off(), no_python_dispatcher():
        meta = torch.empty_strided(hints[:rank], hints[rank : 2 * rank], dtype=fake_out.dtype, device="meta")
        eager = func(meta, args, *fake_args[2:])
    if list(eager.stride()) != hints[2 * rank + len(shape) :]:
        return fake_out
    with fake_mode, torch._C.DisableTorchFunction(), no_python_dispatcher(), torch.no_grad():
        fake = fake_out.detach().as_strided(shape, stride, fake_out.storage_offset())
    return fake.requires_grad_(fake_out.requires_grad) if fake_out.requires_grad else fake
