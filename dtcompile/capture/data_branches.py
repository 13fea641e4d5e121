"""Python branches on numbers read from tensor data: trace the branch taken, check it at
run time.

A number read from data (``.item()``) has no value while tracing. When the traced code
branches on it (``if (x > 0).all():``), the value is computed now, from the call's real
inputs: the symbols that lead to it (its cone) are run on them, as the reference
interpreter would. The ShapeEnv then answers the branch with that value and records the
assumption (a deferred runtime assert, as under torch.compile's real-tensor propagation).

The program checks each assumption at run time. The cone, the read and the check go to
the program's start, so that a failed check leaves nothing done: the call then goes to
another entry of the cache, or is traced again, and never returns a wrong result.

What can be computed now: a cone of ops that read the call's inputs (and numbers read
before), with no in-place op anywhere before it (moving it to the start must not change
what it reads) and no random op. Collectives in the cone run now too, on every rank: a
branch on a DTensor's data (``(x > 0).all()`` of a sharded ``x``) is taken alike by all
ranks, so they trace, and fail a check, together.
"""

from __future__ import annotations

import sympy
import torch
from torch._dispatch.python import no_python_dispatcher
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_flatten, tree_map

from ..core import BoundSymbol, FromData, NumberProxy, TensorProxy, TracingError
from ..core.prims import data_check
from ..core.printing import NamedConstant
from ..core.symbolic import SYMBOLIC_TYPES, symbolic_expr
from ..core.torch_internals import runtime_asserts, symbol_values

_ASSUMPTION = "propagate_real_tensors"  # how the ShapeEnv labels an assumption on a hint


def _symbols(number: NumberProxy) -> set:
    """The unbacked symbols a number read from data stands for (``u0`` of a bool's ``Eq(u0, 1)``)."""
    return set(number.expr.free_symbols) if isinstance(number.provenance, FromData) else set()


def _data_sizes(proxy, every_dim: bool = False) -> list:
    """The sizes of a tensor that are symbols read from data (a ``nonzero``'s count);
    with ``every_dim``, one entry per dimension, None where the size is not one."""
    if not isinstance(proxy, TensorProxy):
        return []
    found = []
    for size in proxy.fake.shape:
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        found.append(expr if expr is not None and expr.is_Symbol and free_unbacked_symbols(size) else None)
    return found if every_dim else [s for s in found if s is not None]


def _cone(symbols: list[BoundSymbol], source: TensorProxy) -> list[int] | None:
    """The indices of the symbols ``source`` depends on (its producers, theirs, and the
    readers of numbers they use), or None when one of them cannot run now."""
    number_of = {s: b.output.label for b in symbols if isinstance(b.output, NumberProxy) for s in _symbols(b.output)}
    for bsym in symbols:  # sizes read from data (``nonzero``'s): the first tensor that has each
        for proxy in bsym.output_proxies():
            for symbol in _data_sizes(proxy):
                number_of.setdefault(symbol, proxy.label)
    needed, cone = {source.label}, []
    for index in range(len(symbols) - 1, -1, -1):
        bsym = symbols[index]
        if not any(p.label in needed for p in bsym.output_proxies()):
            continue
        op = bsym.op
        if op is None or op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags:
            return None
        cone.append(index)
        needed |= {p.label for p in bsym.input_proxies()}
        for leaf in tree_flatten((bsym.args, bsym.kwargs))[0]:
            if isinstance(leaf, SYMBOLIC_TYPES):
                needed |= {number_of[s] for s in free_unbacked_symbols(leaf) if s in number_of}
    cone.reverse()
    return cone


def value_now(recording, source: TensorProxy):
    """``source.item()`` computed from the call's real inputs (see the module docstring),
    and the indices of the symbols that compute it; None when it cannot be."""
    symbols = recording.bound_symbols
    if any(b.op is not None and b.op._schema.is_mutable for b in symbols):
        return None
    cone = _cone(symbols, source)
    if cone is None:
        return None
    env: dict[str, object] = dict(recording.real_of)
    shape_env = recording.fake_mode.shape_env
    known = symbol_values(shape_env)

    def real(x):
        if isinstance(x, (TensorProxy, NumberProxy)):
            return env[x.label]
        if isinstance(x, NamedConstant):
            return x.value
        if isinstance(x, SYMBOLIC_TYPES):
            value = symbolic_expr(x).xreplace(known)
            return bool(value) if value.is_Boolean else int(value) if value.is_integer else float(value)
        return x

    made = {p.label for index in cone for p in symbols[index].output_proxies()}
    reads = {p.label for index in cone for p in symbols[index].input_proxies()} - made
    if not reads <= env.keys() or (source.label not in made and source.label not in env):
        return None
    for index in cone:
        bsym = symbols[index]
        args, kwargs = tree_map(real, (bsym.args, bsym.kwargs))
        # As eager runs them: under the Python dispatcher (on while tracing) a functional
        # all_gather never completes.
        with no_python_dispatcher():
            out = bsym.op(*args, **kwargs)
        for proxy, value in zip(tree_flatten(bsym.output)[0], tree_flatten(out)[0]):
            if isinstance(proxy, (TensorProxy, NumberProxy)):
                env[proxy.label] = value
            for symbol, size in zip(_data_sizes(proxy, every_dim=True), getattr(value, "shape", ())):
                if symbol is not None:
                    known.setdefault(symbol, sympy.Integer(size))
    return env[source.label].item(), cone


def assumptions(shape_env) -> list:
    """The assumptions the traced code made on numbers read from data, in order."""
    found = []
    for expr, message in runtime_asserts(shape_env):
        if message.startswith(_ASSUMPTION) and expr not in found:
            found.append(expr)
    return found


def checks_first(recording) -> None:
    """Put at the start of the recording a check of each assumption the traced code made,
    after the symbols that compute its numbers (see the module docstring)."""
    shape_env = recording.fake_mode.shape_env
    expressions = assumptions(shape_env)
    if not expressions:
        return
    symbols = recording.bound_symbols
    reader = {s: i for i, b in enumerate(symbols) if isinstance(b.output, NumberProxy) for s in _symbols(b.output)}
    first: set[int] = set()
    checks = []
    for expr in expressions:
        numbers = sorted(expr.free_symbols, key=str)
        if not all(s in reader and reader[s] in recording.cones for s in numbers):
            raise TracingError(
                f"dtcompile.jit: the traced code branched on {expr}, which mixes numbers read from tensor data "
                "with sizes; such a branch cannot be checked at run time"
            )
        for s in numbers:
            first |= set(recording.cones[reader[s]]) | {reader[s]}
        args = tuple(symbols[reader[s]].output for s in numbers)
        checks.append(BoundSymbol(data_check(expr, tuple(numbers)), args, {}, None, symbols[reader[numbers[0]]].note))
    hoisted = [b for i, b in enumerate(symbols) if i in first]
    recording.bound_symbols[:] = hoisted + checks + [b for i, b in enumerate(symbols) if i not in first]
