"""``max_pool1d`` laid out as eager lays it out. Its C++ code takes a fast path of its own
on CPU, for a tensor that needs no gradient and is not a tensor subclass, which makes a
contiguous result; for a traced tensor (a subclass) it takes ``max_pool1d_with_indices``,
whose result follows the input's layout: a transposed input (``F.max_pool1d(h.transpose(1,
2), 2)``) gave a transposed result where eager's is contiguous. While tracing, a Python
kernel of its own takes the same path, then makes the result contiguous where eager's fast
path would have run."""

from __future__ import annotations

import contextlib

import torch

from ..core.proxy import contiguous_strides
from ..core.symbolic import known_shape_equal

_MAX_POOL1D = torch.ops.aten.max_pool1d.default
_KEY = torch._C.DispatchKey.CompositeImplicitAutograd


def _as_eager(input, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    out = torch.ops.aten.max_pool1d_with_indices(input, kernel_size, stride, padding, dilation, ceil_mode)[0]
    fast_path = input.device.type == "cpu" and not (input.requires_grad and torch.is_grad_enabled())
    if not fast_path or type(input) is torch.distributed.tensor.DTensor:
        return out
    out, strides = out.contiguous(), contiguous_strides(out.shape)  # (eager's: a fresh tensor's)
    return out if known_shape_equal(out.stride(), strides) else out.as_strided(out.shape, strides)


@contextlib.contextmanager
def eager_max_pool1d():
    """While tracing, ``max_pool1d`` records the ops that lay its result out as eager's."""
    before = _MAX_POOL1D.py_kernels.get(_KEY)
    _MAX_POOL1D.py_kernels[_KEY] = _as_eager
    _MAX_POOL1D._dispatch_cache.clear()
    try:
        yield
    finally:
        if before is None:
            _MAX_POOL1D.py_kernels.pop(_KEY, None)
        else:
            _MAX_POOL1D.py_kernels[_KEY] = before
        _MAX_POOL1D._dispatch_cache.clear()
