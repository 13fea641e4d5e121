"""Eager's paths for ops whose path for a traced tensor (a tensor subclass, under the
Python dispatcher tracing runs) differs from eager's, while tracing (:func:`eager_paths`):

- Ops whose Python kernels (``torch._decomp``) run instead of eager's C++ ones and compute
  otherwise, set aside (no public API turns one off), so that eager's kernel is recorded:
  ``aten.dropout`` becomes ``native_dropout`` (its scale applied after the mask, one
  rounding apart from eager's CPU composite); ``multilabel_margin_loss``'s forward does not
  stop at a target's first -1. (``aten.matmul``'s Python form folds ``vector @ batched
  matrix`` otherwise than eager's, 1e-7 apart; eager's C++ kernel cannot take symbolic
  sizes on torch 2.10, so it stays.)
- ``matmul``'s Python form decides whether to fold a 3-D operand into ``view`` and ``mm``
  otherwise than eager's C++ test of its leading dims (``x[:, 0:1]``, ``x[..., :4]``): its
  test is made eager's while inside (bits apart otherwise).
- Kernels of ours: ``max_pool1d``'s C++ code takes a CPU fast path with a contiguous result
  for a tensor that needs no gradient and is not a subclass, and ``max_pool1d_with_indices``
  otherwise, whose result follows the input's layout (a transposed input's was transposed):
  ours takes the second and lays the result out as eager's fast path does, where it runs.
  ``multilabel_margin_loss``'s forward and backward get fake kernels of eager's sizes
  (torch's meta decomposition gives a 1-D input's unreduced loss the shape (1,); its
  backward has none).

Each is put in (or taken out of) the op's table of Python kernels while inside, and put
back after."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from .proxy import contiguous_strides
from .symbolic import known_shape_equal

_KEYS = torch._C.DispatchKey
aten = torch.ops.aten


def _max_pool1d(input, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    out = aten.max_pool1d_with_indices(input, kernel_size, stride, padding, dilation, ceil_mode)[0]
    fast_path = input.device.type == "cpu" and not (input.requires_grad and torch.is_grad_enabled())
    if not fast_path or type(input) is DTensor:
        return out
    if not input.dtype.is_floating_point:  # (the fast path's kernel is for floats)
        name = _C10_NAMES.get(input.dtype, str(input.dtype))
        raise NotImplementedError(f"\"max_pool1d_impl\" not implemented for '{name}'")
    out, strides = out.contiguous(), contiguous_strides(out.shape)  # (eager's: a fresh tensor's)
    return out if known_shape_equal(out.stride(), strides) else out.as_strided(out.shape, strides)


_C10_NAMES = {
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def _should_fold(tensor1, tensor2, is_out: bool) -> bool:
    """Whether ``matmul`` folds its larger operand into a matrix (``view`` and ``mm``) rather
    than taking ``bmm``, as eager's C++ decides where the first operand is the larger: it
    tests only the leading dims (``stride[i] == stride[i + 1] * size[i + 1]``), where torch's
    Python form asks a row-major operand, skipping dims of size 1. Eager's folds
    ``x[..., :4]`` and takes ``bmm`` for ``x[:, 0:1]`` of strides ``(32, 16, 1)``; torch's
    Python form does the opposite of each (bits apart)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    if tensor1.ndim < tensor2.ndim or not (tensor1.ndim >= 3 and tensor2.ndim <= 2):
        return _torch_should_fold(tensor1, tensor2, is_out)
    if (tensor2.requires_grad and not is_out) or guard_or_false(tensor1.numel() == 0):
        return True
    shape, strides = tensor1.shape, tensor1.stride()
    return all(guard_or_false(strides[i] == strides[i + 1] * shape[i + 1]) for i in range(tensor1.ndim - 2))


_torch_should_fold = torch._decomp.decompositions.should_fold


def _multilabel_forward(input, target, reduction):
    unreduced = reduction == 0 and target.dim() > 1  # (Reduction::None)
    output = input.new_empty((input.shape[0],) if unreduced else ())
    return output, input.new_empty(target.shape)


def _multilabel_backward(grad_output, input, target, reduction, is_target):
    return input.new_empty(input.shape)


_KERNELS = [
    (aten.max_pool1d.default, _KEYS.CompositeImplicitAutograd, _max_pool1d),
    (aten.multilabel_margin_loss_forward.default, _KEYS.Meta, _multilabel_forward),
    (aten.multilabel_margin_loss_backward.default, _KEYS.Meta, _multilabel_backward),
]


_DECOMPOSITIONS_SET_ASIDE = (aten.dropout.default, aten.multilabel_margin_loss_forward.default)
_SET_ASIDE = (_KEYS.Autograd, _KEYS.CompositeImplicitAutograd)


@contextlib.contextmanager
def eager_paths():
    """While inside, the ops above run as the module docstring says. A fake kernel of ours
    goes in torch's table of Python meta kernels too, which fake tensors prefer to torch's
    decompositions."""
    from torch._decomp import meta_table

    set_aside = []
    for op in _DECOMPOSITIONS_SET_ASIDE:
        set_aside += [(op, key, op.py_kernels.pop(key)) for key in _SET_ASIDE if key in op.py_kernels]
        op._dispatch_cache.clear()
    before = [op.py_kernels.get(key) for op, key, _ in _KERNELS]
    metas = {op: meta_table.get(op) for op, key, _ in _KERNELS if key == _KEYS.Meta}
    for op, key, kernel in _KERNELS:
        op.py_kernels[key] = kernel
        op._dispatch_cache.clear()
        if key == _KEYS.Meta:
            meta_table[op] = kernel
    decompositions = torch._decomp.decompositions
    should_fold, decompositions.should_fold = decompositions.should_fold, _should_fold
    try:
        yield
    finally:
        decompositions.should_fold = should_fold
        for (op, key, _), kernel in zip(_KERNELS, before):
            _put_back(op.py_kernels, key, kernel)
            op._dispatch_cache.clear()
        for op, kernel in metas.items():
            _put_back(meta_table, op, kernel)
        for op, key, kernel in set_aside:
            op.py_kernels[key] = kernel
            op._dispatch_cache.clear()


def _put_back(table: dict, key, value) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value
