"""Repeated layers traced one by one, then called as one program.

A block that cannot be replayed (``blocks.py``) is traced at every layer: a Hugging Face
decoder layer, whose ``layer_idx`` picks the KV-cache layer it updates in place, runs its
Python for each layer, so each decision it makes is its own. What it records is still,
most often, the first such layer's symbols op for op with other tensors. While the call
is traced, :class:`Stretches` notes where each block call traced as it is recorded its
symbols (the outermost only: an attention traced inside a traced layer is the layer's).
Once the call is traced, :func:`outline` compares those of one class; where two or more
are alike, the first one's symbols become a
:class:`~dtcompile.core.block_call.BlockProgram`, and one ``BlockCall`` takes the place of
each: the passes and the lowering see the layer once, and the printed trace shows the
program once and a call per layer.

Alike (:func:`_match`): the same symbols in order (the same aten op, or a call of the
same block program) with the same arguments but for their proxies, which map one to one:
a value the stretch makes to the value the other makes at the same place, a value from
outside (the layer's weights, its cache tensors, the hidden state it is given) to a
value from outside with the same sizes, strides, dtype and device, the same one at every
use. A call only renames what tracing recorded, so it computes what the symbols it
replaces did, in their order.

A program returns the values of its stretch that something after the stretch reads, in
any of the alike stretches (a later symbol, the trace's output); each in memory of its
own. It takes the values from outside, tensors whose values tracing does not know, and
which hold every size it uses; and it names the inputs its ops write in place (a cache
updated with ``index_copy_``), so that its calls are in-place ops to the passes of the
trace that calls them (``transforms/effects.py``). Only without gradients.
"""

from __future__ import annotations

from ..core import BoundSymbol, NoProvenance, TensorProxy, Trace
from ..core.block_call import BlockCall, BlockProgram, block_call
from ..core.op_classes import written_tensors
from ..core.printing import NamedConstant
from ..core.proxy import is_proxy
from ..core.symbol import flatten, leaves
from . import block_calls
from .block_calls import SMALLEST_CALLED_BLOCK, fresh, fresh_like, program_name, sizes_held
from .equivalence import local_proxy, same_value, tensor_key
from .verified import LayerCalls, StandIn, VerifyFailed, verifiable

ENABLED = True  # False leaves every traced block's symbols in the trace (tests compare the two)
TEMPLATES_PER_CLASS = 8  # each stretch is compared with the first stretch of each way a class recorded


class Stretches:
    """Where the block calls traced as they are recorded their symbols: for each, its
    class, the symbol before it and its last symbol (the recording's list changes before
    and after it, where a template's first block becomes a call), and its path. Calls
    inside such calls too (a layer inside a model that takes a KV cache object). Later
    calls of a class may be checked rather than traced (``verified.py``)."""

    def __init__(self, recording, blocks):
        self.symbols = recording.bound_symbols  # the recording's own list
        self.taken = blocks.program_names  # the names of the block programs made so far
        self.recording = recording
        self.layers = LayerCalls(recording, blocks)
        self.found: list[tuple[type, BoundSymbol | None, BoundSymbol, str]] = []
        self._logs: dict[type, list] = {}

    def traced(self, module, path: str, call):
        """``call()``: the block's call, traced as it is (or checked); its stretch noted."""
        before = self.symbols[-1] if self.symbols else None
        outlined = ENABLED and block_calls.BLOCK_CALLS  # (checked calls need the programs outlining makes)
        out, log, stand_in = self.layers.run(module, call) if outlined else (call(), None, None)
        if stand_in is not None:
            self.symbols.append(stand_in)
        elif self.symbols and self.symbols[-1] is not before:
            self.found.append((type(module), before, self.symbols[-1], path))
            if log is not None:
                self._logged(type(module), log, self.found[-1])
        return out

    def recorded(self, module, path: str, symbols: list) -> None:
        """A template's first call, recorded and refused (``blocks.py``): its stretch too."""
        if symbols:
            start = len(self.symbols) - len(symbols)
            self.found.append(
                (
                    type(module),
                    self.symbols[start - 1] if start else None,
                    symbols[-1],
                    path,
                )
            )

    def _logged(self, cls, log, stretch: tuple) -> None:
        """A logged call's stretch; at the second, whether later calls may be checked."""
        logs = self._logs.setdefault(cls, [])
        logs.append((log, stretch))
        if len(logs) < 2:
            return
        (first, where), (second, _) = logs
        stand_in = self._stand_in(first, where) if first.alike(second) else None
        if stand_in is None:
            self.layers.calls[cls] = None
        else:
            self.layers.ready[cls] = stand_in

    def _stand_in(self, log, stretch: tuple) -> StandIn | None:
        where = {id(bsym): index for index, bsym in enumerate(self.symbols)}
        _, before, last, _ = stretch
        start = 0 if before is None else where.get(id(before), -2) + 1
        end = where.get(id(last), -1) + 1
        own = _own(self.symbols[start:end]) if 0 <= start < end else None
        if own is None or not verifiable(self.symbols[start:end]):
            return None
        outside, made = own
        labels = {p.label for p in made}
        if not all(getattr(local_proxy(x), "label", None) in labels for x in log.made):
            return None  # a call returned a tensor the symbols did not make
        places = {id(local_proxy(x)): k for k, x in enumerate(log.outside) if local_proxy(x) is not None}
        if not all(isinstance(p, TensorProxy) and p.value is None and id(p) in places for p in outside):
            return None  # it reads a tensor no call took (a number, a captured one)
        return StandIn(
            log,
            [places[id(p)] for p in outside],
            {p.label: i for i, p in enumerate(made)},
            stretch,
        )


