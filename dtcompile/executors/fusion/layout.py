"""Memory layouts of fusion inputs and outputs, described as nvFuser describes them.

A dense layout is a permutation of the dims, outermost first: the innermost dim has
stride 1 and each other dim the product of the sizes inside it. nvFuser calls the same
thing a *stride order* (per dim, its rank from the innermost: a row-major 3-D tensor is
``(2, 1, 0)``). A fusion writes its outputs in such a layout; the traced strides say
which one eager would have used, size-1 dims included, so the fused program reproduces
them exactly.
"""

from __future__ import annotations

import torch

from ...core.symbolic import size_hint


def dense_strides(shape, order) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` laid out in ``order`` (outermost first)."""
    strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


def dense_order(shape, stride) -> tuple[int, ...] | None:
    """The dim order (outermost first) whose dense strides are exactly ``stride``, or None
    for a layout that is not dense (expanded, sliced, overlapping). Traced values are used
    for symbolic sizes: a dense layout's order does not depend on them."""
    shape = [size_hint(s) for s in shape]
    stride = [size_hint(s) for s in stride]
    dims = range(len(shape))
    # Size-1 dims tie with their neighbours; eager puts them where its kernel did, so try
    # both tie-breaks.
    for tie in (lambda d: -d, lambda d: d):
        order = tuple(sorted(dims, key=lambda d: (-stride[d], tie(d))))
        if dense_strides(shape, order) == tuple(stride):
            return order
    return None


def stride_order(order) -> tuple[int, ...]:
    """nvFuser's stride order of a dim order: for each dim, its rank from the innermost."""
    ranks = [0] * len(order)
    for position, dim in enumerate(order):
        ranks[dim] = len(order) - 1 - position
    return tuple(ranks)


def contiguity(shape, stride) -> tuple[bool | None, ...]:
    """nvFuser's contiguity of a strided tensor: per dim, None for a broadcast (size 1),
    else whether the next inner non-broadcast dim's memory follows it without a gap."""
    shape = [size_hint(s) for s in shape]
    stride = [size_hint(s) for s in stride]
    flags: list[bool | None] = [None] * len(shape)
    inner_extent = 1  # the extent the next dim outwards must step over to be contiguous
    for dim in sorted(range(len(shape)), key=lambda d: (stride[d], -d)):
        if shape[dim] == 1:
            continue
        flags[dim] = stride[dim] == inner_extent
        inner_extent = stride[dim] * shape[dim]
    return tuple(flags)


def in_layout(tensor: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``tensor``, or a copy of it laid out densely in ``order`` when its strides differ."""
    expected = dense_strides(tensor.shape, order)
    if tensor.stride() == expected:
        return tensor
    out = torch.empty_permuted(tensor.shape, order, dtype=tensor.dtype, device=tensor.device)
    return out.copy_(tensor)
