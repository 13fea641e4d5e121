"""Comparing compiled results with eager DTensor's, shared by the multi-process tests."""

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

import dtcompile


def waited(t):
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def assert_same(got, expected, where=""):
    """Eager's type, placements and mesh, global and local shapes and strides, values."""
    assert (got is None) == (expected is None), (where, got, expected)
    if expected is None:
        return
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
        local, expected_local = got._local_tensor, waited(expected._local_tensor)
        assert local.shape == expected_local.shape and local.stride() == expected_local.stride(), (
            where,
            local.shape,
            expected_local.shape,
            local.stride(),
            expected_local.stride(),
        )
        torch.testing.assert_close(got.full_tensor(), expected.full_tensor(), msg=lambda m: f"{where}: {m}")
    elif isinstance(expected, torch.Tensor):
        expected = waited(expected)
        assert type(got) is torch.Tensor, (where, type(got))
        assert got.shape == expected.shape and got.stride() == expected.stride(), (
            where,
            got.shape,
            expected.shape,
            got.stride(),
            expected.stride(),
        )
        torch.testing.assert_close(got, expected, msg=lambda m: f"{where}: {m}")
    else:  # sizes, numbers
        assert type(got) is type(expected) and got == expected, (where, got, expected)


def assert_all_same(got, expected, where=""):
    got_leaves, got_spec = tree_flatten(got)
    expected_leaves, expected_spec = tree_flatten(expected)
    assert got_spec == expected_spec, (where, got_spec, expected_spec)
    for i, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
        assert_same(g, e, f"{where}, output {i}")


def assert_same_grads(compiled_model, eager_model, where=""):
    got, expected = dict(compiled_model.named_parameters()), dict(eager_model.named_parameters())
    assert list(got) == list(expected)
    for name in expected:
        assert_same(got[name].grad, expected[name].grad, f"{where}: gradient of {name}")


def counts(jitted):
    return dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)


def rank_data(*shape, seed):
    """Data that differs between ranks (a local tensor for ``DTensor.from_local``)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * seed + dist.get_rank()))


def data(*shape, seed):
    """The same data on every rank (what ``distribute_tensor`` expects)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
