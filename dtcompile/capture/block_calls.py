"""Repeated blocks called, not recorded again: a replayable block's program becomes a
:class:`~dtcompile.core.block_call.BlockProgram`, and each call of an equivalent block
one ``BlockCall`` symbol (``blocks.py`` decides which blocks are equivalent).

Only blocks whose program is a pure function of the tensors it reads, so that the passes
of the calling trace may treat a call as one op: no op of the block writes to memory of
its inputs (a KV cache updated in place), its outputs are fresh tensors (none shares
memory with an input or another output), and every size it uses is held by one of its
inputs (the block's own passes compute its sizes from them). Small blocks (a
projection) are recorded again instead: a call saves little there.

With gradients, a block is two programs (:func:`training_programs`): its forward, which
returns beside the block's outputs the values its backward reads, and its backward (for
one set of incoming gradients), which takes those values and the gradients that arrive
and returns the block's gradients. A value the backward reads that views another (``w.t()``,
a reshape) is not returned: the backward takes what it views and makes the view again.
"""

from __future__ import annotations

import re
from functools import partial

import torch

from ..core import BoundSymbol, NoProvenance, TensorProxy, Trace
from ..core.block_call import BlockProgram, block_call
from ..core.prims import size_query
from ..core.symbol import leaves
from ..core.symbolic import is_symbolic, symbolic_expr
from ..core.torch_internals import fake_like
from .equivalence import local_proxy

BLOCK_CALLS = True  # False records every replayed block's symbols again (tests compare the two)
SMALLEST_CALLED_BLOCK = 8  # symbols


def block_program(template, free: dict[str, TensorProxy], path: str, taken: set[str]) -> BlockProgram | None:
    """The template's program, called for each equivalent block; None where calls without
    gradients cannot stand for it (see the module docstring). ``free``: the tensors it
    reads from outside, in order; ``taken``: the names of the programs made so far."""
    if not BLOCK_CALLS or torch.is_grad_enabled() or len(template.symbols) < SMALLEST_CALLED_BLOCK:
        return None
    inputs = list(free.values())
    outputs = _outputs(template, free)
    if outputs is None or not _callable(template.symbols, inputs, outputs):
        return None
    name = program_name(path, taken)
    notes = {p.label: _source_note(template.sources[p.label]) for p in inputs}
    title = f"block program {name}: {path or 'the module'}'s first call, called for every block like it"
    return _program(name, inputs, list(template.symbols), outputs, title, notes, path)


def training_programs(template, path: str, taken: set[str]) -> tuple[BlockProgram, BlockProgram] | None:
    """With gradients: the block's forward program, returning the block's tensors and then
    what its backward (the template's first, for the gradients an output's placements
    bring) reads of the forward; and that backward's program. None where calls cannot
    stand for them (see the module docstring)."""
    if not BLOCK_CALLS or len(template.symbols) < SMALLEST_CALLED_BLOCK or len(template.backwards) != 1:
        return None
    backward = next(iter(template.backwards.values()))
    inputs = list(template.free.values())
    outputs = _outputs(template, template.free)
    if outputs is None:
        return None
    _, bases = _saved_bases(template, backward.symbols)
    returned = {p.label for p in (*inputs, *outputs)}
    outputs += [p for p in bases if p.label not in returned]
    if not fresh(outputs, inputs) or not _callable(template.symbols, inputs, outputs):
        return None
    name = program_name(path, taken)
    notes = {p.label: _source_note(template.sources[p.label]) for p in inputs}
    title = f"block program {name}: {path or 'the module'}'s first forward, called for every block like it"
    forward = _program(name, inputs, list(template.symbols), outputs, title, notes, path)
    backward_call = backward_program(template, forward, backward, taken)
    return None if backward_call is None else (forward, backward_call)


