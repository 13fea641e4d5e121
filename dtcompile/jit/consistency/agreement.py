"""One compilation's check that the ranks agree, and its report of a failure.

Made before tracing, so that a rank that fails while tracing or compiling can still tell
the ranks compiling with it (they raise :class:`RankFailedError` at once, naming it). After
compiling, the ranks of the program's meshes and collectives exchange hashes of what must
agree: the DTensor inputs' global metadata (``identity.input_signature``) and the programs'
collectives (``program.collective_lines``) on every rank, and the shapes of each
group's collectives on the ranks of that group; the full texts only when a hash differs.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import torch.distributed as dist

from ...core import Trace
from .calls import calls_checked
from .errors import GuardsDiffer, RankMismatchError
from .exchange import MissingRanks, default_store, exchange, meet, post_failure, release
from .identity import input_signature, next_compilation_key
from .program import collective_lines, collective_ranks, first_difference

_INPUTS, _PROGRAM = "inputs:", "program:"
_GUARDS = " guards:"  # what a symbolic trace assumed of the sizes, after the digests


def _multi_process() -> bool:
    return dist.is_initialized() and dist.get_backend() != "fake" and dist.get_world_size() > 1


class RankAgreement:
    """The check of one compilation of the code named ``identity`` (see identity.py)."""

    def __init__(self, identity: str, what: str, args: tuple, kwargs: dict, module, compiled=None):
        self.identity = identity
        # The sequences of collectives the ranks agreed on for this compiled function (not
        # for its code: another jit of it, under other options, compiles other programs).
        self.agreed = vars(compiled).setdefault("agreed_sequences", AgreedSequences()) if compiled else None
        self.what = what
        self.signature = input_signature(args, kwargs, module) if _multi_process() else []
        self.key: str | None = None  # taken by the exchange, a meeting or the failure report
        self.exchanged = False  # the ranks exchanged their programs (each raised what it found)
        self.meetings = 0

    def _take_key(self) -> str:
        if self.key is None:
            self.key = next_compilation_key(self.identity)
        return self.key

    def report_failure(self, error: BaseException) -> None:
        """Post this rank's failure, so that ranks waiting for its program raise now."""
        if not _multi_process() or isinstance(error, RankMismatchError) or self.exchanged:
            return  # a mismatch is raised on every rank already; the exchange ran
        try:
            post_failure(default_store(), f"{self._take_key()}/hash", error)
        except Exception:  # noqa: BLE001 - the store being gone must not hide the error
            pass

    def meet(self, ranks: tuple[int, ...]) -> None:
        """Before tracing runs a collective on real values (``data_branches.real_now``):
        the ranks of its group meet, or raise :class:`RankMismatchError` (a peer failed, or
        never came: it hit a cache entry this rank missed)."""
        if not _multi_process() or len(ranks) < 2 or dist.get_rank() not in ranks:
            return
        key = self._take_key()
        self.meetings += 1
        try:
            meet(default_store(), f"{key}/live{self.meetings}", f"{key}/hash", ranks, self.what)
        except MissingRanks as missing:
            error = RankMismatchError(
                f"dtcompile: rank {dist.get_rank()} traces {self.what}, whose code reads a value a collective "
                f"computes, but ranks {missing.ranks} did not come to that collective within "
                f"{missing.seconds:.0f} s (DTCOMPILE_SYNC_TIMEOUT): they hit a cache entry this rank missed, or "
                "run other code; run with them, the collective would hang or meet another"
            )
            post_failure(default_store(), f"{key}/hash", error)  # a peer stalled in its program is told why
            raise error from None

    def check(
        self, traces: list[Trace], meshes: list, labels: dict[str, str], guards: list[str] = ()
    ) -> tuple[tuple[int, ...], str]:
        """Raise :class:`RankMismatchError` unless every rank of ``meshes``, and of the
        process groups the traces' collectives run on, agrees with this one; raise
        :class:`GuardsDiffer` where they agree but for what their traces assumed of
        symbolic sizes (``guards``). The ranks checked (none, a no-op, without a real
        multi-process group) and the digest of what they agreed on (the same on each)."""
        if not _multi_process():
            return (), ""
        mesh_ranks = {int(r) for mesh in meshes for r in mesh.mesh.flatten().tolist()}
        ranks = tuple(sorted(mesh_ranks.union(*(collective_ranks(t) for t in traces))))
        if len(ranks) < 2 or dist.get_rank() not in ranks:
            return (), ""
        key, store = self._take_key(), default_store()
        self.exchanged = True
        # Each program's collectives apart (a training call's forward, then its backward):
        # ranks whose forwards differ must not agree because their totals do.
        collectives = [
            c._replace(line=f"{i}: {c.line}", sized=f"{i}: {c.sized}")
            for i, trace in enumerate(traces)
            for c in collective_lines(trace, labels)
        ]
        # (on groups of some of the ranks, a new length may change one group's collectives
        # and not another's: there the inputs' global metadata must be the agreed one too)
        subgroups = any(c.group and set(c.group) != set(ranks) for c in collectives)
        alone = (
            _sequence(self.signature if subgroups else [], collectives)
            if self.agreed is not None and not guards and not calls_checked()
            else None
        )
        if self.agreed is not None and self.agreed.alone(alone) is not None:
            return self.agreed.alone(alone)  # (no key taken: the ranks' next compilation together keeps its number)
        # Their inputs, where a collective could pair them wrongly (a program with none runs as eager's).
        signature = [_INPUTS + " " + line for line in self.signature]
        sized: dict[tuple[int, ...], list[str]] = defaultdict(list)  # group -> its collectives with shapes
        for c in collectives:
            sized[c.group or ranks].append(c.sized)
        shared = [(peer, _peer_digest(signature, collectives, ranks, peer)) for peer in ranks]
        peers = ",".join(f"{peer}:{digest}" for peer, digest in shared if digest != _NOTHING_SHARED) or "-"
        digests = [peers, *(f"{_ranks_text(g)}={_digest(lines)}" for g, lines in sorted(sized.items()))]
        posted = self._exchange(store, f"{key}/hash", ranks, " ".join(digests) + _GUARDS + _digest(list(guards)))
        hashes = {r: v.partition(_GUARDS)[0] for r, v in posted.items()}
        if _agreed(hashes):
            release(store, key, ranks, [f"{key}/hash/{r}" for r in ranks])
            if len({v.partition(_GUARDS)[2] for v in posted.values()}) > 1:
                raise GuardsDiffer(self.what)
            agreed = ranks, _digest([f"{r} {v}" for r, v in sorted(hashes.items())])
            if self.agreed is not None and alone is not None:
                self.agreed.add(alone, agreed)
            return agreed
        text = "\n".join(
            [*signature, *(f"{_PROGRAM} {c.line}\t{c.sized}\t{_ranks_text(c.group or ranks)}" for c in collectives)]
        )
        texts = self._exchange(store, f"{key}/text", ranks, text)
        release(store, key, ranks, [f"{key}/{kind}/{r}" for kind in ("hash", "text") for r in ranks])
        error = self._difference({r: t.split("\n") if t else [] for r, t in texts.items()})
        if error is not None:
            raise error
        # Alike but for symbolic sizes, which may be any size (the same on every rank).
        return ranks, _digest([f"{r} {v}" for r, v in sorted(hashes.items())])

    def _exchange(self, store, key: str, ranks: tuple[int, ...], value: str) -> dict[int, str]:
        try:
            return exchange(store, key, ranks, value, self.what)
        except MissingRanks as missing:
            error = RankMismatchError(
                f"dtcompile: rank {dist.get_rank()} compiled {self.what}, but ranks {missing.ranks} did not "
                f"compile it within {missing.seconds:.0f} s (DTCOMPILE_SYNC_TIMEOUT): they hit a cache entry "
                "this rank missed, or run other code; run together, the ranks' programs would hang"
            )
            # In place of its value: a peer that comes later must not take it and run alone.
            post_failure(store, key, error)
            raise error from None

    def _difference(self, programs: dict[int, list[str]]) -> RankMismatchError | None:
        """The error for the first pair of ranks that differ, this rank's pairs first (every
        rank raises, also one that agrees with each of its peers: it must not run alone)."""
        rank = dist.get_rank()
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for r, lines in sorted(programs.items()):
            groups[tuple(lines)].append(r)
        who = "; ".join(f"ranks {g}" for g in groups.values())
        pairs = [(rank, r) for r in sorted(programs) if r != rank]
        pairs += [(a, b) for a in sorted(programs) for b in sorted(programs) if rank not in (a, b) and a < b]
        for a, b in pairs:
            inputs = _input_difference(programs[a], programs[b])
            if inputs is not None:
                path, here, there = inputs
                return RankMismatchError(
                    f"dtcompile: ranks called {self.what} with different DTensors: {who}. {path} is\n"
                    f"  rank {a}: {here}\n  rank {b}: {there}\n"
                    "DTensor inputs must have the same global shape, dtype and placements on every rank."
                )
            difference = first_difference(_as_seen_by(programs[a], b), _as_seen_by(programs[b], a))
            if difference is None:
                continue
            index, here, there = difference
            return RankMismatchError(
                f"dtcompile: ranks compiled programs with different collectives for {self.what}: {who}. "
                f"First difference, at collective {index}:\n  rank {a}: {here}\n  rank {b}: {there}\n"
                "Ranks that run different collectives hang at the first one that differs."
            )
        return None


class AgreedSequences:
    """A later compilation that one rank makes alone (its batch of another length, which
    the others' cached entries took) needs no meeting where its collectives, with their
    shapes (and, with collectives on groups of some of the ranks, its DTensor inputs'
    global metadata) are those of every program of the function the ranks agreed on so far:
    whatever entry the others run, its collectives pair with this one's. Only while the
    ranks agreed on one sequence (another: a meeting each time)."""

    def __init__(self):
        self.sequences: dict[str, tuple] = {}  # each agreed sequence -> its (ranks, digest)

    def add(self, sequence: str, agreed: tuple) -> None:
        self.sequences[sequence] = agreed

    def alone(self, sequence: str | None) -> tuple | None:
        """The ``(ranks, digest)`` to keep where ``sequence`` may be compiled alone."""
        if sequence is None or len(self.sequences) != 1:
            return None
        return self.sequences.get(sequence)


def _sequence(signature: list[str], collectives: list) -> str:
    """What a compilation alone must share with an agreed one: its collectives, with their
    shapes, and where some run on groups of some of the ranks, its DTensor inputs' global
    metadata (``signature``). That is the same on every rank, so where it changed every
    rank compiles anew and all meet: a rank whose collectives stayed as agreed must not
    skip a meeting its peers (whose shards, and so their groups' collectives, changed) are
    waiting in."""
    return _digest([*signature, *(f"{c.line}\t{c.sized}\t{c.group}" for c in collectives)])


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _ranks_text(ranks: tuple[int, ...]) -> str:
    return ",".join(map(str, ranks))


