"""Upsampling recorded as eager runs it. Under its Python dispatcher, which tracing runs,
torch gives the upsampling ops Python kernels above autograd that decompose them into
index arithmetic (``arange``, ``_unsafe_index``): bilinear and bicubic results then differ
from the native kernel's in the last bits, and a 1x1 result of a channels_last input is
laid out otherwise. While tracing, those kernels are wrapped (docs/design.md, "Upsampling
as eager runs it")."""

from __future__ import annotations

import contextlib

import torch

_UPSAMPLING_KEYS = (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd)
_UPSAMPLING: list = []  # (op, key, torch's Python kernel), found at the first trace


def _upsampling_decomposed() -> list:
    """The upsampling ops to which torch adds, under its Python dispatcher (which tracing
    runs), a decomposition of its own above autograd (``arange``, ``_unsafe_index``,
    arithmetic): it rounds otherwise than eager's native kernel (bilinear, bicubic) and
    lays a 1x1 result of a channels_last input out otherwise."""
    import torch._decomp  # noqa: F401 (it registers them)

    found = []
    for name in dir(torch.ops.aten):
        if "upsample" in name and not name.endswith("_backward"):
            packet = getattr(torch.ops.aten, name)
            for op in (getattr(packet, overload) for overload in packet.overloads()):  # (the ones cached)
                found += [(op, key, op.py_kernels[key]) for key in _UPSAMPLING_KEYS if key in op.py_kernels]
    return found


def _set_upsampling(kernels) -> None:
    for (op, key, _), kernel in zip(_UPSAMPLING, kernels):
        if kernel is None:
            op.py_kernels.pop(key, None)
        else:
            op.py_kernels[key] = kernel
        op._dispatch_cache.clear()


def _native_where_sizes_are_numbers(op, decomposed):
    """Upsampling to an output size of numbers, or by scale factors: torch's C++ kernels,
    which record the native op (eager's); to a symbolic output size, which its C++
    kernels do not take, torch's decomposition."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    def kernel(input, output_size, *rest):
        if not all(map(is_concrete_int, output_size or ())):  # (by scale factors: computed in C++)
            return decomposed(input, output_size, *rest)
        wrapped = [k for _, _, k in _UPSAMPLING_NOW]
        _set_upsampling([None] * len(_UPSAMPLING))
        try:
            return op(input, output_size, *rest)
        finally:
            _set_upsampling(wrapped)

    return kernel


_UPSAMPLING_NOW: list = []


@contextlib.contextmanager
def native_upsampling():
    """While tracing, upsampling records eager's native op where its sizes are numbers
    (:func:`_native_where_sizes_are_numbers`)."""
    if not _UPSAMPLING:
        _UPSAMPLING[:] = _upsampling_decomposed()
    _UPSAMPLING_NOW[:] = [(op, key, _native_where_sizes_are_numbers(op, k)) for op, key, k in _UPSAMPLING]
    _set_upsampling([k for _, _, k in _UPSAMPLING_NOW])
    try:
        yield
    finally:
        _set_upsampling([k for _, _, k in _UPSAMPLING])
