"""The rank pool itself: a rank that dies fails only the call it died in.

A rank killed by a crash in C++ (or by the machine) once left the pool's pipes broken,
and every later test of that pytest worker failed with ``BrokenPipeError`` (CI, 284
failures), hiding the one test that crashed."""

import os

import pytest
import torch.distributed as dist
from harness import RankError, RankPool


def _exit_on_rank_one(code):
    if dist.get_rank() == 1:
        os._exit(code)
    return dist.get_rank()


def _rank_and_sum():
    import torch

    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def test_a_rank_that_dies_fails_its_call_and_the_next_call_starts_afresh():
    pool = RankPool(2)
    try:
        assert pool.run(_rank_and_sum) == [(0, 2.0), (1, 2.0)]
        with pytest.raises(RankError, match=r"rank 1 ---\nthe rank's process died \(exit code 3\)"):
            pool.run(_exit_on_rank_one, 3)
        assert pool.run(_rank_and_sum) == [(0, 2.0), (1, 2.0)]
        # A rank that died between calls (its exit found before the next send).
        with pytest.raises(RankError):
            pool.run(_exit_on_rank_one, 0)
        assert pool.run(_rank_and_sum) == [(0, 2.0), (1, 2.0)]
    finally:
        pool.close()
