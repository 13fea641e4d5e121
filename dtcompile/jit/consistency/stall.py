"""Why a cached program failed in a collective: a peer compiled instead.

When one rank's guards reject a call that another rank's accept, the first compiles and
waits in the exchange while the other runs its cached program and blocks in its first
collective. The compiling rank raises after ``DTCOMPILE_SYNC_TIMEOUT``; the other's
collective fails after the process group's timeout (``init_process_group(timeout=...)``).
That failure is explained here, from the compiling rank's post in the store.
"""

from __future__ import annotations

import torch.distributed as dist

from .errors import RankMismatchError
from .exchange import default_store
from .identity import peek_compilation_key


def explain_stall(identity: str, what: str, ranks: tuple[int, ...], error: BaseException) -> None:
    """Raise :class:`RankMismatchError` from ``error`` if some of ``ranks`` compiled the
    code ``identity`` while this rank ran a cached program; return otherwise."""
    if not ranks or not dist.is_initialized():
        return
    rank = dist.get_rank()
    key = f"{peek_compilation_key(identity)}/hash"
    try:
        store = default_store()
        compiled = [r for r in ranks if r != rank and store.check([f"{key}/{r}"])]
    except Exception:  # noqa: BLE001 - the store being gone must not hide the error
        return
    if compiled:
        raise RankMismatchError(
            f"dtcompile: rank {rank} ran its cached program for {what}, but ranks {compiled} compiled a new one "
            "(their guards rejected the call this rank's accepted: inputs that differ between ranks in a way "
            "the guards check); the collective this rank waited in failed: "
            f"{type(error).__name__}: {str(error)[:300]}"
        ) from error
