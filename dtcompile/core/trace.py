"""Traces: a function as a list of bound symbols, printable as runnable Python.

A trace has named inputs (proxies, each with its provenance), bound symbols in program
order, and an output (a pytree of proxies and constants). ``str(trace)`` is its Python
source; :meth:`Trace.compile` runs exactly that source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from .codegen import compile_function
from .printing import python_literal
from .provenance import FromData
from .proxy import NumberProxy, TensorProxy, is_proxy
from .symbol import BoundSymbol, proxies_in


@dataclass(frozen=True)
class Zeros:
    """Stands for a tensor of zeros that is made only where a program first reads it: the
    gradient of an output autograd computed none for (an unused cache a model returns),
    which would otherwise be alive, as zeros, through the whole backward."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device


def made(value):
    """``value``, or the zeros a :class:`Zeros` stands for."""
    if type(value) is Zeros:
        return torch.zeros(value.shape, dtype=value.dtype, device=value.device)
    return value


@dataclass
class Trace:
    """A straight-line program over proxies.

    ``globals`` maps names the body uses to ``(object, source)``: ``source`` is the
    header line's right-hand side that recreates the object, or ``None`` when the object
    has no literal (it is then described in a comment and given to the compiled code).
    """

    fn_name: str
    inputs: list[TensorProxy]
    bound_symbols: list[BoundSymbol]
    output: object
    title: str = ""
    header_notes: list[str] = field(default_factory=list)
    input_notes: dict[str, str] = field(default_factory=dict)
    globals: dict[str, tuple[object, str | None]] = field(default_factory=dict)
    # The function takes its inputs as one list, which it empties: the caller then holds
    # no reference, and each input is freed after its last use (a backward's saved values).
    steals_inputs: bool = False
    # ``del`` each value after the symbol that reads it last (or defines it, when none
    # does), outputs excepted: the function would otherwise keep every intermediate alive
    # until it returns. Execution traces do; the traces of the passes print without.
    frees_values: bool = False
    # Inputs that may come as a :class:`Zeros`: made into a tensor just before the first
    # symbol that reads each (or the return).
    deferred_inputs: frozenset[str] = frozenset()

    def derive(self, title: str, bound_symbols: list[BoundSymbol], output: object | None = None) -> Trace:
        """A new trace with the same inputs and header, made by a pass called ``title``."""
        return Trace(
            fn_name=self.fn_name,
            inputs=list(self.inputs),
            bound_symbols=bound_symbols,
            output=self.output if output is None else output,
            title=title,
            header_notes=list(self.header_notes),
            input_notes=dict(self.input_notes),
            globals=dict(self.globals),
        )

    def all_globals(self) -> dict[str, tuple[object, str | None]]:
        merged = dict(self.globals)
        if self.deferred_inputs:
            merged["made"] = (made, "from dtcompile.core.trace import made")
        for bsym in self.bound_symbols:
            for name, obj, source in bsym.symbol.globals:
                merged.setdefault(name, (obj, source))
        return merged

    def body_lines(self) -> list[str]:
        names = ", ".join(p.label for p in self.inputs)
        lines = [f"def {self.fn_name}({'inputs' if self.steals_inputs else names}):"]
        types_made: dict = {}  # no guard is added while printing: each answer holds throughout
        for proxy in self.inputs:
            note = self.input_notes.get(proxy.label, str(proxy.provenance))
            text = proxy.type_string(types_made) if isinstance(proxy, TensorProxy) else proxy.type_string()
            lines.append(f"    # {proxy.label}: {text}  {note}")
        if self.steals_inputs:
            if self.inputs:
                lines.append(f"    {names}{',' if len(self.inputs) == 1 else ''} = inputs")
            lines.append("    inputs.clear()")
        last_note = None
        freed = self._frees() if self.frees_values else {}
        deferred = set(self.deferred_inputs)
        for index, bsym in enumerate(self.bound_symbols):
            if deferred:
                for proxy in bsym.input_proxies():
                    if proxy.label in deferred:
                        deferred.discard(proxy.label)
                        lines.append(f"    {proxy.label} = made({proxy.label})")
            note = None if bsym.note is None else str(bsym.note)
            if note is not None and note != last_note:
                lines.append(f"    # {note}")
            last_note = note
            statements = bsym.lines()
            if index in freed and getattr(bsym.symbol, "steals", False):
                # A call that takes its arguments as a list: those read last here are let go before it runs.
                read = {p.label for p in bsym.input_proxies()}
                statements = bsym.symbol.stealing_lines(bsym, [label for label in freed[index] if label in read])
                freed[index] = [label for label in freed[index] if label not in read]
            types = ", ".join(p.type_string(types_made) for p in bsym.output_tensors())
            if isinstance(bsym.output, NumberProxy) and isinstance(bsym.output.provenance, FromData):
                types = f"{bsym.output.type_string()}, read from data at run time"
            for i, statement in enumerate(statements):
                suffix = f"  # {types}" if types and i == len(statements) - 1 else ""
                lines.append(f"    {statement}{suffix}")
            if freed.get(index):
                lines.append(f"    del {', '.join(freed[index])}")
        for label in sorted(deferred & {p.label for p in proxies_in(self.output)}):
            lines.append(f"    {label} = made({label})")
        lines.append(f"    return {python_literal(self.output)}")
        return lines

    def _frees(self) -> dict[int, list[str]]:
        """The names to free after each symbol (see ``frees_values``)."""
        kept = {p.label for p in proxies_in(self.output)}
        last: dict[str, int] = {}
        for index, bsym in enumerate(self.bound_symbols):
            for proxy in bsym.input_proxies():
                last[proxy.label] = index
            for proxy in bsym.output_proxies():
                last.setdefault(proxy.label, index)  # a later reader moves it on
        freed: dict[int, list[str]] = {}
        for label, index in last.items():
            if label not in kept:
                freed.setdefault(index, []).append(label)
        return freed

    def header_lines(self) -> list[str]:
        lines = [f"# {line}" for line in ([self.title] if self.title else []) + self.header_notes]
        lines.append("import torch")
        for name, (obj, source) in sorted(self.all_globals().items()):
            if name == "torch":
                continue
            if source is None:
                lines.append(f"# {name}: {obj!r} (given to the program)")
            elif source.startswith(("from ", "import ")):
                lines.append(source)
            else:
                lines.append(f"{name} = {source}")
        return lines

    def python(self) -> str:
        return "\n".join(self.header_lines() + [""] + self.body_lines()) + "\n"

    __str__ = python

    def compile(self):
        """The Python function this trace prints as, compiled from its own source."""
        source = "\n".join(self.body_lines()) + "\n"
        namespace = {"torch": torch, **{name: obj for name, (obj, _) in self.all_globals().items()}}
        return compile_function(source, self.fn_name, namespace)


class TraceError(AssertionError):
    """A trace that breaks an invariant of the IR."""


def verify(trace: Trace) -> None:
    """Check that each name is defined once, before it is used, and that outputs exist."""
    defined: set[str] = set()
    for proxy in trace.inputs:
        if proxy.label in defined:
            raise TraceError(f"input {proxy.label} is defined twice")
        defined.add(proxy.label)
    for index, bsym in enumerate(trace.bound_symbols):
        for proxy in bsym.input_proxies():
            if proxy.label not in defined:
                raise TraceError(f"symbol {index} ({bsym.symbol.name}) uses {proxy.label} before it is defined")
        for proxy in bsym.output_proxies():
            if proxy.label in defined:
                raise TraceError(f"symbol {index} ({bsym.symbol.name}) redefines {proxy.label}")
            defined.add(proxy.label)
    leaves, _ = tree_flatten(trace.output)
    for leaf in leaves:
        if is_proxy(leaf) and leaf.label not in defined:
            raise TraceError(f"output {leaf.label} is never defined")
