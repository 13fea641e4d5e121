"""Ranks must agree on the collectives they share, and only those: a collective on a group
a rank is not in (a pipeline stage's, a rank's own group, one ``dist.all_reduce`` skips on
the ranks outside it) is not that rank's to run. The ranks' check after compiling compared
every collective on every rank, and raised RankMismatchError where eager runs. Ranks that
share a group and run its collectives in another order than another shared group's (which
would hang) are still told apart."""

import pytest
import torch
import torch.distributed as dist
from checks import assert_same

import dtcompile


def _groups():
    rank, n = dist.get_rank(), dist.get_world_size()
    evens = dist.new_group(list(range(0, n, 2)))
    own = [dist.new_group([r]) for r in range(n)][rank]  # (every rank makes every group, in order)
    return rank, evens, own


def evens_then_world(x, evens):
    a = x * 2
    if dist.get_rank() % 2 == 0:
        dist.all_reduce(a, group=evens)
    b = x + 1
    dist.all_reduce(b)
    return a, b


def called_on_every_rank_then_world(x, evens):
    a = x * 2
    dist.all_reduce(a, group=evens)  # (a rank outside the group skips it, as eager's does)
    b = x + 1
    dist.all_reduce(b, async_op=True).wait()
    return a, b


def own_group_then_world(x, own):
    a = x * 3
    dist.all_reduce(a, group=own)
    dist.all_reduce(a)
    return a


def along_a_chain(x, pairs):
    """Rank r reduces with r - 1, then with r + 1 (a pipeline's neighbours): each rank's own
    ranks to agree with are fewer than the world's."""
    rank, n = dist.get_rank(), dist.get_world_size()
    y = x * (rank + 1)
    if rank > 0:
        dist.all_reduce(y, group=pairs[rank - 1])
    if rank < n - 1:
        dist.all_reduce(y, group=pairs[rank])
    return y


def groups_some_ranks_skip():
    rank, evens, own = _groups()
    pairs = [dist.new_group([r, r + 1]) for r in range(dist.get_world_size() - 1)]
    cases = [
        (evens_then_world, evens),
        (called_on_every_rank_then_world, evens),
        (own_group_then_world, own),
        (along_a_chain, pairs),
    ]
    for fn, group in cases:
        for cache in ("constant values", "symbolic values"):
            jitted = dtcompile.jit(fn, cache=cache)
            for call in range(2):
                x = torch.arange(3.0 + call) * (rank + 1)
                assert_same(jitted(x, group), fn(x, group), f"{fn.__name__}, {cache}, call {call}")
    return True


def test_collectives_of_groups_some_ranks_skip_compile(ranks4):
    assert ranks4.run(groups_some_ranks_skip) == [True] * 4


def _orders_differ(x, evens):
    a, b = x * 2, x + 1
    if dist.get_rank() == 0:
        dist.all_reduce(a, group=evens)
        dist.all_reduce(b)
    else:
        dist.all_reduce(b)
        if dist.get_rank() % 2 == 0:
            dist.all_reduce(a, group=evens)
    return a, b


def orders_that_would_hang():
    _, evens, _ = _groups()
    with pytest.raises(dtcompile.RankMismatchError, match="different collectives"):
        dtcompile.jit(_orders_differ)(torch.ones(3), evens)
    return True


def test_shared_groups_in_another_order_are_told_apart(ranks4):
    assert ranks4.run(orders_that_would_hang) == [True] * 4
