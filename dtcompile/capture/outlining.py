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

import torch

from ..core import BoundSymbol, TensorProxy, Trace
from ..core.block_call import BlockCall, BlockProgram, block_call
from ..core.op_classes import written_tensors
from ..core.proxy import is_proxy
from ..core.symbol import flatten, leaves
from . import block_calls
from .block_calls import SMALLEST_CALLED_BLOCK, fresh, program_name, sizes_held
from .equivalence import size_key

ENABLED = True  # False leaves every traced block's symbols in the trace (tests compare the two)
TEMPLATES_PER_CLASS = 8  # each stretch is compared with the first stretch of each way a class recorded


class Stretches:
    """Where the block calls traced as they are recorded their symbols: for each, its
    class, the symbol before it and its last symbol (the recording's list changes before
    and after it, where a template's first block becomes a call), and its path. Calls
    inside such calls too (a layer inside a model that takes a KV cache object)."""

    def __init__(self, symbols: list, taken: set[str]):
        self.symbols = symbols  # the recording's own list
        self.taken = taken  # the names of the block programs made so far
        self.found: list[tuple[type, BoundSymbol | None, BoundSymbol, str]] = []

    def traced(self, module, path: str, call):
        """``call()``: the block's call, traced as it is; its stretch noted."""
        before = self.symbols[-1] if self.symbols else None
        out = call()
        if self.symbols and self.symbols[-1] is not before:
            self.found.append((type(module), before, self.symbols[-1], path))
        return out

    def recorded(self, module, path: str, symbols: list) -> None:
        """A template's first call, recorded and refused (``blocks.py``): its stretch too."""
        if symbols:
            start = len(self.symbols) - len(symbols)
            self.found.append((type(module), self.symbols[start - 1] if start else None, symbols[-1], path))


class _Stretch:
    """A stretch's symbols, the values it takes from outside (in order of first use) and
    the proxies its symbols make (in order)."""

    def __init__(self, start: int, end: int, path: str, symbols: list, outside: list, made: list):
        self.start, self.end, self.path = start, end, path
        self.symbols, self.outside, self.made = symbols, outside, made


def outline(symbols: list, output, stretches: Stretches | None, inputs: list) -> tuple[list, list[str]]:
    """``symbols`` (the recording's) with alike stretches made calls of one program each
    (see the module docstring), and the trace's header lines saying which. ``inputs``: the
    trace's; ``stretches``: None where nothing is outlined (a call with gradients)."""
    if stretches is None or not ENABLED or not block_calls.BLOCK_CALLS:
        return symbols, []
    groups = _alike(symbols, stretches)
    if not groups:
        return symbols, []
    returned = _read_after(symbols, output, groups)
    replaced: list[tuple[_Stretch, BoundSymbol]] = []
    notes = []
    input_labels = {p.label for p in inputs}
    for index, group in enumerate(groups):
        program = _program(group, sorted(returned[index]), input_labels, stretches.taken)
        if program is None:
            continue
        call = block_call(program)
        positions = sorted(returned[index])
        for stretch in group:
            outputs = tuple(stretch.made[p] for p in positions)
            replaced.append((stretch, BoundSymbol(call, tuple(stretch.outside), {}, outputs)))
        shown = ", ".join(s.path for s in group[:3]) + (", ..." if len(group) > 3 else "")
        notes.append(f"{program.name}: one program for {len(group)} blocks traced alike ({shown})")
    if not replaced:
        return symbols, []
    result = list(symbols)
    for stretch, bsym in sorted(replaced, key=lambda pair: pair[0].start, reverse=True):
        result[stretch.start : stretch.end] = [bsym]
    return result, notes


def _alike(symbols: list, stretches: Stretches) -> list[list[_Stretch]]:
    """The groups of two or more alike stretches, each led by its first; where stretches
    overlap (a layer's attention, inside the layer), the longer ones' groups first."""
    where = {id(bsym): index for index, bsym in enumerate(symbols)}
    spans = []
    for cls, before, last, path in stretches.found:
        start = 0 if before is None else where.get(id(before), -2) + 1
        end = where.get(id(last), -1) + 1
        if start >= 0 and end - start >= SMALLEST_CALLED_BLOCK:  # (else changed since, or too small)
            spans.append((start, end, cls, path))
    by_class: dict[type, list[list[_Stretch]]] = {}
    for start, end, cls, path in sorted(spans, key=lambda span: span[:2]):
        span = symbols[start:end]
        groups = by_class.setdefault(cls, [])
        for group in groups:
            found = _match(group[0], span)
            if found is not None:
                group.append(_Stretch(start, end, path, span, *found))
                break
        else:
            if len(groups) < TEMPLATES_PER_CLASS:
                own = _own(span)
                if own is not None:
                    groups.append([_Stretch(start, end, path, span, *own)])
    candidates = [group for groups in by_class.values() for group in groups if len(group) > 1]
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
                elif y.label in taken or not isinstance(y, TensorProxy) or _metadata(x) != _metadata(y):
                    return None
                else:
                    outside[x.label] = y
                    taken.add(y.label)
            elif not _same_value(x, y):
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
            elif not _same_value(x, y):
                return None
    return [outside[p.label] for p in first.outside], made


def _metadata(proxy) -> tuple | None:
    """What a value from outside is compared by: sizes and strides (symbolic ones by
    expression), offset, dtype, device (from the proxy itself: its fake may not be made)."""
    if not isinstance(proxy, TensorProxy):
        return None
    return (
        tuple(map(size_key, proxy.shape)),
        tuple(map(size_key, proxy.stride())),
        size_key(proxy.storage_offset()),
        proxy.dtype,
        proxy.device,
        proxy.layout,
    )


_KINDS = {
    torch.SymInt: int,
    torch.SymFloat: float,
    torch.SymBool: bool,
}  # a size may be a symbol in one, a number in another


def _same_value(x, y) -> bool:
    """Whether two arguments that are not proxies are the same to the op: by exact type
    (a symbolic size as a number), floats by ``repr`` (``-0.0``, NaN), symbolic sizes by
    expression."""
    kind = _KINDS.get(type(x), type(x))
    if kind is not _KINDS.get(type(y), type(y)):
        return False
    if kind is float and type(x) is float and type(y) is float:
        return repr(x) == repr(y)
    if kind in (int, float, bool) and (type(x) in _KINDS or type(y) in _KINDS):
        return size_key(x) == size_key(y)
    if isinstance(x, torch.Tensor):
        return x is y
    return x == y


def _read_after(symbols: list, output, groups: list[list[_Stretch]]) -> list[set[int]]:
    """For each group, the places (in its stretches' made proxies) of the values that
    something outside their stretch reads, in any of them."""
    owner: dict[str, tuple[int, int, _Stretch]] = {}  # label -> (group, place, stretch)
    for index, group in enumerate(groups):
        for stretch in group:
            for place, proxy in enumerate(stretch.made):
                owner[proxy.label] = (index, place, stretch)
    returned: list[set[int]] = [set() for _ in groups]
    for position, bsym in enumerate(symbols):
        for proxy in bsym.input_proxies():
            found = owner.get(proxy.label)
            if found is not None and not found[2].start <= position < found[2].end:
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
    )
    memory = {p.memory: i for i, p in reversed(list(enumerate(inputs)))}  # (a view shares its base's)
    writes = {memory[p.memory] for b in first.symbols for p in written_tensors(b) if p.memory in memory}
    return BlockProgram(name, trace, first.path, writes=tuple(sorted(writes)))
