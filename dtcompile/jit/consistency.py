"""Checking at compile time that the ranks compiled the same per-rank program.

Ranks that run different collectives deadlock at the first one that differs. So after
each compilation the ranks of the program's meshes exchange their programs through the
process group's store (not through a collective: a rank that did not compile must not
make the others hang) and compare them. Local sizes may differ between ranks (uneven
shards), and so may the pads and narrows DTensor adds for them; nothing else may.
"""

from __future__ import annotations

import difflib
import hashlib
import os
from collections import defaultdict
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..core import TensorProxy, Trace, is_proxy
from ..core.printing import Unprintable, python_literal

# Ops DTensor adds on some ranks only, for uneven shards (pad before a collective,
# narrow after it); a rank whose shard needs no padding skips them.
_UNEVEN_SHARD_OPS = {
    "aten.constant_pad_nd.default",
    "aten.pad.default",
    "aten.narrow.default",
    "aten.slice.Tensor",
    "aten.contiguous.default",
    "aten.clone.default",
}


class RankMismatchError(RuntimeError):
    """Ranks compiled different per-rank programs."""


def _normalize(value: object, group_labels: dict[str, str]) -> str:
    if isinstance(value, TensorProxy):
        return "T"
    if is_proxy(value):
        return "N"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return "#"  # sizes may differ between ranks
    if isinstance(value, str):
        return repr(group_labels.get(value, value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_normalize(v, group_labels) for v in value) + "]"
    try:
        return python_literal(value)
    except Unprintable:
        return type(value).__name__


def program_lines(trace: Trace, group_labels: dict[str, str]) -> list[str]:
    """The trace as lines that are equal on every rank of an SPMD program."""
    lines = []
    for bsym in trace.bound_symbols:
        args = ", ".join(_normalize(a, group_labels) for a in bsym.args)
        kwargs = ", ".join(f"{k}={_normalize(v, group_labels)}" for k, v in bsym.kwargs.items())
        lines.append(f"{bsym.symbol.name}({args}{', ' if args and kwargs else ''}{kwargs})")
    return lines


def first_difference(mine: list[str], theirs: list[str]) -> tuple[int, str, str] | None:
    """The first line where two programs differ, ignoring uneven-shard padding ops."""
    matcher = difflib.SequenceMatcher(a=mine, b=theirs, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        extra = mine[i1:i2] + theirs[j1:j2]
        if tag in ("insert", "delete") and all(line.split("(")[0] in _UNEVEN_SHARD_OPS for line in extra):
            continue
        return i1, "\n".join(mine[i1:i2]) or "(nothing)", "\n".join(theirs[j1:j2]) or "(nothing)"
    return None


def _collective_ranks(trace: Trace) -> set[int]:
    """The ranks of the process groups the trace's collectives run on. A DTensor the
    function makes itself (``DTensor.from_local`` of a plain tensor argument) has no mesh
    among the inputs, but its collectives still need every rank of their group."""
    ranks: set[int] = set()
    for bsym in trace.bound_symbols:
        if bsym.op is None or bsym.op.namespace != "_c10d_functional":
            continue
        names = [a.name for a in bsym.op._schema.arguments]
        if "group_name" not in names:
            continue
        position = names.index("group_name")
        group_name = bsym.kwargs.get("group_name", bsym.args[position] if position < len(bsym.args) else None)
        if isinstance(group_name, str):
            ranks.update(dist.get_process_group_ranks(_resolve_process_group(group_name)))
    return ranks


def group_labels(meshes) -> dict[str, str]:
    """A rank-independent label for each process group of the meshes: the mesh dim's name
    (``tp``), or ``mesh0.dim1`` for unnamed dims."""
    labels = {}
    for m, mesh in enumerate(meshes):
        names = mesh.mesh_dim_names
        for d in range(mesh.ndim):
            labels.setdefault(mesh.get_group(d).group_name, names[d] if names else f"mesh{m}.dim{d}")
    return labels


def _timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("DTCOMPILE_SYNC_TIMEOUT", "120")))


def _exchange(store, key: str, ranks: tuple[int, ...], value: str, what: str) -> dict[int, str]:
    """Every rank's ``value`` under ``key``; a clear error, not a hang, if some rank never
    publishes one."""
    rank = dist.get_rank()
    store.set(f"{key}/{rank}", value)
    try:
        store.wait([f"{key}/{r}" for r in ranks], _timeout())
    except Exception as error:  # the store raises a generic error on timeout
        missing = [r for r in ranks if not store.check([f"{key}/{r}"])]
        raise RankMismatchError(
            f"dtcompile: rank {rank} compiled {what}, but ranks {missing} did not compile a program "
            f"within {_timeout().total_seconds():.0f} s (they hit a cache entry this rank missed, "
            "failed, or run other code); the ranks' programs would not match"
        ) from error
    return {r: store.get(f"{key}/{r}").decode() for r in ranks}


def _release(store, key: str, ranks: tuple[int, ...], names: list[str]) -> None:
    """The last rank done with the exchange deletes its keys, so the store does not grow."""
    if store.add(f"{key}/done", 1) == len(ranks) and hasattr(store, "delete_key"):
        for name in [*names, "done"]:
            store.delete_key(f"{key}/{name}")


def check_ranks_agree(traces: list[Trace], meshes: list, group_labels: dict[str, str], what: str, key: str) -> None:
    """Raise :class:`RankMismatchError` unless every rank of ``meshes``, and of the process
    groups the traces' collectives run on, compiled the same programs as this one. ``key``
    names this compilation alike on every rank (the function and its compilation count).
    The ranks exchange a hash of their programs, and the programs themselves only when the
    hashes differ. A no-op without a real multi-process group."""
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return
    mesh_ranks = {int(r) for mesh in meshes for r in mesh.mesh.flatten().tolist()}
    ranks = tuple(sorted(mesh_ranks.union(*(_collective_ranks(t) for t in traces))))
    if len(ranks) < 2:
        return
    rank = dist.get_rank()
    key = f"dtcompile/{'-'.join(map(str, ranks))}/{key}"
    store = dist.distributed_c10d._get_default_store()
    mine = [what, *(line for trace in traces for line in program_lines(trace, group_labels))]
    text = "\n".join(mine)
    hashes = _exchange(store, f"{key}/hash", ranks, hashlib.sha256(text.encode()).hexdigest(), what)
    if len(set(hashes.values())) == 1:
        _release(store, key, ranks, [f"hash/{r}" for r in ranks])
        return
    programs = {r: t.split("\n") for r, t in _exchange(store, f"{key}/text", ranks, text, what).items()}
    _release(store, key, ranks, [f"{kind}/{r}" for kind in ("hash", "text") for r in ranks])
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for r, lines in programs.items():
        groups[tuple(lines)].append(r)
    for r, lines in programs.items():
        if r == rank:
            continue
        difference = first_difference(mine, lines)
        if difference is None:
            continue
        line, here, there = difference
        raise RankMismatchError(
            f"dtcompile: ranks compiled different per-rank programs for {what}: "
            f"{'; '.join(f'ranks {g}' for g in groups.values())}. First difference, at line {line} "
            f"of the program:\n  rank {rank}: {here}\n  rank {r}: {there}\n"
            "Programs that differ in their ops or collectives would deadlock at run time."
        )
