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

import contextlib
import logging

import sympy
import torch
from torch._dispatch.python import no_python_dispatcher
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_flatten, tree_map

from ..core import BoundSymbol, FromData, NoProvenance, NumberProxy, TensorProxy, TracingError
from ..core.prims import SHAPE, data_check
from ..core.printing import NamedConstant
from ..core.symbolic import SYMBOLIC_TYPES, symbolic_expr
from ..core.torch_internals import runtime_asserts, set_data_value, symbol_values

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
    computed = real_now(recording, source)
    return None if computed is None else (computed[0].item(), computed[1])


def size_values_now(recording, index: int) -> None:
    """Give the sizes read from data of the outputs of the symbol at ``index`` (a
    ``nonzero``'s count, a mask's) their values now, so that the traced code can branch on
    them (``if idx.numel() > 0:``) as on a number read with ``.item()``; each is then
    read at the program's start (``Recording.size_reads``) for its check. Nothing where
    they cannot be computed now, or only by running a collective (every rank would wait on
    the others' computing it alike): a branch on them is refused."""
    bsym = recording.bound_symbols[index]
    shape_env = recording.fake_mode.shape_env
    fresh = [
        (proxy, dim, symbol)
        for proxy in bsym.output_tensors()
        for dim, symbol in enumerate(_data_sizes(proxy, every_dim=True))
        if symbol is not None and symbol not in recording.size_reads and symbol not in symbol_values(shape_env)
    ]
    if not fresh:
        return
    for proxy in dict.fromkeys(proxy for proxy, _, _ in fresh):
        computed = real_now(recording, proxy, collectives=False)  # not a collective more than eager's
        if computed is None:
            return
        real, cone = computed
        recording.cones[index] = cone
        for owner, dim, symbol in fresh:
            if owner is proxy:
                set_data_value(shape_env, symbol, int(real.shape[dim]))
                recording.size_reads[symbol] = (index, proxy, dim)


def real_now(recording, source: TensorProxy, collectives: bool = True):
    """The real value of ``source`` computed from the call's real inputs (see the module
    docstring), and the indices of the symbols that compute it; None when it cannot be
    (or, without ``collectives``, when a collective is among them). What was computed
    before is not computed again (``Recording.values_now``)."""
    symbols = recording.bound_symbols
    if any(b.op is not None and b.op._schema.is_mutable for b in symbols):
        return None
    cone = _cone(symbols, source)
    if cone is None or (not collectives and any(_is_collective(symbols[i].op) for i in cone)):
        return None
    env = recording.values_now
    for label, real_value in recording.real_of.items():
        env.setdefault(label, real_value)
    shape_env = recording.fake_mode.shape_env
    known = {**symbol_values(shape_env), **recording.sizes_now}

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
        if all(p.label in env for p in bsym.output_proxies()):
            continue  # computed for an earlier read
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
                    recording.sizes_now.setdefault(symbol, sympy.Integer(size))
    return env[source.label], cone


def _is_collective(op) -> bool:
    return op is not None and op.namespace in ("_c10d_functional", "_c10d_functional_autograd", "c10d")


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
    reader.update((s, index) for s, (index, _, _) in recording.size_reads.items())
    first: set[int] = set()
    checks, size_reads = [], {}
    for expr in expressions:
        numbers = sorted(expr.free_symbols, key=str)
        if not all((s in reader and reader[s] in recording.cones) or s in recording.input_sizes for s in numbers):
            raise TracingError(
                f"dtcompile.jit: the traced code branched on {expr}, which mixes numbers read from tensor data "
                "with sizes; such a branch cannot be checked at run time"
            )
        for s in numbers:
            if s in reader:
                first |= set(recording.cones[reader[s]]) | {reader[s]}
        args = tuple(_number_of(recording, symbols, reader, s, size_reads) for s in numbers)
        read = next((reader[s] for s in numbers if s in reader), None)  # the read of data the branch is on
        note = None if read is None else symbols[read].note
        checks.append(BoundSymbol(data_check(expr, tuple(numbers)), args, {}, None, note))
    hoisted = [b for i, b in enumerate(symbols) if i in first]
    recording.bound_symbols[:] = (
        hoisted + list(size_reads.values()) + checks + [b for i, b in enumerate(symbols) if i not in first]
    )


def _number_of(recording, symbols: list, reader: dict, symbol, size_reads: dict) -> NumberProxy:
    """The number a check reads for ``symbol``: the ``.item()`` that read it, or a size of
    the tensor that has it (one read from data, or an input's), read once (``prims.shape``,
    added to ``size_reads``)."""
    if symbol not in recording.size_reads and symbol not in recording.input_sizes:
        return symbols[reader[symbol]].output
    if symbol not in size_reads:
        if symbol in recording.size_reads:
            _, proxy, dim = recording.size_reads[symbol]
            number = NumberProxy(recording.new_name(), symbol, None, FromData(f"a size of {proxy.label}"))
        else:
            proxy, dim = recording.input_sizes[symbol]
            number = NumberProxy(recording.new_name(), symbol, None, NoProvenance(f"a size of {proxy.label}"))
        size_reads[symbol] = BoundSymbol(SHAPE, (proxy, dim), {}, number)
    return size_reads[symbol].output


@contextlib.contextmanager
def assumptions_unlogged():
    """The ShapeEnv warns of every branch answered with a value computed from data
    (``data_branches.py``): dtcompile checks each at run time, so there is nothing to warn of."""
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled
