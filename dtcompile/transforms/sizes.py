"""Materializing symbolic sizes: every size a trace uses is computed by the trace itself.

Under symbolic values the traced call passed SymInts where eager passes ints: view and
reshape sizes, ``arange`` ends, split sizes, the global sizes of DTensor outputs. This
pass gives each such value a producer inside the trace, right before the symbol that
needs it: ``prims.shape`` of a tensor that holds the size (the trace's inputs first,
then the symbol's own arguments, then any tensor made so far), or an expression over
such sizes (``n2 = n0 * n1``). It adds a producer at every use; dead-code elimination
then keeps the first producer of each value and drops the others (see ``dce.py``).
A size no tensor of the trace holds cannot be computed, and is an error.
"""

from __future__ import annotations

import itertools

from ..core import BoundSymbol, NoProvenance, TensorProxy, Trace, TracingError
from ..core.prims import size_expression, size_query
from ..core.proxy import NumberProxy
from ..core.symbol import leaves, map_leaves
from ..core.symbolic import SYMBOLIC_TYPES, as_constant, float_expr, is_symbolic


class UnmaterializableSizeError(TracingError):
    """A symbolic size no tensor of the trace holds (a size read from data that a
    backward needs, ``x[x > 0].sum()``: the forward's masked tensor is not passed to it)."""


class _Materializer:
    def __init__(self, trace: Trace):
        self.inputs = [p for p in trace.inputs if isinstance(p, TensorProxy)]
        self.made: list[TensorProxy] = []
        taken = {p.label for p in trace.inputs} | {p.label for b in trace.bound_symbols for p in b.output_proxies()}
        self._labels = (f"n{i}" for i in itertools.count() if f"n{i}" not in taken)
        self.emitted: list[BoundSymbol] = []
        # Numbers the trace has already: read from tensor data (``.item()``), or given to
        # it (a backward's saved numbers). Their symbols are held by no tensor's size.
        self.numbers: dict[object, NumberProxy] = {}
        for proxy in trace.inputs:
            self.know(proxy)

    def know(self, value) -> None:
        if isinstance(value, NumberProxy):
            self.numbers.setdefault(value.expr, value)

    def _number(self, expr, made_by: str) -> NumberProxy:
        return NumberProxy(next(self._labels), expr, None, NoProvenance(made_by))

    def _held_by(self, expr, preferred: list[TensorProxy]) -> tuple[object, tuple] | None:
        return size_query(expr, list(itertools.chain(self.inputs, preferred, self.made)))

    def number(self, expr, preferred: list[TensorProxy]) -> NumberProxy:
        """A number of the trace equal to ``expr``, its producers emitted."""
        if expr in self.numbers:
            return self.numbers[expr]
        held = self._held_by(expr, preferred)
        if held is not None:
            query, args = held
            number = self._number(expr, query.name)
            self.emitted.append(BoundSymbol(query, args, {}, number))
            return number
        symbols = tuple(sorted(expr.free_symbols, key=str))
        if not symbols or expr in symbols:
            raise UnmaterializableSizeError(
                f"dtcompile.jit: the size {expr} is not held by any tensor of the trace, so the compiled "
                "program cannot compute it (a size read from data that the backward needs: x[mask].sum() "
                "with gradients, where (x * mask).sum() computes the same without it; x[:k] of a number k "
                "read from data, where x.narrow(0, 0, k) holds it)"
            )
        args = tuple(self.number(symbol, preferred) for symbol in symbols)
        number = self._number(expr, "prims.size")
        self.emitted.append(BoundSymbol(size_expression(expr, symbols), args, {}, number))
        return number

    def replace(self, value, preferred: list[TensorProxy]) -> tuple[object, bool]:
        """``value`` with each symbolic size replaced by a number of the trace, and
        whether anything was replaced."""
        if not any(isinstance(x, SYMBOLIC_TYPES) for x in leaves(value)):
            return value, False  # (most symbols: a walk, not a rebuild)
        changed = False

        def swap(x):
            nonlocal changed
            if not isinstance(x, SYMBOLIC_TYPES):
                return x
            changed = True
            x = as_constant(x)
            return self.number(float_expr(x), preferred) if is_symbolic(x) else x  # a float stays a float

        return map_leaves(swap, value), changed


def has_symbolic_sizes(trace: Trace) -> bool:
    found = [x for b in trace.bound_symbols for x in leaves((b.args, b.kwargs))]
    return any(map(is_symbolic, found)) or any(map(is_symbolic, leaves(trace.output)))


def materialize_sizes(trace: Trace) -> Trace:
    """Replace every symbolic size in the symbols' arguments and in the trace's output by
    a number the trace computes (see the module docstring)."""
    materializer = _Materializer(trace)
    kept: list[BoundSymbol] = []
    for bsym in trace.bound_symbols:
        (args, kwargs), changed = materializer.replace((bsym.args, bsym.kwargs), bsym.input_tensors())
        if changed:
            for producer in materializer.emitted:  # part of the symbol they serve
                producer.in_backward, producer.note = bsym.in_backward, bsym.note
            kept.extend(materializer.emitted)
            materializer.emitted.clear()
            bsym = bsym.but(args=tuple(args), kwargs=dict(kwargs))
        kept.append(bsym)
        materializer.made.extend(bsym.output_tensors())
        materializer.know(bsym.output)
    output, _ = materializer.replace(trace.output, [])
    kept.extend(materializer.emitted)
    return trace.derive(f"{trace.fn_name}, with its sizes computed in the trace", kept, output)
