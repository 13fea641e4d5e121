"""Every rank's value under one key of the default process group's store, or an error.

The ranks exchange values through the store, never a collective: a rank that does not
come (it failed, or hit a cache entry the others missed) must not make the others hang.
Each rank posts ``ok <value>`` or ``failed <error>`` under ``key/<rank>``; a waiting rank
polls in short intervals, so a posted failure is seen within milliseconds, and gives up
after ``DTCOMPILE_SYNC_TIMEOUT`` seconds (120 by default).
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from .errors import RankFailedError

_OK, _FAILED = "ok ", "failed "
_POLL_START, _POLL_MAX = 0.001, 0.05  # seconds between polls: short at first, then capped


def sync_timeout() -> float:
    return float(os.environ.get("DTCOMPILE_SYNC_TIMEOUT", "120"))


def default_store():
    return dist.distributed_c10d._get_default_store()


class MissingRanks(Exception):
    """Some ranks posted nothing within the timeout."""

    def __init__(self, ranks: list[int], seconds: float):
        super().__init__(f"ranks {ranks} posted nothing within {seconds:.0f} s")
        self.ranks = ranks
        self.seconds = seconds


def post_failure(store, key: str, error: BaseException) -> None:
    """Tell the ranks that wait under ``key`` that this rank failed, and why."""
    message = f"{type(error).__name__}: {error}".strip()
    store.set(f"{key}/{dist.get_rank()}", _FAILED + message[:4000])


def exchange(store, key: str, ranks: tuple[int, ...], value: str, what: str) -> dict[int, str]:
    """Every rank's ``value`` under ``key``. Raises :class:`RankFailedError` as soon as a
    rank posts a failure, :class:`MissingRanks` when some never post."""
    rank = dist.get_rank()
    store.set(f"{key}/{rank}", _OK + value)
    values = {rank: value}
    pending = [r for r in ranks if r != rank]
    timeout = sync_timeout()
    deadline = time.monotonic() + timeout
    pause = _POLL_START
    while pending:
        for r in list(pending):
            if not store.check([f"{key}/{r}"]):
                continue
            posted = store.get(f"{key}/{r}").decode()
            pending.remove(r)
            if posted.startswith(_FAILED):
                error = posted[len(_FAILED) :]
                raise RankFailedError(
                    f"dtcompile: rank {r} failed while compiling {what}, which this rank (rank {rank}) "
                    f"compiled with it: {error}",
                    r,
                    error,
                )
            values[r] = posted[len(_OK) :]
        if not pending:
            break
        if time.monotonic() > deadline:
            raise MissingRanks(pending, timeout)
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)
    return values


def release(store, key: str, ranks: tuple[int, ...], names: list[str]) -> None:
    """The last rank done with an exchange deletes its keys, so the store does not grow."""
    done = f"{key}/done/{'-'.join(map(str, ranks))}"
    if store.add(done, 1) == len(ranks) and hasattr(store, "delete_key"):
        for name in [*names, done]:
            store.delete_key(name)