class _Stretch:
    """A stretch's symbols, the values it takes from outside (in order of first use) and
    the proxies its symbols make (in order)."""

    def __init__(
        self,
        start: int,
        end: int,
        path: str,
        symbols: list,
        outside: list,
        made: list,
        found: tuple,
    ):
        self.start, self.end, self.path = start, end, path
        self.symbols, self.outside, self.made = symbols, outside, made
        self.found = found  # its entry in ``Stretches.found``


def outline(symbols: list, output, stretches: Stretches | None, inputs: list, training: bool) -> tuple[list, list[str]]:
    """``symbols`` (the recording's) with alike stretches made calls of one program each
    (see the module docstring), and with checked calls (``verified.py``) calls of the
    program of the stretch they were checked against; and the trace's header lines saying
    which. ``inputs``: the trace's; ``stretches``: None where no block was traced as it
    is; with ``training`` (a call with gradients), nothing is outlined. Raises
    ``VerifyFailed`` where a check failed and the user's code went on past it, or a
    call with gradients checked a layer (inside ``no_grad``)."""
    if stretches is not None and (stretches.layers.failed or (training and stretches.layers.pending)):
        raise VerifyFailed(f"a layer checked against a logged one: {stretches.layers.failed or 'with gradients'}")
    if stretches is None or training or not ENABLED or not block_calls.BLOCK_CALLS:
        return symbols, []
    pending = stretches.layers.pending
    groups = _alike(symbols, stretches, {id(stand_in.stretch) for _, stand_in, _ in pending})
    group_of = {id(s.found): index for index, group in enumerate(groups) for s in group}
    if any(id(stand_in.stretch) not in group_of for _, stand_in, _ in pending):
        raise VerifyFailed("the layer checked calls stood for is not in the trace as it recorded it")
    returned = _read_after(symbols, output, groups, [(group_of[id(s.stretch)], places) for _, s, places in pending])
    replaced: list[tuple[int, int, BoundSymbol]] = []
    notes = []
    input_labels = {p.label for p in inputs}
    where = {id(bsym): index for index, bsym in enumerate(symbols)}
    for index, group in enumerate(groups):
        positions = sorted(returned[index])
        program = _program(group, positions, input_labels, stretches.taken)
        checked = [(bsym, places) for bsym, stand_in, places in pending if group_of[id(stand_in.stretch)] == index]
        if program is None:
            if checked:
                raise VerifyFailed("the layer checked calls stood for cannot be a program")
            continue
        call = block_call(program)
        for stretch in group:
            outputs = tuple(stretch.made[p] for p in positions)
            replaced.append(
                (
                    stretch.start,
                    stretch.end,
                    BoundSymbol(call, tuple(stretch.outside), {}, outputs),
                )
            )
        for bsym, places in checked:
            made_by = NoProvenance("a checked layer's output nothing reads")
            outputs = tuple(
                places[p] if p in places else fresh_like(stretches.recording, group[0].made[p], made_by)
                for p in positions
            )
            at = where[id(bsym)]
            replaced.append((at, at + 1, BoundSymbol(call, bsym.args, {}, outputs)))
        count = len(group) + len(checked)
        shown = ", ".join(s.path for s in group[:3]) + (", ..." if count > 3 else "")
        notes.append(f"{program.name}: one program for {count} blocks traced alike ({shown})")
    if not replaced:
        return symbols, []
    result = list(symbols)
    for start, end, bsym in sorted(replaced, key=lambda entry: entry[0], reverse=True):
        result[start:end] = [bsym]
    return result, notes


