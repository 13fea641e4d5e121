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
- A fresh result whose layout the fake mode's reference computes otherwise than eager's
  kernel: an elementwise op (``x // y``, ``copysign``, ``xlogy`` of a transposed ``x``)
  laid out as its operands are, by TensorIterator's rule (torch's
  ``compute_elementwise_output_strides``), where the reference composes other ops; and
  ops whose kernel makes a row-major result (``log_sigmoid``, ``isin``, ``rrelu``, a
  complex ``angle``) or one in the input's suggested memory format (``roll``). Only where
  every size is known (under symbolic sizes the fake's stand: README).
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
from torch._prims_common import compute_elementwise_output_strides, suggest_memory_format

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
    if func in _ROW_MAJOR or func in _SUGGESTED or func in _ELEMENTWISE:
        return _fresh_result_strides(fake_mode, func, fake_args, fake_out)
    return with_eager_view_strides(fake_mode, func, fake_args, fake_out)


def _overloads(*packets) -> frozenset:
    """The overloads of ``packets`` that return fresh tensors (not ``out=``'s, nor in place)."""
    found = (getattr(p, o) for p in packets for o in p.overloads())
    return frozenset(op for op in found if not any(r.alias_info is not None for r in op._schema.returns))


aten = torch.ops.aten
# Ops whose eager kernel lays out a fresh result otherwise than the fake mode's reference.
_ROW_MAJOR = _overloads(aten.log_sigmoid_forward, aten.isin, aten.rrelu_with_noise, aten.angle)
_SUGGESTED = _overloads(aten.roll)  # (in the input's suggested memory format)
_ELEMENTWISE = _overloads(aten.floor_divide, aten.copysign, aten.xlogy, aten.special_xlog1py, aten.special_xlogy)
_ELEMENTWISE |= frozenset(o for o in _overloads(aten.div) if "mode" in o._overloadname)  # (rounding modes)


def _fresh_result_strides(fake_mode, func, fake_args: tuple, fake_out):
    """A fresh result's strides as eager's kernel lays it out (see the module docstring)."""
    out = fake_out[0] if isinstance(fake_out, tuple) else fake_out
    tensors = [a for a in fake_args if isinstance(a, torch.Tensor)]
    if not isinstance(out, torch.Tensor) or not tensors or out._is_view():
        return fake_out
    if func not in _ELEMENTWISE and out.device.type != "cpu":  # (TensorIterator's rule holds on any device)
        return fake_out
    hints = [[size_hint(x) for x in (*t.shape, *t.stride())] for t in (*tensors, out)]
    if any(h is None for sizes in hints for h in sizes):
        return fake_out
    rank = [t.dim() for t in (*tensors, out)]
    shapes = [h[:n] for h, n in zip(hints, rank)]
    with torch._C.DisableTorchFunction(), dispatch_modes_off(), no_python_dispatcher():
        metas = [
            torch.empty_strided(h[:n], h[n:], dtype=t.dtype, device="meta") for h, n, t in zip(hints, rank, tensors)
        ]
        if func in _ROW_MAJOR and not (func.overloadpacket is aten.angle and not metas[0].is_complex()):
            stride = torch.empty(shapes[-1], device="meta").stride()  # (a real angle is elementwise)
        elif func in _SUGGESTED:
            stride = torch.empty(shapes[-1], device="meta", memory_format=suggest_memory_format(metas[0])).stride()
        else:
            try:
                broadcast = torch.broadcast_tensors(*metas)
            except RuntimeError:
                return fake_out
            if list(broadcast[0].shape) != shapes[-1]:
                return fake_out
            stride = tuple(compute_elementwise_output_strides(*broadcast))
    if list(stride) == hints[-1][rank[-1] :]:
        return fake_out
    symbolic = _dense_strides(list(out.shape), stride)  # (under symbolic sizes: their expressions)
    if [size_hint(x) for x in symbolic] != list(stride):
        return fake_out
    with fake_mode, torch._C.DisableTorchFunction(), no_python_dispatcher(), torch.no_grad():
        fake = out.detach().as_strided(out.shape, symbolic, out.storage_offset())
    fake = fake.requires_grad_(out.requires_grad) if out.requires_grad else fake
    return (fake, *fake_out[1:]) if isinstance(fake_out, tuple) else fake


def _dense_strides(shape: list, traced: tuple) -> list:
    """Dense strides of ``shape`` in the order of the ``traced`` strides, innermost first."""
    order = sorted(range(len(shape)), key=lambda d: (traced[d], -d))
    strides, step = [0] * len(shape), 1
    for d in order:
        strides[d] = step
        step = step * shape[d]
    return strides


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
