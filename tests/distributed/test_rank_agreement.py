"""What the ranks must agree on, and only that: programs that differ between ranks in
what cannot hang them compile and match eager (on 4 ranks, the 2x2 mesh's two groups of
a mesh dim may hold different sizes; one rank's sizes may specialize while tracing where
a peer's stay symbolic). And DTensors a compiled call returns are the caller's to use;
a sharding DTensor cannot propagate with symbolic sizes is traced with its sizes."""

import os

import pytest
import torch
import torch.distributed as dist
from checks import assert_all_same, data, rank_data
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import dtcompile

CACHES = ["constant values", "symbolic values"]


def _mixed(x, y):
    a, b = x + y, y + x
    return a, b, a.full_tensor(), b.full_tensor(), x.sum(0), y.sum(0)


def partial_on_one_dim_shard_on_the_other(cache):
    """``[Partial, Shard(0)] + [Shard(0), Partial]`` on a 2x2 mesh, as the sizes change."""
    mesh = init_device_mesh("cpu", (2, 2))
    jitted = dtcompile.jit(_mixed, cache=cache)
    for step, rows in enumerate((2, 4, 2, 6)):
        x = DTensor.from_local(rank_data(rows, 4, seed=step), mesh, [Partial(), Shard(0)])
        y = DTensor.from_local(rank_data(rows, 4, seed=10 + step), mesh, [Shard(0), Partial()])
        with torch.no_grad():
            assert_all_same(jitted(x, y), _mixed(x, y), f"{rows} rows, {cache}")
    return dtcompile.cache_misses(jitted) >= 1


@pytest.mark.parametrize("cache", CACHES)
def test_partial_on_one_dim_shard_on_the_other_matches_eager(cache, ranks4):
    assert all(ranks4.run(partial_on_one_dim_shard_on_the_other, cache))


def _uneven_groups(x):
    return x.full_tensor(), x.redistribute(x.device_mesh, [Shard(0), Replicate()]) * 2


def groups_of_one_dim_with_different_sizes(cache):
    """Rows split 3 and 2 over the first mesh dim, then 2, 1 and 1, 1 over the second: the
    two groups of the second dim gather different sizes, each group agreeing within."""
    mesh = init_device_mesh("cpu", (2, 2))
    jitted = dtcompile.jit(_uneven_groups, cache=cache)
    for step, rows in enumerate((5, 7, 9)):
        x = distribute_tensor(data(rows, 3, seed=step), mesh, [Shard(0), Shard(0)])
        with torch.no_grad():
            assert_all_same(jitted(x), _uneven_groups(x), f"{rows} rows, {cache}")
    return True


@pytest.mark.parametrize("cache", CACHES)
def test_groups_of_one_mesh_dim_may_gather_different_sizes(cache, ranks4):
    assert all(ranks4.run(groups_of_one_dim_with_different_sizes, cache))


def _replicated(x):
    return x.redistribute(x.device_mesh, [Replicate(), Replicate()])


def a_length_that_changes_some_groups_only(cache):
    """Rows 5 split 3, 2 over the first mesh dim and 6 split 3, 3: ranks 0 and 1 hold the
    same shards, and their programs the same collectives, while ranks 2 and 3 gather other
    sizes. Ranks 0 and 1 compiled "alone" (collectives as agreed) and skipped the meeting
    ranks 2 and 3 waited in: RankMismatchError after the sync timeout, then Gloo's abort.
    The DTensor input's global shape changed on every rank, so every rank meets."""
    os.environ["DTCOMPILE_SYNC_TIMEOUT"] = "30"  # (a failure here waits that long, not 120 s)
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        jitted = dtcompile.jit(_replicated, cache=cache)
        for step, rows in enumerate((5, 6, 5, 6, 7)):
            x = distribute_tensor(data(rows, 3, seed=step), mesh, [Shard(0), Shard(0)])
            with torch.no_grad():
                assert_all_same(jitted(x), _replicated(x), f"{rows} rows, {cache}")
        return dtcompile.cache_hits(jitted)
    finally:
        del os.environ["DTCOMPILE_SYNC_TIMEOUT"]


@pytest.mark.parametrize("cache", CACHES)
def test_a_length_that_changes_some_groups_collectives_only(cache, ranks4):
    hits = ranks4.run(a_length_that_changes_some_groups_only, cache)
    assert len(set(hits)) == 1 and hits[0] >= 2, hits


def _max_into(x, values, indices):
    torch.max(x, dim=1, out=(values, indices))
    return values, indices


def _add_into(x, out):
    torch.add(x, 1, out=out)
    return out * 2, out


def _sum_into(x, out):
    torch.sum(x, dim=1, out=out)
    return out


def out_arguments_returned(cache):
    """DTensors written by ``out=`` and returned: their specs are the caller's (sizes as
    ints, so DTensor can hash them when it redistributes), their values eager's."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    n = dist.get_world_size()
    cases = [
        (
            _max_into,
            lambda rows, seed: (data(rows, 3, seed=seed), torch.zeros(rows), torch.zeros(rows, dtype=torch.long)),
        ),
        (_add_into, lambda rows, seed: (data(rows, 3, seed=seed), torch.zeros(rows, 3))),
        (_sum_into, lambda rows, seed: (data(rows, 3, seed=seed), torch.zeros(rows))),
    ]
    for fn, make in cases:
        jitted = dtcompile.jit(fn, cache=cache)
        for step, rows in enumerate((2 * n, 4 * n, 2 * n)):
            eager_args, compiled_args = (
                [distribute_tensor(t, mesh, [Shard(0)]) for t in make(rows, step)] for _ in range(2)
            )
            with torch.no_grad():
                expected, got = fn(*eager_args), jitted(*compiled_args)
            where = f"{fn.__name__}, {rows} rows, {cache}"
            assert_all_same(got, expected, where)  # redistributes them: hashes their specs
            assert_all_same(compiled_args, eager_args, where)
            for out in got if isinstance(got, tuple) else (got,):
                hash(out._spec)
    return True


@pytest.mark.parametrize("cache", CACHES)
def test_out_arguments_returned_are_usable_dtensors(cache, ranks2):
    assert all(ranks2.run(out_arguments_returned, cache))


def _flattened(x):
    flat = x.flatten()  # over [Shard(0), Shard(1)]: a _StridedShard whose split factor is a size
    return flat * 2, (flat * 2).full_tensor(), flat.view(x.shape[0], -1) + 1


def flatten_of_two_shardings(placements):
    """DTensor refuses to propagate the flatten with a symbolic split factor; under
    symbolic values the call is traced again with its sizes as they are (one entry per
    size, guarded exactly), and gives eager's results."""
    mesh = init_device_mesh("cpu", (2, 2))
    jitted = dtcompile.jit(_flattened, cache="symbolic values")
    for step, n in enumerate((4, 8, 4, 12)):
        x = distribute_tensor(data(n, n, seed=step), mesh, placements)
        with torch.no_grad():
            assert_all_same(jitted(x), _flattened(x), f"{n}x{n}, {placements}")
    return dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)


@pytest.mark.parametrize("placements", [[Shard(0), Shard(1)], [Shard(1), Shard(0)]], ids=["S0S1", "S1S0"])
def test_a_sharding_dtensor_refuses_with_symbolic_sizes_is_traced_with_its_sizes(placements, ranks4):
    assert ranks4.run(flatten_of_two_shardings, placements) == [(3, 1)] * 4
