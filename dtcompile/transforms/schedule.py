"""Collective scheduling: start each collective as early as its inputs allow, wait for it
as late as its users allow, so that local work runs while the data is on the wire.

DTensor records a collective (``_c10d_functional.all_reduce``) and its ``wait_tensor``
where the redistribution happened, usually side by side. Here each start moves up to just
after the last symbol it depends on: the producers of its inputs, any write to memory,
the collective before it (every rank must issue collectives in the same order), a check of
data (a call that fails it goes to another entry), and the
wait of the previous collective of the same kind on the same group, as recorded. That
last bound keeps FSDP's parameter all-gathers one group ahead: the next group's
all-gather starts before the current group's compute (right after the current group's
wait as recorded), not all of them at the start of the program with every unsharded
parameter alive at once. (A bucketed all-gather's input is its group's concatenated
shards: that copy-in, pure ops on the program's inputs that nothing else reads, moves up
with it.) Each wait moves down to just before the first symbol that reads its result, or
that writes to memory (the collective may still be reading its input), or the end. An
in-place collective (``_c10d_functional.all_reduce_(x)``, ``broadcast_``, an ``out=``
gather) writes memory others may read: its start does not move above a symbol that reads
or makes a tensor in that memory, nor its wait below one. A
wait's copy-out, pure ops on its result that only the program's outputs read (a gradient
reduce-scatter's result cut into the parameters' gradients), first moves to the end, so
that the wait can go down with it: the reduce-scatter then runs while the backward of
the layers below it computes.
"""

from __future__ import annotations

from ..core import Trace
from ..core.op_classes import group_name, is_collective, is_wait, written_tensors
from ..core.prims import DataCheck
from ..core.symbol import proxies_in
from .effects import has_side_effects, mutates, storage_bases


def _is_wait(bsym) -> bool:
    return is_wait(bsym.op)


def _is_collective(bsym) -> bool:
    return is_collective(bsym.op)


def _kind(bsym) -> tuple:
    return (bsym.op, group_name(bsym))


def _copy_in(placed: list, bsym, inputs: set[str], readers: dict[str, set[int]]) -> list:
    """The symbols of ``placed`` that compute ``bsym``'s inputs from the trace's inputs alone
    by pure ops read by nothing else (FSDP's copy-in: views of the shards, their
    concatenation), which move up with it; or none."""
    chain, wanted = [], {p.label for p in bsym.input_proxies()}
    for before in reversed(placed):
        made = {p.label for p in before.output_proxies()}
        if not made & wanted:
            continue
        reads = {p.label for p in before.input_proxies()}
        if has_side_effects(before) or _is_collective(before) or _is_wait(before) or not reads:
            return []
        chain.insert(0, before)
        wanted |= reads
    members = {id(b) for b in chain} | {id(bsym)}
    produced = {p.label for b in chain for p in b.output_proxies()}
    for b in chain:
        if any(p.label not in inputs and p.label not in produced for p in b.input_proxies()):
            return []
        # A value another symbol reads too stays where it is (moved, it could pass that reader).
        if any(readers.get(p.label, set()) - members for p in b.output_proxies()):
            return []
    return chain


def _memory(bsym, base: dict[str, str]) -> set[str]:
    """The memory (by first tensor in it) of every tensor a symbol reads or makes."""
    return {base.get(p.label, p.label) for p in (*bsym.input_proxies(), *bsym.output_proxies())}


