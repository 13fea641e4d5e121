"""Agreement at every call, opt-in (``DTCOMPILE_RANK_CHECK=calls``).

By default the ranks meet only when they compile. A cached call whose guards pass on one
rank and fail on another then leaves the first running its program, blocked in a
collective until the process group's timeout, while the other compiles and waits in the
exchange until ``DTCOMPILE_SYNC_TIMEOUT``. With the per-call check every call of a
jitted function posts what it runs (``hit <digest of the entry's agreement>`` or
``miss``) under a key counting the calls of its code; a hit waits for the peers of its
entry before running any collective, and raises :class:`RankMismatchError` at once when a
peer missed or runs another entry. A rank that raises so also posts a failure under the
compilation key its missing peers wait on, so they raise at once too. Cost: four store
round trips per call, a median of 0.3 ms on 2 local ranks with a TCPStore.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter

import torch.distributed as dist

from .errors import RankMismatchError
from .exchange import MissingRanks, default_store, exchange, post_failure
from .identity import next_compilation_key

_calls: Counter[str] = Counter()  # calls posted so far, by code identity
_MISS = "miss"


def calls_checked() -> bool:
    """Whether every call is checked (``DTCOMPILE_RANK_CHECK=calls``); read at ``jit`` time."""
    return os.environ.get("DTCOMPILE_RANK_CHECK", "") == "calls" and _multi_process()


def _multi_process() -> bool:
    return dist.is_initialized() and dist.get_backend() != "fake" and dist.get_world_size() > 1


def _next_key(identity: str) -> str:
    """The key of this call. The slot of two calls ago is deleted:
    a peer still reading it would have to be two calls behind, which the waits exclude."""
    _calls[identity] += 1
    n = _calls[identity]
    base = f"dtcompile/calls/{hashlib.sha1(identity.encode()).hexdigest()[:16]}"
    store, rank = default_store(), dist.get_rank()
    if n > 2 and hasattr(store, "delete_key"):
        store.delete_key(f"{base}/{n - 2}/{rank}")
    return f"{base}/{n}"


def post_miss(identity: str) -> None:
    """A miss: posted for the peers that hit, not waited on (the compilation's exchange is)."""
    key = _next_key(identity)
    default_store().set(f"{key}/{dist.get_rank()}", "ok " + _MISS)


def check_hit(identity: str, what: str, ranks: tuple[int, ...], digest: str) -> None:
    """Wait until the peers of the entry about to run posted this call; raise unless they
    all run an entry that agreed on ``digest``."""
    key = _next_key(identity)
    store, rank = default_store(), dist.get_rank()
    if len(ranks) < 2:  # a program of this rank alone: posted, for the peers' count, not waited on
        store.set(f"{key}/{rank}", "ok " + digest)
        return
    try:
        posted = exchange(store, key, ranks, digest, what)
    except MissingRanks as missing:
        raise RankMismatchError(
            f"dtcompile: rank {rank} called {what}, but ranks {missing.ranks} did not within "
            f"{missing.seconds:.0f} s (DTCOMPILE_SYNC_TIMEOUT, DTCOMPILE_RANK_CHECK=calls)"
        ) from None
    missed = [r for r, v in sorted(posted.items()) if v == _MISS]
    other = [r for r, v in sorted(posted.items()) if v not in (_MISS, digest)]
    if not missed and not other:
        return
    parts = []
    if missed:
        parts.append(f"ranks {missed} missed the cache and compile a new program")
    if other:
        parts.append(f"ranks {other} run another cached program")
    error = RankMismatchError(
        f"dtcompile: rank {rank} would run its cached program for {what}, but {' and '.join(parts)} "
        "(their guards judged the call otherwise: inputs that differ between ranks in a way the guards "
        "check); run together, the programs would hang"
    )
    if missed:  # they wait in the exchange of their compilation: tell them not to
        post_failure(store, f"{next_compilation_key(identity)}/hash", error)
    raise error
