"""Values read from tensor data on Gloo ranks (issue 14, items 3 and 6): branches on a
DTensor's data, taken alike by all ranks; branches on each rank's own data; sizes read
from data that differ between ranks while the ranks' programs agree on their collectives."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from checks import assert_same
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dtcompile


def _branch(x):
    return x * 2 if (x > 0).all() else x - 1


def branch_on_dtensor_data(cache: str):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    jitted = dtcompile.jit(_branch, cache=cache)
    generator = torch.Generator().manual_seed(0)  # the same global tensor on every rank
    for sign in (1, -1, -1, 1, -1):
        x = distribute_tensor(sign * (torch.rand(4, 3, generator=generator) + 0.1), mesh, [Shard(0)])
        assert_same(jitted(x), _branch(x), f"sign {sign}")
    return dtcompile.cache_misses(jitted)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_branch_on_a_dtensors_data(ranks2, cache):
    assert ranks2.run(branch_on_dtensor_data, cache) == [2, 2]


def _equal(a, b):
    return a * 2 if torch.equal(a, b) else a - 1


def _allclose(a, b):
    return torch.allclose(a, b)


def dtensors_compared(cache: str):
    """``torch.equal`` of DTensors is every rank's answer (DTensor all-reduces them), also
    where only one rank's shards differ; ``allclose`` has no DTensor rule: eager's error."""
    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    jitted = dtcompile.jit(_equal, cache=cache)
    a = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    for differs_on in (None, 1, 0, None):
        local = torch.arange(8.0).reshape(4, 2)[2 * rank : 2 * rank + 2] + (1.0 if rank == differs_on else 0.0)
        b = DTensor.from_local(local, mesh, [Shard(0)])
        assert_same(jitted(a, b), _equal(a, b), f"differs on {differs_on}")
    with pytest.raises(RuntimeError, match="aten.allclose.default"):
        _allclose(a, a)
    with pytest.raises(RuntimeError, match="aten.allclose.default"):
        dtcompile.jit(_allclose, cache=cache)(a, a)
    return dtcompile.cache_misses(jitted)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_equal_of_dtensors_is_every_ranks_answer(ranks2, cache):
    assert ranks2.run(dtensors_compared, cache) == [2, 2]


def _local_branch_then_all_reduce(x):
    y = x.exp() if x.sum() > 0 else x.cos()  # each rank branches on its own data
    dist.all_reduce(y)
    return y


def _masked_sum_all_reduced(x):
    total = x[x > 0].sum(0)  # as many rows as this rank's data has: differs between ranks
    dist.all_reduce(total)
    return total


def per_rank_data():
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(10 + rank)
    results = []
    for fn in (_local_branch_then_all_reduce, _masked_sum_all_reduced):
        jitted = dtcompile.jit(fn)
        for step in range(3):
            # Rank 0 and rank 1 take different branches, and swap at each step.
            sign = 1 if (rank + step) % 2 == 0 else -1
            x = sign * (torch.rand(3, 2, generator=generator) + 0.1)
            assert_same(jitted(x.clone()), fn(x.clone()), f"{fn.__name__}, step {step}")
        results.append(dtcompile.cache_misses(jitted))
    return results


def test_branches_and_sizes_on_each_ranks_own_data(ranks2):
    # Both ranks meet both branches (two entries each); the masked sum compiles once.
    assert ranks2.run(per_rank_data) == [[2, 1], [2, 1]]


def _split_by_counts_a_collective_made(x):
    y = x.clone()
    dist.all_reduce(y)
    counts = torch.bincount(y.argmax(-1), minlength=4)
    return [piece * 1 for piece in x.split(counts.tolist())]


def _slice_by_a_bound_from_data(x, n):
    return x[:, : n.full_tensor().max().item()] + 1


def _max_all_reduce_beside_a_sum(x):
    return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1, funcol.all_reduce(x, "max", dist.group.WORLD)


def _branch_on_a_gathered_count(d):
    return d * 2 if d.full_tensor().nonzero().shape[0] > 5 else d + 1


def _branch_on_a_gathered_mask(d):
    full = d.full_tensor()
    return d if full[full > 0].shape[0] == 0 else d * 2


def refusals_name_the_call(cache: str):
    """What tracing cannot size or differentiate, refused naming the call, where torch's
    own error (or a misleading one) came before: a list whose length only a collective
    computes; a DTensor sliced by a bound read from data (DTensor sizes it under a fake
    mode of its own; ``narrow`` compiles); a max all-reduce's backward, which eager raises
    only where a backward reaches it."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(dtcompile.TracingError, match="Tensor.tolist depends on the values in a tensor .a list of u"):
        dtcompile.jit(_split_by_counts_a_collective_made, cache=cache)(x)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    n = distribute_tensor(torch.tensor([1, 2, 0, 3, 1, 2]), mesh, [Shard(0)])
    with pytest.raises(dtcompile.TracingError, match="of a DTensor with a bound read from tensor data.*narrow"):
        dtcompile.jit(_slice_by_a_bound_from_data, cache=cache)(dx, n)
    # A branch on a size a collective's result decides: it named no call, and said no branch
    # on such a size compiles (one on a plain tensor's does).
    for fn, call in ((_branch_on_a_gathered_count, "Tensor.nonzero"), (_branch_on_a_gathered_mask, "__getitem__")):
        with pytest.raises(dtcompile.TracingError, match=f"{call} depends on .* a collective's result decides"):
            dtcompile.jit(fn, cache=cache)(dx)
    with pytest.raises(RuntimeError, match="all_reduce backward only supports .* raised by the backward of the call"):
        dtcompile.jit(_max_all_reduce_beside_a_sum, cache=cache)(x.requires_grad_())
    with torch.no_grad():
        assert_same(dtcompile.jit(_max_all_reduce_beside_a_sum, cache=cache)(x), _max_all_reduce_beside_a_sum(x))
    return True


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_what_tracing_cannot_size_or_differentiate_is_refused_naming_the_call(ranks2, cache):
    assert ranks2.run(refusals_name_the_call, cache) == [True, True]


