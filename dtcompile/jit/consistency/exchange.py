"""Every rank's value under one key of the default process group's store, or an error.

The ranks exchange values through the store, never a collective: a rank that does not
come (it failed, or hit a cache entry the others missed) must not make the others hang.
Each rank posts ``ok <value>`` or ``failed <error>`` under ``key/<rank>``; a waiting rank
waits on the store (answered as soon as the values exist: a failure is posted under the
same key as a value), then polls it, so a posted failure is seen within 1 s even while
another rank is late, and gives up after ``DTCOMPILE_SYNC_TIMEOUT`` seconds (120 by default).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

from ...core.torch_internals import default_store  # noqa: F401  (its users import it from here)
from .errors import RankFailedError

_OK, _FAILED = "ok ", "failed "
_FIRST_WAIT = 1.0  # seconds: the longest a failure goes unseen while another rank is late
_POLL_FIRST, _POLL_MAX = 0.001, 0.02  # seconds between polls after it: short, then capped


def sync_timeout() -> float:
    return float(os.environ.get("DTCOMPILE_SYNC_TIMEOUT", "120"))


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
    pending = [f"{key}/{r}" for r in ranks if r != rank]
    timeout = sync_timeout()
    deadline = time.monotonic() + timeout
    # A failure is posted under the same key as a value, so waiting for the keys sees it.
    # First a store wait, which returns as soon as the keys exist (the common case: the
    # peers are about as fast); then polls, which see one rank's failure while another is
    # late. (Not waits in slices: each store wait that times out logs a warning.)
    try:
        store.wait(pending, timedelta(seconds=min(_FIRST_WAIT, timeout)))
    except RuntimeError:  # the wait timed out (FileStore and TCPStore raise different types)
        pause = _POLL_FIRST
        while not store.check(pending):
            present = [k for k in pending if store.check([k])]
            _raise_failures(store, present, rank, what)
            if time.monotonic() > deadline:
                missing = [r for r in ranks if r != rank and f"{key}/{r}" not in present]
                raise MissingRanks(missing, timeout) from None
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
    posted = _raise_failures(store, pending, rank, what)
    return {rank: value, **{r: posted[f"{key}/{r}"] for r in ranks if r != rank}}


def meet(store, key: str, failures: str, ranks: tuple[int, ...], what: str) -> None:
    """Wait until every rank of ``ranks`` posted under ``key``; raise
    :class:`RankFailedError` as soon as one posts a failure under ``failures`` (the
    compilation's key, where a failing rank posts it), :class:`MissingRanks` when some never
    come."""
    rank = dist.get_rank()
    store.set(f"{key}/{rank}", _OK)
    pending = [f"{key}/{r}" for r in ranks if r != rank]
    watched = [f"{failures}/{r}" for r in ranks if r != rank]
    timeout = sync_timeout()
    deadline, pause = time.monotonic() + timeout, _POLL_FIRST
    while not store.check(pending):
        _raise_failures(store, [k for k in watched if store.check([k])], rank, what)
        if time.monotonic() > deadline:
            raise MissingRanks(
                [r for r, k in zip(sorted(set(ranks) - {rank}), pending) if not store.check([k])], timeout
            )
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)


def _raise_failures(store, keys: list[str], rank: int, what: str) -> dict[str, str]:
    """The values posted under ``keys`` (all present); a posted failure raises."""
    values = dict(zip(keys, (v.decode() for v in store.multi_get(keys)))) if keys else {}
    for key, posted in values.items():
        if posted.startswith(_FAILED):
            failed, error = int(key.rsplit("/", 1)[1]), posted[len(_FAILED) :]
            raise RankFailedError(
                f"dtcompile: rank {failed} failed and did not compile {what} with this rank (rank {rank}): {error}",
                failed,
                error,
            )
    return {key: posted[len(_OK) :] for key, posted in values.items()}


def release(store, key: str, ranks: tuple[int, ...], names: list[str]) -> None:
    """The last rank done with an exchange deletes its keys, so the store does not grow."""
    done = f"{key}/done/{'-'.join(map(str, ranks))}"
    if store.add(done, 1) == len(ranks) and hasattr(store, "delete_key"):
        for name in [*names, done]:
            store.delete_key(name)