def backward_program(template, forward: BlockProgram, backward, taken: set[str]) -> BlockProgram | None:
    """The program of ``backward`` (a ``BackwardTemplate`` of the block whose forward
    program is ``forward``): it takes what it reads of the forward (``forward``'s inputs
    and outputs), then the incoming gradients, and returns the block's gradients. None
    where it reads another of the forward's values, or cannot be called."""
    views, bases = _saved_bases(template, backward.symbols)
    available = {p.label for p in (*forward.trace.inputs, *forward.trace.output)}
    if any(p.label not in available for p in bases):
        return None
    inputs = bases + [c for c in backward.cotangents if c is not None]
    symbols = [template.symbols[i] for i in views] + list(backward.symbols)
    grads: dict[str, TensorProxy] = {}
    for grad in backward.grads:
        if grad is not None:
            local = local_proxy(grad)
            grads.setdefault(local.label, local)
    outputs = list(grads.values())
    if not _defined_in_order(symbols, inputs, outputs) or not fresh(outputs, inputs):
        return None
    if not _callable(symbols, inputs, outputs):
        return None
    name = program_name(f"{forward.source}_backward", taken)
    given = forward.trace.input_notes  # the block's own tensors and the call's arguments
    notes = {p.label: given.get(p.label, f"a value {forward.name} returns") for p in bases}
    notes.update({c.label: "the incoming gradient" for c in inputs[len(bases) :]})
    title = f"block program {name}: the backward of {forward.name}, called for every block like it"
    # It frees what the forward saved as it goes, as a backward does (``BlockProgram.steals``).
    return _program(name, inputs, symbols, outputs, title, notes, forward.source, steals=True)


def _program(
    name: str, inputs: list, symbols: list, outputs: list, title: str, notes: dict, path: str, steals: bool = False
) -> BlockProgram:
    trace = Trace(
        fn_name=name, inputs=inputs, bound_symbols=symbols, output=tuple(outputs), title=title, input_notes=notes
    )
    return BlockProgram(name, trace, path, steals)


def _saved_bases(template, backward_symbols: list) -> tuple[list[int], list[TensorProxy]]:
    """What ``backward_symbols`` read of the block's forward: the indices of the forward's
    view symbols that make a value they read from another (in order), and the values
    those views start from, with every other forward value they read (each once)."""
    made: dict[str, tuple[int, int]] = {}  # label -> (its symbol's index, its place among the outputs)
    for index, bsym in enumerate(template.symbols):
        for place, out in enumerate(leaves(bsym.output)):
            if isinstance(out, TensorProxy):
                made[out.label] = (index, place)
    defined: set[str] = set()
    views: set[int] = set()
    bases: dict[str, TensorProxy] = {}
    for bsym in backward_symbols:
        for proxy in bsym.input_proxies():
            if proxy.label in defined or (proxy.label not in made and proxy.label not in template.free):
                continue  # the backward's own, or a cotangent
            while proxy.label in made:
                index, place = made[proxy.label]
                aliases = template.aliases[index]
                if aliases is None or aliases[place] is None:
                    break  # made in memory of its own (or by an op that must run): returned itself
                views.add(index)
                proxy = template.symbols[index].input_tensors()[aliases[place]]
            bases.setdefault(proxy.label, proxy)
        defined.update(p.label for p in bsym.output_proxies())
    return sorted(views), list(bases.values())


def _defined_in_order(symbols: list, inputs: list, outputs: list) -> bool:
    """Whether every value the symbols read is an input (a tensor) or made before, and
    every output is made by them."""
    if not all(isinstance(p, TensorProxy) for p in inputs):
        return False
    defined = {p.label for p in inputs}
    made: set[str] = set()
    for bsym in symbols:
        if any(p.label not in defined for p in bsym.input_proxies()):
            return False
        labels = {p.label for p in bsym.output_proxies()}
        defined |= labels
        made |= labels
    return all(p.label in made for p in outputs)


def _callable(symbols: list, inputs: list[TensorProxy], outputs: list[TensorProxy]) -> bool:
    return _pure(symbols, inputs, outputs) and sizes_held(symbols, inputs)