def _alike(symbols: list, stretches: Stretches, needed: set[int]) -> list[list[_Stretch]]:
    """The groups of two or more alike stretches (or one that checked calls stood for:
    ``needed``, by id of their entries), each led by its first; where stretches overlap (a
    layer's attention, inside the layer), the longer ones' groups first."""
    where = {id(bsym): index for index, bsym in enumerate(symbols)}
    spans = []
    for found in stretches.found:
        cls, before, last, path = found
        start = 0 if before is None else where.get(id(before), -2) + 1
        end = where.get(id(last), -1) + 1
        if start >= 0 and end - start >= SMALLEST_CALLED_BLOCK:  # (else changed since, or too small)
            spans.append((start, end, cls, path, found))
    by_class: dict[type, list[list[_Stretch]]] = {}
    for start, end, cls, path, found in sorted(spans, key=lambda span: span[:2]):
        span = symbols[start:end]
        groups = by_class.setdefault(cls, [])
        for group in groups:
            matched = _match(group[0], span)
            if matched is not None:
                group.append(_Stretch(start, end, path, span, *matched, found))
                break
        else:
            if len(groups) < TEMPLATES_PER_CLASS:
                own = _own(span)
                if own is not None:
                    groups.append([_Stretch(start, end, path, span, *own, found)])
    candidates = [
        g for groups in by_class.values() for g in groups if len(g) > 1 or any(id(s.found) in needed for s in g)
    ]
    taken: list[tuple[int, int]] = []
    kept = []
    for group in sorted(candidates, key=lambda g: g[0].end - g[0].start, reverse=True):
        if not any(s.start < end and start < s.end for s in group for start, end in taken):
            kept.append(group)
            taken += [(s.start, s.end) for s in group]
    return sorted(kept, key=lambda g: g[0].start)


def _callable_symbol(bsym: BoundSymbol) -> bool:
    return bsym.op is not None or isinstance(bsym.symbol, BlockCall)


def _own(span: list) -> tuple[list, list] | None:
    """A first stretch's values from outside and the proxies it makes; None where it holds
    a symbol a program cannot (one of dtcompile's own, other than a block call)."""
    made: list = []
    defined: set[str] = set()
    outside: dict[str, object] = {}
    for bsym in span:
        if not _callable_symbol(bsym):
            return None
        for proxy in bsym.input_proxies():
            if proxy.label not in defined:
                outside.setdefault(proxy.label, proxy)
        outs = bsym.output_proxies()
        made += outs
        defined.update(p.label for p in outs)
    return list(outside.values()), made