def _reduced_after_a_local_read(x):
    y = x.clone()
    s = y.sum()  # each rank's own data: the ranks' entries are cached in different orders
    dist.all_reduce(y)  # (writes what the branch's ops made, after they read it)
    return y if s > 0 else -y


def _reduced_beside_a_local_branch(x):
    w = x * 3
    dist.all_reduce(w)
    return w + 1 if x.sum() > 0 else w - 1


def _reduced_then_read_with_local_data(x):
    y = x.clone()
    dist.all_reduce(y)
    return y if (y.sum() + 10 * x.sum()) > 0 else -y


def collectives_after_local_branches():
    """A rank whose first cached entry fails its branch's check goes to the next: the
    collective must not have started before the check (the scheduler started it as early
    as its input allowed, above the check), or the ranks' collectives pair across calls."""
    rank = dist.get_rank()
    for fn in (_reduced_after_a_local_read, _reduced_beside_a_local_branch):
        jitted = dtcompile.jit(fn)
        for call, signs in enumerate([(1, -3), (-1, 1), (1, 2), (5, 2), (-2, -1)]):
            x = torch.tensor([1.0, 2.0, 3.0]) * signs[rank]
            assert_same(jitted(x.clone()), fn(x.clone()), f"{fn.__name__}, call {call}")
    # The collective would run before a check the ranks may fail apart: refused, as a write.
    with pytest.raises(dtcompile.TracingError, match=r"after an in-place write \(dist.all_reduce"):
        dtcompile.jit(_reduced_then_read_with_local_data)(torch.ones(3) * (rank + 1))
    return True


def test_a_collective_does_not_start_before_a_check_on_local_data(ranks2):
    assert ranks2.run(collectives_after_local_branches) == [True, True]