def first_call(recording, program: BlockProgram) -> bool:
    """Replace the first block's symbols in the recording with a call of its program (its
    own tensors in, its own outputs out); False where they are not there as recorded."""
    symbols, trace = recording.bound_symbols, program.trace
    first = trace.bound_symbols[0]
    start = next((i for i in range(len(symbols) - 1, -1, -1) if symbols[i] is first), None)
    end = None if start is None else start + len(trace.bound_symbols)
    if start is None or not all(a is b for a, b in zip(symbols[start:end], trace.bound_symbols)):
        return False
    symbols[start:end] = [BoundSymbol(block_call(program), tuple(trace.inputs), {}, trace.output)]
    return True


def call_again(recording, program: BlockProgram, mapping: dict[str, TensorProxy]) -> None:
    """Record a call of ``program`` for a later block: ``mapping`` gives the block's tensor
    for each of the program's inputs, and learns its new outputs (fresh tensors like the
    first call's)."""
    made_by = NoProvenance(program.name)
    # Each one's fake is made only if something reads it: most are only passed to another call.
    outputs = [mapping.setdefault(old.label, fresh_like(recording, old, made_by)) for old in program.trace.output]
    args = tuple(mapping[p.label] for p in program.trace.inputs)
    recording.bound_symbols.append(BoundSymbol(block_call(program), args, {}, tuple(outputs)))


def fresh_like(recording, old: TensorProxy, made_by) -> TensorProxy:
    """A new tensor like ``old``, in memory of its own; its fake made only when read."""
    like = old.fake
    make = partial(fake_like, recording.fake_mode, like, None, False)
    return TensorProxy.deferred(like, make, recording.new_name(), made_by, False)


def _outputs(template, free: dict[str, TensorProxy]) -> list[TensorProxy] | None:
    """The tensors the block makes and returns, each once; None if one shares memory with
    another or with an input, or starts past its storage's start (a later call's output is
    made as fresh memory)."""
    outputs: dict[str, TensorProxy] = {}
    for entry in template.output[1]:
        if entry[0] in ("dtensor", "tensor") and entry[1].label not in free:
            outputs.setdefault(entry[1].label, entry[1])
    return list(outputs.values()) if fresh(list(outputs.values()), list(free.values())) else None


def fresh(outputs: list[TensorProxy], inputs: list[TensorProxy]) -> bool:
    """Whether each output is in memory of its own (shared with no input nor other
    output), from its start, with no value tracing knows."""
    storages = [p.memory for p in outputs]
    if len(set(storages)) != len(storages) or {p.memory for p in inputs} & set(storages):
        return False
    return all(p.fake.storage_offset() == 0 and p.value is None for p in outputs)


def _pure(symbols: list, inputs: list[TensorProxy], outputs: list[TensorProxy]) -> bool:
    """No op writes to memory of the block's inputs (conservatively: no in-place or
    ``out=`` op reads a tensor in an input's storage), and every op is an aten op."""
    storages = {p.memory for p in inputs}
    for bsym in symbols:
        if bsym.op is None:
            return False
        if bsym.op._schema.is_mutable and any(p.memory in storages for p in bsym.input_tensors()):
            return False
    return bool(outputs)


def sizes_held(symbols: list, inputs: list[TensorProxy]) -> bool:
    """Every size the block uses can be computed from its inputs, as its program's passes
    will (``transforms/sizes.py``): it is one of their sizes, strides or offsets, or each
    of its symbols is (a block given a sequence's local shard, ``ceil(s/2)``, that gathers
    it needs ``s`` itself, which no input holds)."""
    used = set()
    for bsym in symbols:
        values = leaves((bsym.args, bsym.kwargs))
        values += [x for t in bsym.output_tensors() for x in (*t.shape, *t.stride(), t.storage_offset())]
        used.update(symbolic_expr(x) for x in values if is_symbolic(x))
    return all(
        size_query(expr, inputs) is not None or all(size_query(s, inputs) is not None for s in expr.free_symbols)
        for expr in used
    )


def program_name(path: str, taken: set[str]) -> str:
    base = "block_" + (re.sub(r"\W", "_", path) or "module")
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def _source_note(sources: list) -> str:
    kind, where = sources[0]
    return f"the block's {where}" if kind == "module" else f"the call's argument leaf {where}"
