"""Comparing a compiled call's results with eager's: the one helper the tests share.

``assert_same`` holds a result to eager's: the same type (DTensor, tensor, container,
constant), for a DTensor the same placements, mesh, global and local shapes and strides
and values, for a tensor the same dtype, shape, strides and values (to float rounding:
some passes add in another order), for containers the same keys and items.
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten


def waited(t):
    """An eager collective's result, waited for."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _same_layout(got: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    assert got.dtype == expected.dtype, (where, got.dtype, expected.dtype)
    bits = (got.is_conj(), got.is_neg()), (expected.is_conj(), expected.is_neg())
    assert bits[0] == bits[1], (where, "conjugate and negative bits", *bits)
    assert got.shape == expected.shape and got.stride() == expected.stride(), (
        where,
        got.shape,
        expected.shape,
        got.stride(),
        expected.stride(),
    )


def assert_same(got, expected, where: str = "", **tolerance) -> None:
    """``got`` is eager's ``expected`` (see the module docstring); ``tolerance`` (``atol``,
    ``rtol``) loosens the comparison of values, for executors that reorder float sums."""
    if isinstance(expected, DTensor):
        assert type(got) is DTensor, (where, type(got))
        assert got.placements == expected.placements, (where, got.placements, expected.placements)
        assert got.device_mesh == expected.device_mesh, where
        assert got.shape == expected.shape and got.stride() == expected.stride(), (
            where,
            got.shape,
            expected.shape,
            got.stride(),
            expected.stride(),
        )
        # Local values may differ where eager's do between runs (a Partial's parts): the
        # local layout is compared, and the values of the whole tensor.
        _same_layout(got._local_tensor, waited(expected._local_tensor), f"{where} (local tensor)")
        torch.testing.assert_close(
            got.full_tensor(), expected.full_tensor(), msg=lambda m: f"{where}: {m}", **tolerance
        )
        return
    if isinstance(expected, torch.Tensor):
        expected = waited(expected)
        assert type(got) is type(expected), (where, type(got), type(expected))
        _same_layout(got, expected, where)
        torch.testing.assert_close(got, expected, msg=lambda m: f"{where}: {m}", **tolerance)
        return
    assert type(got) is type(expected), (where, type(got), type(expected))
    if isinstance(expected, (tuple, list)):
        assert len(got) == len(expected), (where, len(got), len(expected))
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{where}[{i}]", **tolerance)
    elif isinstance(expected, dict):
        assert list(got) == list(expected), (where, list(got), list(expected))
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]", **tolerance)
    else:  # sizes, numbers, strings, None
        assert got == expected, (where, got, expected)


def assert_all_same(got, expected, where: str = "") -> None:
    """The same pytree (namedtuples, ``ModelOutput``s included), leaf by leaf."""
    got_leaves, got_spec = tree_flatten(got)
    expected_leaves, expected_spec = tree_flatten(expected)
    assert got_spec == expected_spec, (where, got_spec, expected_spec)
    for i, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
        assert_same(g, e, f"{where}, output {i}")
