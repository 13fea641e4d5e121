"""Repeated blocks called, not recorded again: a replayable block's program becomes a
:class:`~dtcompile.core.block_call.BlockProgram`, and each call of an equivalent block
one ``BlockCall`` symbol (``blocks.py`` decides which blocks are equivalent).

Only calls without gradients, and only blocks whose program is a pure function of the
tensors it reads, so that the passes of the calling trace may treat a call as one op:
no op of the block writes to memory of its inputs (a KV cache updated in place), its
outputs are fresh tensors (none views an input or another output), and every size it
uses is held by one of its inputs (the block's own passes compute its sizes from them).
Small blocks (a projection) are recorded again instead: a call saves little there.
"""

from __future__ import annotations

import re

import torch

from ..core import BoundSymbol, NoProvenance, TensorProxy, Trace
from ..core.block_call import BlockProgram, block_call
from ..core.symbol import leaves
from ..core.symbolic import is_symbolic, symbolic_expr
from ..core.torch_internals import fake_like

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
    if outputs is None or not _pure(template.symbols, inputs, outputs) or not _sizes_held(template.symbols, inputs):
        return None
    name = _name(path, taken)
    notes = {p.label: _source_note(template.sources[p.label]) for p in inputs}
    trace = Trace(
        fn_name=name,
        inputs=inputs,
        bound_symbols=list(template.symbols),
        output=tuple(outputs),
        title=f"block program {name}: {path or 'the module'}'s first call, called for every block like it",
        input_notes=notes,
    )
    return BlockProgram(name, trace, path)


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
    outputs = []
    for old in program.trace.output:
        fake = fake_like(recording.fake_mode, old.fake, None, False)
        outputs.append(mapping.setdefault(old.label, TensorProxy(fake, recording.new_name(), made_by)))
    args = tuple(mapping[p.label] for p in program.trace.inputs)
    recording.bound_symbols.append(BoundSymbol(block_call(program), args, {}, tuple(outputs)))


def _outputs(template, free: dict[str, TensorProxy]) -> list[TensorProxy] | None:
    """The tensors the block makes and returns, each once; None if one shares memory with
    another or with an input, or starts past its storage's start (a later call's output is
    made as fresh memory)."""
    outputs: dict[str, TensorProxy] = {}
    for entry in template.output[1]:
        if entry[0] in ("dtensor", "tensor") and entry[1].label not in free:
            outputs.setdefault(entry[1].label, entry[1])
    storages = [p.memory for p in outputs.values()]
    inputs = {p.memory for p in free.values()}
    if len(set(storages)) != len(storages) or inputs & set(storages):
        return None
    if any(p.fake.storage_offset() != 0 or p.value is not None for p in outputs.values()):
        return None
    return list(outputs.values())


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


def _sizes_held(symbols: list, inputs: list[TensorProxy]) -> bool:
    """Every size symbol the block uses is one of its inputs' sizes, strides or offsets."""
    held = set()
    for p in inputs:
        for x in (*p.shape, *p.stride(), p.storage_offset()):
            if is_symbolic(x):
                held |= symbolic_expr(x).free_symbols
    used = set()
    for bsym in symbols:
        values = leaves((bsym.args, bsym.kwargs))
        values += [x for t in bsym.output_tensors() for x in (*t.shape, *t.stride(), t.storage_offset())]
        for x in values:
            if is_symbolic(x):
                used |= symbolic_expr(x).free_symbols
    return used <= held


def _name(path: str, taken: set[str]) -> str:
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
