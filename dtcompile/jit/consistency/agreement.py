"""One compilation's check that the ranks agree, and its report of a failure.

Made before tracing, so that a rank that fails while tracing or compiling can still tell
the ranks compiling with it (they raise :class:`RankFailedError` at once, naming it). After
compiling, the ranks of the program's meshes and collectives exchange a hash of what must
agree: the DTensor inputs' global metadata (``identity.input_signature``) and the programs'
collectives (``program.collective_lines``); the full texts only when the hashes differ.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import torch.distributed as dist

from ...core import Trace
from .errors import RankMismatchError
from .exchange import MissingRanks, default_store, exchange, post_failure, release
from .identity import input_signature, next_compilation_key
from .program import collective_lines, collective_ranks, first_difference

_INPUTS, _PROGRAM = "inputs:", "program:"


def _multi_process() -> bool:
    return dist.is_initialized() and dist.get_backend() != "fake" and dist.get_world_size() > 1


class RankAgreement:
    """The check of one compilation of the code named ``identity`` (see identity.py)."""

    def __init__(self, identity: str, what: str, args: tuple, kwargs: dict, module):
        self.identity = identity
        self.what = what
        self.signature = input_signature(args, kwargs, module) if _multi_process() else []
        self.key: str | None = None  # taken by the exchange or the failure report

    def _take_key(self) -> str:
        if self.key is None:
            self.key = next_compilation_key(self.identity)
        return self.key

    def report_failure(self, error: BaseException) -> None:
        """Post this rank's failure, so that ranks waiting for its program raise now."""
        if not _multi_process() or isinstance(error, RankMismatchError) or self.key is not None:
            return  # a mismatch is raised on every rank already; the exchange ran
        try:
            post_failure(default_store(), f"{self._take_key()}/hash", error)
        except Exception:  # noqa: BLE001 - the store being gone must not hide the error
            pass

    def check(self, traces: list[Trace], meshes: list, labels: dict[str, str]) -> tuple[tuple[int, ...], str]:
        """Raise :class:`RankMismatchError` unless every rank of ``meshes``, and of the
        process groups the traces' collectives run on, agrees with this one. The ranks
        checked (none, a no-op, without a real multi-process group) and the digest of what
        they agreed on."""
        if not _multi_process():
            return (), ""
        mesh_ranks = {int(r) for mesh in meshes for r in mesh.mesh.flatten().tolist()}
        ranks = tuple(sorted(mesh_ranks.union(*(collective_ranks(t) for t in traces))))
        if len(ranks) < 2 or dist.get_rank() not in ranks:
            return (), ""
        key, store = self._take_key(), default_store()
        mine = [*(_INPUTS + " " + line for line in self.signature)]
        mine += [_PROGRAM + " " + line for trace in traces for line in collective_lines(trace, labels)]
        text = "\n".join(mine)
        digest = hashlib.sha256(text.encode()).hexdigest()
        hashes = self._exchange(store, f"{key}/hash", ranks, digest)
        if len(set(hashes.values())) == 1:
            release(store, key, ranks, [f"{key}/hash/{r}" for r in ranks])
            return ranks, digest
        texts = self._exchange(store, f"{key}/text", ranks, text)
        release(store, key, ranks, [f"{key}/{kind}/{r}" for kind in ("hash", "text") for r in ranks])
        self._raise_difference(mine, {r: t.split("\n") if t else [] for r, t in texts.items()})
        return ranks, digest  # not reached: texts that differ raise above

    def _exchange(self, store, key: str, ranks: tuple[int, ...], value: str) -> dict[int, str]:
        try:
            return exchange(store, key, ranks, value, self.what)
        except MissingRanks as missing:
            raise RankMismatchError(
                f"dtcompile: rank {dist.get_rank()} compiled {self.what}, but ranks {missing.ranks} did not "
                f"compile it within {missing.seconds:.0f} s (DTCOMPILE_SYNC_TIMEOUT): they hit a cache entry "
                "this rank missed, or run other code; run together, the ranks' programs would hang"
            ) from None

    def _raise_difference(self, mine: list[str], programs: dict[int, list[str]]) -> None:
        rank = dist.get_rank()
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for r, lines in sorted(programs.items()):
            groups[tuple(lines)].append(r)
        who = "; ".join(f"ranks {g}" for g in groups.values())
        for r, lines in sorted(programs.items()):
            if r == rank:
                continue
            inputs = _input_difference(mine, lines)
            if inputs is not None:
                path, here, there = inputs
                raise RankMismatchError(
                    f"dtcompile: ranks called {self.what} with different DTensors: {who}. {path} is\n"
                    f"  rank {rank}: {here}\n  rank {r}: {there}\n"
                    "DTensor inputs must have the same global shape, dtype and placements on every rank."
                )
            ours = [line for line in mine if line.startswith(_PROGRAM)]
            theirs = [line for line in lines if line.startswith(_PROGRAM)]
            difference = first_difference(ours, theirs)
            if difference is None:
                continue
            index, here, there = difference
            raise RankMismatchError(
                f"dtcompile: ranks compiled programs with different collectives for {self.what}: {who}. "
                f"First difference, at collective {index}:\n  rank {rank}: {here}\n  rank {r}: {there}\n"
                "Ranks that run different collectives hang at the first one that differs."
            )


def _input_difference(mine: list[str], theirs: list[str]) -> tuple[str, str, str] | None:
    """The first DTensor input whose metadata differs: its path and both descriptions."""

    def by_path(lines):
        out = {}
        for line in lines:
            if line.startswith(_INPUTS):
                path, _, description = line[len(_INPUTS) + 1 :].partition(": ")
                out[path] = description
        return out

    ours, others = by_path(mine), by_path(theirs)
    for path in [*ours, *(p for p in others if p not in ours)]:
        if ours.get(path) != others.get(path):
            return path, ours.get(path, "(no DTensor)"), others.get(path, "(no DTensor)")
    return None
