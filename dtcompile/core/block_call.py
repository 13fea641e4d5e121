"""Block calls: a repeated block's program, traced once, called once per layer.

A :class:`BlockProgram` is the trace of one block's first call, its inputs being the
tensors it reads (its parameters, its arguments), its outputs the tensors it returns. A
:class:`BlockCall` is the symbol a trace calls it by, once per equivalent block, with that
block's tensors: ``t57, = block_0(t20, t21, t22)``. The passes and the lowering run on
the block's program once (``jit/compiled.py``); to the passes of the trace that calls it,
a call is one op whose outputs are fresh tensors. It is pure where the program writes
none of its inputs and runs no collective (``capture/block_calls.py`` makes calls only of such blocks); a
program that writes some (a layer updating its KV cache in place, ``capture/outlining.py``)
names them (``BlockProgram.writes``), and its calls are in-place ops on those arguments
(``transforms/effects.py``). A program may call other block programs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from .op_classes import is_communication
from .printing import output_target, python_literal
from .symbol import BoundSymbol, Symbol
from .trace import Trace


class BlockProgram:
    """One block's program and what the compilation made of it: the traces of its passes
    and its execution trace (``traces``), and the function that runs it (``function``)."""

    def __init__(self, name: str, trace: Trace, source: str, steals: bool = False, writes: tuple[int, ...] = ()):
        self.name = name
        self.trace = trace  # as recorded
        self.source = source  # the path of the block it was recorded from
        self.writes = writes  # the positions of the inputs it writes in place
        # Takes its arguments as one list, which it empties (``Trace.steals_inputs``): a
        # backward's saved values are then freed as it goes, not when it returns.
        self.steals = steals
        self.traces: list[Trace] = []
        self.checked: Trace | None = None  # what the ranks compare (the last before the finishing passes)
        self.function = None

    def __repr__(self) -> str:
        return f"BlockProgram({self.name})"


class _Run:
    """What a block call's name stands for in a program: the block's compiled function, or,
    in a trace compiled before its blocks are (a recorded trace run as the reference of
    ``check="eager"``), the block's recorded program interpreted."""

    def __init__(self, block: BlockProgram):
        self.block = block

    def __call__(self, *args):
        if self.block.function is not None:
            return self.block.function(*args)
        from .interpret import interpret

        if not self.block.steals:
            return interpret(self.block.trace, *args)
        (stolen,) = args
        inputs = list(stolen)
        stolen.clear()
        return interpret(self.block.trace, *inputs)

    def __repr__(self) -> str:
        return f"the program of block {self.block.name}"


@dataclass(frozen=True, repr=False)
class BlockCall(Symbol):
    """A call of a block's program (see the module docstring)."""

    block: BlockProgram | None = field(default=None, compare=False)
    pure: bool = True
    steals: bool = False  # the call takes its arguments as one list (``BlockProgram.steals``)
    writes: tuple[int, ...] = ()  # the arguments it writes in place (then it is not pure)

    def lines(self, bsym: BoundSymbol) -> list[str]:
        if not self.steals:
            return super().lines(bsym)
        return self.stealing_lines(bsym, [])

    def stealing_lines(self, bsym: BoundSymbol, let_go: list[str]) -> list[str]:
        """The call, its arguments put in a list first and the names ``let_go`` deleted
        before it runs: the block then holds the only references, and frees each value
        after its last use."""
        lines = [f"stolen = {python_literal(list(bsym.args))}"]
        if let_go:
            lines.append(f"del {', '.join(let_go)}")
        return lines + [f"{output_target(bsym.output)} = {self.name}(stolen)"]

    def __repr__(self) -> str:
        return f"BlockCall({self.name})"


def block_call(block: BlockProgram) -> BlockCall:
    """The symbol that calls ``block``: pure unless it writes an argument or communicates (a
    collective every rank runs, whether or not this rank's code uses the block's outputs)."""
    globals_ = ((block.name, _Run(block), None),)
    pure = not block.writes and not _communicates(block.trace)
    return BlockCall(
        name=block.name, block=block, globals=globals_, steals=block.steals, writes=block.writes, pure=pure
    )


def _communicates(trace: Trace) -> bool:
    for bsym in trace.bound_symbols:
        if is_communication(bsym.op) or (isinstance(bsym.symbol, BlockCall) and not bsym.symbol.pure):
            return True
    return False


def with_block_symbols(symbols, lowered: bool = False) -> Iterator[BoundSymbol]:
    """``symbols``, each block call followed by the symbols of its block's program: as it
    runs (``lowered``, once compiled), else as the ranks compare it (or as recorded). What
    runs at each call, for questions about collectives."""
    for bsym in symbols:
        yield bsym
        if isinstance(bsym.symbol, BlockCall):
            block = bsym.symbol.block
            program = block.traces[-1] if lowered and block.traces else block.checked or block.trace
            yield from with_block_symbols(program.bound_symbols, lowered)


def block_programs(trace: Trace) -> list[BlockProgram]:
    """The block programs ``trace`` calls, each once, in order of first call; a program
    another calls comes before it."""
    found: dict[int, BlockProgram] = {}
    for bsym in trace.bound_symbols:
        if isinstance(bsym.symbol, BlockCall) and id(bsym.symbol.block) not in found:
            for inner in block_programs(bsym.symbol.block.trace):
                found.setdefault(id(inner), inner)
            found.setdefault(id(bsym.symbol.block), bsym.symbol.block)
    return list(found.values())