def _starts_early(symbols: list, inputs: set[str], base: dict[str, str]) -> list:
    readers: dict[str, set[int]] = {}
    for bsym in symbols:
        for p in bsym.input_proxies():
            readers.setdefault(p.label, set()).add(id(bsym))
    placed: list = []
    started: dict[str, tuple] = {}  # a collective's result -> its kind and group
    for bsym in symbols:
        if not _is_collective(bsym):
            placed.append(bsym)
            continue
        chain = _copy_in(placed, bsym, inputs, readers)
        if chain:
            taken = {id(b) for b in chain}
            placed = [b for b in placed if id(b) not in taken]
        needs = {p.label for b in [*chain, bsym] for p in b.input_proxies()}
        written = {base.get(p.label, p.label) for p in written_tensors(bsym)}  # (an in-place collective's)
        kind = _kind(bsym)
        position = len(placed)
        while position > 0:
            before = placed[position - 1]
            made = {p.label for p in before.output_proxies()}
            # (nor above a check of data: a call that fails it goes to another entry, whose
            # collectives must be the ranks' next ones)
            if made & needs or mutates(before) or _is_collective(before) or isinstance(before.symbol, DataCheck):
                break
            if written and written & _memory(before, base):  # (it would read the collective's result)
                break
            # One ahead: not above the wait of the previous collective of its kind and group.
            if _is_wait(before) and any(started.get(p.label) == kind for p in before.input_proxies()):
                break
            position -= 1
        placed[position:position] = [*chain, bsym]
        for p in bsym.output_proxies():
            started[p.label] = kind
    return placed


def _copy_outs_last(symbols: list, outputs: set[str]) -> list:
    """``symbols`` with each wait's copy-out (pure ops reading the wait's result, or
    another such op's, whose results nothing but these ops and the outputs read) moved to
    the end, in order."""
    readers: dict[str, list] = {}
    for bsym in symbols:
        for p in bsym.input_proxies():
            readers.setdefault(p.label, []).append(bsym)
    moved: set[int] = set()
    for bsym in symbols:
        if not _is_wait(bsym):
            continue
        chain, seen, frontier = [], set(), [p.label for p in bsym.output_proxies()]
        while frontier:
            for reader in readers.get(frontier.pop(), []):
                if id(reader) in moved or id(reader) in seen:
                    continue
                seen.add(id(reader))
                if has_side_effects(reader) or _is_collective(reader) or _is_wait(reader):
                    chain = None
                    break
                chain.append(reader)
                frontier += [p.label for p in reader.output_proxies()]
            if chain is None:
                break
        if not chain:
            continue
        members = {id(b) for b in chain}
        made = {p.label for b in chain for p in b.output_proxies()} | {p.label for p in bsym.output_proxies()}
        # Each member reads only the wait's results or other members', and what it makes is
        # read by members or returned.
        if any(p.label not in made for b in chain for p in b.input_proxies()):
            continue
        if any(any(id(r) not in members for r in readers.get(p.label, [])) for b in chain for p in b.output_proxies()):
            continue
        if not any(p.label in outputs for b in chain for p in b.output_proxies()):
            continue
        moved |= members
    return [b for b in symbols if id(b) not in moved] + [b for b in symbols if id(b) in moved]


def _waits_late(symbols: list, base: dict[str, str]) -> list:
    placed: list = []
    for bsym in reversed(symbols):
        if not _is_wait(bsym):
            placed.append(bsym)
            continue
        gives = {p.label for p in bsym.output_proxies()}
        # (the memory the collective writes: an in-place one's input, read there under other names)
        held = {base.get(p.label, p.label) for p in bsym.input_proxies()}
        position = len(placed)  # ``placed`` is reversed: its end is the earliest symbol
        while position > 0:
            after = placed[position - 1]
            reads = {p.label for p in after.input_proxies()}
            if reads & gives or mutates(after) or held & _memory(after, base):
                break
            position -= 1
        placed.insert(position, bsym)
    placed.reverse()
    return placed


def schedule_collectives(trace: Trace) -> Trace:
    """Collectives started early and waited late (see the module docstring)."""
    if not any(_is_collective(b) for b in trace.bound_symbols):
        return trace
    inputs = {p.label for p in trace.inputs}
    outputs = {p.label for p in proxies_in(trace.output)}
    base = storage_bases(trace, inputs_may_alias=True)
    symbols = _starts_early(list(trace.bound_symbols), inputs, base)
    symbols = _waits_late(_copy_outs_last(symbols, outputs), base)
    return trace.derive(f"{trace.fn_name}, with collectives started early and waited late", symbols, trace.output)
