"""Collectives that tracing runs on real values, and the ranks' meeting before each.

A branch on a number a collective computes (``if x.sum() > 0`` on a sharded DTensor) is
answered while tracing by running the collective on the call's real inputs
(``data_branches.real_now``). Every rank of its group must run it then; a peer that hit
a cache entry this rank missed, or failed, runs something else, and the collective hangs
or meets another. jit's rank agreement meets the peers first, through the store
(``ranks_meet_before_live_collectives``).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from ..core.torch_internals import resolve_process_group

_meetings: list = []  # while tracing: jit's rank agreement, called before each collective tracing runs


@contextlib.contextmanager
def ranks_meet_before_live_collectives(meet):
    """While inside, ``meet(ranks)`` runs before each collective that tracing runs on real
    values (a branch on a number a collective computes, in ``data_branches.real_now``), with the
    ranks of its group: they meet first (through the store), so that a peer that ran a
    cached program, or failed, is not met in the collective (that hung, or paired this
    rank's collective with another)."""
    _meetings.append(meet)
    try:
        yield
    finally:
        _meetings.pop()


def ranks_meet(bsym) -> None:
    """Before tracing runs the collective ``bsym`` on real values: the meeting, if any."""
    if _meetings and (ranks := _group_ranks(bsym)) is not None:
        _meetings[-1](ranks)


def _group_ranks(bsym) -> tuple[int, ...] | None:
    """The ranks of the process group a collective symbol runs on (None: a wait)."""
    for arg in bsym.args:
        if isinstance(arg, str):
            try:
                return tuple(dist.get_process_group_ranks(resolve_process_group(arg)))
            except (ValueError, RuntimeError, KeyError):
                continue
        if isinstance(arg, dist.ProcessGroup):
            return tuple(dist.get_process_group_ranks(arg))
    return None
