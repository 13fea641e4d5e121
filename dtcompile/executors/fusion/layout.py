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

# What a size read from tensor data stands for in layout decisions (which do not depend on
# the sizes' values, only on their being larger than 1).
UNKNOWN = 8192


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
    shape = [size_hint(s, UNKNOWN) for s in shape]
    stride = [size_hint(s, UNKNOWN) for s in stride]
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


def tensor_descriptor(shape, stride) -> tuple[tuple[bool | None, ...], tuple[int, ...]]:
    """nvFuser's description of a strided input: ``(contiguity, stride_order)``.

    Dims are put in memory order (largest stride first; stride-0 dims keep their place),
    which is the order nvFuser reads ``contiguity`` in: per position, None for a broadcast
    (size 1 or stride 0), else whether the next non-broadcast position inside it starts
    where it ends (the innermost: whether its stride is 1). ``stride_order`` gives each
    logical dim its rank from the innermost position."""
    shape = [size_hint(s, UNKNOWN) for s in shape]
    stride = [size_hint(s, UNKNOWN) for s in stride]
    rank = len(shape)
    order = sorted((d for d in range(rank) if stride[d] != 0), key=lambda d: -stride[d])
    for d in range(rank):
        if stride[d] == 0:
            order.insert(d, d)
    broadcast = [shape[d] == 1 or stride[d] == 0 for d in order]
    flags: list[bool | None] = [None] * rank
    for position, d in enumerate(order):
        if broadcast[position]:
            continue
        inner = next((order[i] for i in range(position + 1, rank) if not broadcast[i]), None)
        flags[position] = stride[d] == (1 if inner is None else stride[inner] * shape[inner])
    ranks = [0] * rank
    for position, d in enumerate(order):
        ranks[d] = rank - 1 - position
    return tuple(flags), tuple(ranks)


def in_layout(tensor: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``tensor``, or a copy of it laid out densely in ``order`` when its strides differ."""
    expected = dense_strides(tensor.shape, order)
    if tensor.stride() == expected:
        return tensor
    out = torch.empty_permuted(tensor.shape, order, dtype=tensor.dtype, device=tensor.device)
    return out.copy_(tensor)