def _peer_digest(signature: list[str], collectives: list, ranks: tuple[int, ...], peer: int) -> str:
    """What ``peer`` must see alike of this rank's program: its collectives on groups that
    hold them both, in order (a rank skips those of a group it is not in: a pipeline stage's),
    and the DTensor inputs where there are any."""
    shared = [_PROGRAM + " " + c.line for c in collectives if peer in (c.group or ranks)]
    return _digest([*signature, *shared])[:16] if shared else _NOTHING_SHARED


_NOTHING_SHARED = "0"  # (a peer a rank names no digest for: it shares no collective with it)


def _agreed(posted: dict[int, str]) -> bool:
    """Whether the ranks' digests (``peers group=digest ...``) agree: each pair of ranks on
    the collectives they share, each group's (with shapes) on the ranks of that group."""
    parsed = {r: value.split(" ") for r, value in posted.items()}
    # (by the peers' ranks, not their places: a rank's own ranks may be fewer, a chain of groups)
    peers = {r: dict(item.split(":") for item in items[0].split(",") if item != "-") for r, items in parsed.items()}
    nothing = _NOTHING_SHARED
    if any(peers[a].get(str(b), nothing) != peers[b].get(str(a), nothing) for a in peers for b in peers if a < b):
        return False
    by_group: dict[str, set[str]] = defaultdict(set)
    for _, *groups in parsed.values():
        for item in groups:
            group, _, digest = item.partition("=")
            by_group[group].add(digest)
    return all(len(digests) == 1 for digests in by_group.values())


def _as_seen_by(lines: list[str], other: int) -> list[str]:
    """A program's collectives as a peer compares them: those of groups the peer is in,
    with their shapes."""
    seen = []
    for line in lines:
        if line.startswith(_PROGRAM):
            _, sized, group = line.removeprefix(_PROGRAM + " ").split("\t")
            if str(other) in group.split(","):
                seen.append(sized)
    return seen


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