def _match(first: _Stretch, span: list) -> tuple[list, list] | None:
    """``span``'s values from outside, in the order of ``first``'s, and the proxies it
    makes; None where it is not alike (see the module docstring)."""
    if len(span) != len(first.symbols):
        return None
    inside: dict[str, object] = {}  # first's label -> span's proxy, for what the stretches make
    outside: dict[str, object] = {}  # first's label -> span's proxy, for what they read from outside
    taken: set[str] = set()  # span's labels that are outside values of it, or made by it
    made: list = []
    for a, b in zip(first.symbols, span):
        if a.op is not b.op or not _callable_symbol(b):
            return None
        if a.op is None and a.symbol.block is not b.symbol.block:
            return None
        xs, structure = flatten((a.args, a.kwargs))
        ys, other = flatten((b.args, b.kwargs))
        if structure != other or len(xs) != len(ys):
            return None
        for x, y in zip(xs, ys):
            if is_proxy(x):
                if type(x) is not type(y):
                    return None
                known = inside.get(x.label)
                if known is not None:
                    if known is not y:
                        return None
                elif x.label in outside:
                    if outside[x.label] is not y:
                        return None
                elif y.label in taken or not isinstance(y, TensorProxy) or tensor_key(x) != tensor_key(y):
                    return None
                else:
                    outside[x.label] = y
                    taken.add(y.label)
            elif not same_value(x, y):
                return None
        xs, ys = leaves(a.output), leaves(b.output)
        if len(xs) != len(ys):
            return None
        for x, y in zip(xs, ys):
            if is_proxy(x):
                if type(x) is not type(y) or y.label in taken:
                    return None
                inside[x.label] = y
                taken.add(y.label)
                made.append(y)
            elif not same_value(x, y):
                return None
    return [outside[p.label] for p in first.outside], made


def _read_after(symbols: list, output, groups: list[list[_Stretch]], checked: list[tuple[int, dict]]) -> list[set[int]]:
    """For each group, the places (in its stretches' made proxies) of the values that
    something outside their stretch reads, in any of them, or that anything reads of a
    checked call's (``checked``: its group, and its tensors by place)."""
    owner: dict[str, tuple[int, int, _Stretch | None]] = {}  # label -> (group, place, stretch)
    for index, group in enumerate(groups):
        for stretch in group:
            for place, proxy in enumerate(stretch.made):
                owner[proxy.label] = (index, place, stretch)
    for index, places in checked:
        for place, proxy in places.items():
            owner[proxy.label] = (index, place, None)
    returned: list[set[int]] = [set() for _ in groups]
    for position, bsym in enumerate(symbols):
        for proxy in bsym.input_proxies():
            found = owner.get(proxy.label)
            if found is not None and (found[2] is None or not found[2].start <= position < found[2].end):
                returned[found[0]].add(found[1])
    for leaf in leaves(output):
        found = owner.get(leaf.label) if is_proxy(leaf) else None
        if found is not None:
            returned[found[0]].add(found[1])
    return returned


def _program(group: list[_Stretch], places: list[int], input_labels: set[str], taken: set[str]):
    """The first stretch's program, returning its proxies at ``places``; None where a
    program cannot stand for the stretches (see the module docstring)."""
    first = group[0]
    inputs = first.outside
    outputs = [first.made[p] for p in places]
    if not outputs or not all(isinstance(p, TensorProxy) for p in (*inputs, *outputs)):
        return None  # a number from outside, or one read after it
    if any(p.value is not None for p in inputs) or not fresh(outputs, inputs):
        return None
    if not sizes_held(first.symbols, inputs):
        return None
    name = program_name(first.path, taken)
    notes = {p.label: str(p.provenance) if p.label in input_labels else "a value from before it" for p in inputs}
    title = f"block program {name}: {first.path}'s call, called for every block traced alike"
    trace = Trace(
        fn_name=name,
        inputs=inputs,
        bound_symbols=list(first.symbols),
        output=tuple(outputs),
        title=title,
        input_notes=notes,
        # (a generator its random ops take: named in its source, given under that name)
        globals={
            c.label: (c.value, None)
            for b in first.symbols
            for c in leaves((b.args, b.kwargs))
            if type(c) is NamedConstant
        },
    )
    memory = {p.memory: i for i, p in reversed(list(enumerate(inputs)))}  # (a view shares its base's)
    writes = {memory[p.memory] for b in first.symbols for p in written_tensors(b) if p.memory in memory}
    return BlockProgram(name, trace, first.path, writes=tuple(sorted(writes)))
