"""Comparing compiled results with eager DTensor's, shared by the multi-process tests."""

import torch
import torch.distributed as dist

import dtcompile
from dtcompile.testing.compare import assert_all_same, assert_same, waited  # noqa: F401  (shared)


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
