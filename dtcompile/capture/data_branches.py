"""Python branches on numbers read from tensor data: trace the branch taken, check it at run time.

A number read from data (``.item()``) has no value while tracing. When the traced code
branches on it (``if (x > 0).all():``), the value is computed now, from the call's real
inputs: the symbols that lead to it (its cone) are run on them, as the reference
interpreter would. The ShapeEnv then answers the branch with that value and records the
assumption (a deferred runtime assert, as torch.compile's real-tensor propagation does).

The program checks each assumption at run time. The cone, the read and the check go to
the program's start, so that a failed check leaves nothing done: the call goes to another
entry, or is traced again, and never returns a wrong result.

What can be computed now: a cone of ops that read the call's inputs (and numbers read
before), no random op, no in-place op before it writing memory it reads or makes
(``write_before``). Collectives in it run now, on every rank: a branch on a DTensor's
data (``(x > 0).all()``, ``x`` sharded) is taken, and a check failed, by all ranks alike.

A float read from data is checked beyond its branches where sympy cannot tell values apart
(``_float_checks``): NaN and infinities exactly, finite where it was, a zero's sign where it
was specialized. The checks torch's ops defer to run time on such numbers (``narrow``'s ``0
<= length``) raise a RuntimeError as eager's op does (``_runtime_checks``), after the
branches' checks unless torch made them first.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
from dataclasses import dataclass

import sympy
from torch._dispatch.python import no_python_dispatcher
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._sympy.functions import CleanDiv, FloatTrueDiv, FloorDiv, IntTrueDiv, Mod
from torch.utils._sympy.symbol import SymT, symbol_is_type

from ..core import BoundSymbol, FromData, NoProvenance, NumberProxy, TensorProxy, TracingError
from ..core.prims import _CHECK_GLOBALS, SHAPE, DataCheck, data_check
from ..core.printing import NamedConstant
from ..core.symbolic import (
    SYMBOLIC_TYPES,
    PythonFloatFloorDiv,
    PythonFloatMod,
    PythonPow,
    PythonTrueDiv,
    Then,
    exact_float_checks,
    python_source,
    symbolic_expr,
)
from ..core.torch_internals import runtime_asserts, set_data_value, symbol_values
from .data_cones import barring_write, cone_of, data_sizes, input_memories, read_symbols, write_before
from .live_collectives import ranks_meet
from .size_text import folded, negative_zeros

_ASSUMPTION = "propagate_real_tensors"  # how the ShapeEnv labels an assumption on a hint
_SOURCE_LINE = re.compile(r"\.(py|cpp|h):\d+$")


def branch_refused(recording, cond) -> str:
    """Why a Python branch on ``cond`` cannot be checked at run time, for its refusal."""
    what = f"Python control flow on {cond}, a number read from tensor data"
    written = barring_write(recording, cond.free_symbols) or next(
        (b for b in recording.bound_symbols if b.op is not None and b.op._schema.is_mutable), None
    )
    if written is None:  # (a size read from data is computed now without collectives: its check runs first)
        unknown = set(cond.free_symbols) - symbol_values(recording.fake_mode.shape_env).keys()
        why = "a size (nonzero, a mask's) a collective's result decides (a DTensor's full_tensor()), a random op's"
        return f"{what} that tracing cannot compute now: {why}" if unknown else what
    return (
        f"{what}, after an in-place write ({written.note or written.op}): a branch on data is checked at the "
        "program's start, before anything runs, and is not moved past a write of memory it reads (nor past a "
        "random op). Write after the branch, or branch before the write"
    )


def value_now(recording, source: TensorProxy, read: set):
    """``source.item()`` from the call's real inputs, and the indices of the symbols computing
    it; noted as the value of the number read (``read``, its symbols), as read: a later
    cone's write (moved with it: ``data_cones.cone_of``) may change ``source`` computed now."""
    computed = real_now(recording, source)
    if computed is None:
        return None
    value = computed[0].item()
    if len(read) == 1:
        (symbol,) = read
        recording.numbers_now[symbol] = value
        if isinstance(value, float) and value == 0.0 and math.copysign(1.0, value) < 0:
            if symbol_is_type(symbol, SymT.UNBACKED_FLOAT):
                negative_zeros(recording.fake_mode.shape_env).add(symbol)
    return value, computed[1]


def size_values_now(recording, index: int) -> None:
    """Give the sizes read from data of the outputs of the symbol at ``index`` (``nonzero``'s)
    their values now, for branches on them (``if idx.numel() > 0:``), each read at the program's
    start for its check (``Recording.size_reads``); not where only a collective computes them."""
    bsym = recording.bound_symbols[index]
    shape_env = recording.fake_mode.shape_env
    for proxy in bsym.output_tensors() if bsym.note is None else ():  # (the forward's: ``_runtime_checks``)
        for dim, symbol in enumerate(data_sizes(proxy, every_dim=True)):
            if symbol is not None:
                recording.deferred_checks.sizes_made.setdefault(symbol, (proxy, dim))
    fresh = [
        (proxy, dim, symbol)
        for proxy in bsym.output_tensors()
        for dim, symbol in enumerate(data_sizes(proxy, every_dim=True))
        if symbol is not None and symbol not in recording.size_reads and symbol not in symbol_values(shape_env)
    ]
    if not fresh:
        return
    recording.read_by.update((symbol, recording.current_call or str(bsym.op)) for _, _, symbol in fresh)
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
    """The real value of ``source`` computed from the call's real inputs, and the indices of
    the symbols that compute it (see the module docstring); None when it cannot be (or, without
    ``collectives``, when a collective is among them). Nothing is computed twice (``values_now``)."""
    symbols = recording.bound_symbols
    cone = cone_of(symbols, source, input_memories(recording))
    if cone is None or (not collectives and any(map(_is_collective, (symbols[i].op for i in cone)))):
        return None
    if write_before(recording, cone, source) is not None:  # (then not moved to the start)
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
        if _is_collective(bsym.op):
            ranks_meet(bsym)
        with no_python_dispatcher():  # (as eager runs them: under it a functional all_gather never completes)
            out = bsym.op(*args, **kwargs)
        for proxy, value in zip(tree_flatten(bsym.output)[0], tree_flatten(out)[0]):
            if isinstance(proxy, (TensorProxy, NumberProxy)):
                env[proxy.label] = value
            for symbol, size in zip(data_sizes(proxy, every_dim=True), getattr(value, "shape", ())):
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
    after the symbols that compute its numbers (see the module docstring); then, where
    its numbers are read, each check torch's ops deferred to run time (``torch._check``
    of a ``narrow``'s length read from data), which raises a RuntimeError as eager's op."""
    shape_env = recording.fake_mode.shape_env
    symbols = recording.bound_symbols
    reader = {s: i for i, b in enumerate(symbols) if isinstance(b.output, NumberProxy) for s in read_symbols(b.output)}
    items = {s: symbols[i].output for s, i in reader.items()}  # before the sizes read from data join
    reader.update((s, index) for s, (index, _, _) in recording.size_reads.items())
    expressions = [e for expr in assumptions(shape_env) for e in _divisors_first(expr)]
    expressions += _float_checks(recording, reader, expressions)
    # Each check right after what computes its numbers: a size read from data's comes before
    # the code that assumes it (an ``unbind`` into as many numbers as traced).
    first: set[int] = set()
    start, size_reads = [], {}
    for expr in expressions:
        numbers = sorted(expr.free_symbols, key=str)
        if not all((s in reader and reader[s] in recording.cones) or s in recording.input_sizes for s in numbers):
            raise TracingError(
                f"dtcompile.jit: the traced code branched on {expr}, which mixes numbers read from tensor data "
                "with sizes; such a branch cannot be checked at run time"
            )
        needed = set()
        for s in numbers:
            if s in reader:
                needed |= set(recording.cones[reader[s]]) | {reader[s]}
        start += [symbols[i] for i in sorted(needed - first)]
        first |= needed
        reads_before = len(size_reads)
        args = tuple(_number_of(recording, symbols, reader, s, size_reads) for s in numbers)
        start += list(size_reads.values())[reads_before:]
        read = next((reader[s] for s in numbers if s in reader), None)  # the read of data the branch is on
        note = None if read is None else symbols[read].note
        start.append(BoundSymbol(data_check(expr, tuple(numbers)), args, {}, None, note))
    recording.bound_symbols[:] = start + [b for i, b in enumerate(symbols) if i not in first]
    _runtime_checks(recording, items)


def _divisors_first(expr) -> list:
    """``expr``, asked only where each divisor in it that depends on numbers is not zero:
    the program's check must fail (the call is traced again, and eager's error raised),
    not divide by zero (``x.split(k)`` checks ``n // k``)."""
    divisors = [a.args[1] for a in expr.atoms(FloorDiv, Mod, CleanDiv, IntTrueDiv, FloatTrueDiv, sympy.Mod)]
    divisors += [a.args[1] for a in expr.atoms(PythonTrueDiv, PythonFloatMod, PythonFloatFloorDiv)]
    divisors += [a.base for a in expr.atoms(sympy.Pow) if a.exp.is_negative]
    divisors += [a.args[0] for a in expr.atoms(PythonPow) if a.args[1].is_negative]
    nonzero = [c for c in (sympy.Ne(d, 0) for d in dict.fromkeys(divisors) if d.free_symbols) if c is not sympy.true]
    return [Then(sympy.And(*nonzero), expr) if nonzero else expr]


def _float_checks(recording, reader: dict, expressions: list) -> list:
    """What the program checks of each float read from data beyond ``expressions``
    (``symbolic.exact_float_checks``): that it is NaN or infinite if it was while tracing,
    for its branches and specializations were computed with it; that it is finite where
    sympy simplified it away (``size_text.folded``) or it is in a check; with its sign where
    it was a zero in a check (``k == 0.0`` holds for -0.0)."""
    assumed = set().union(*(e.free_symbols for e in expressions))
    lost = folded(recording.fake_mode.shape_env)
    found = []
    for symbol, index in reader.items():
        if not symbol_is_type(symbol, SymT.UNBACKED_FLOAT) or index not in recording.cones:
            continue
        value = recording.numbers_now.get(symbol)
        if not isinstance(value, float) or (math.isfinite(value) and symbol not in lost | assumed):
            continue
        found += exact_float_checks(symbol, value, sign=value == 0.0 and symbol in assumed)
    return found


@dataclass(frozen=True)
class RuntimeCheck(DataCheck):
    """``if not (0 <= t0): raise RuntimeError(...)``: a check torch's op deferred to run
    time on numbers read from data; eager's op would have raised there."""

    message: str = ""

    def lines(self, bsym: BoundSymbol) -> list[str]:
        names = {symbol: arg.label for symbol, arg in zip(self.symbols, bsym.args)}
        condition = python_source(self.expr, names)
        # (torch's message is often only where its op checked: ``TensorShape.cpp:1676``)
        where = "" if _SOURCE_LINE.search(self.message) else f" ({self.message})"
        text = f"dtcompile: a number read from tensor data fails a check of torch's op: {condition}{where}"
        return [f"if not ({condition}): raise RuntimeError({text!r})"]


def _before_branches(shape_env) -> list:
    """The checks torch deferred before the traced code took any branch on data, as far as
    the ShapeEnv's order tells (it keeps one list per symbol): eager's op raised there
    whatever the branches, so their checks go before the branches' (``x.split(k)`` checks
    ``0 <= k`` before the number of pieces it makes)."""
    lists = [[(a.expr, a.msg) for a in asserts] for asserts in shape_env.deferred_runtime_asserts.values()]
    with_branches = [found for found in lists if any(m.startswith(_ASSUMPTION) for _, m in found)]
    if len(with_branches) > 1:
        return []
    if not with_branches:
        return [expr for found in lists for expr, _ in found]
    found = with_branches[0]
    return [expr for expr, _ in itertools.takewhile(lambda a: not a[1].startswith(_ASSUMPTION), found)]


def _printable(expr) -> bool:
    try:
        python_source(expr, {s: s.name for s in expr.free_symbols})
    except Exception:  # a function Python's printer has no source for: the check is left to eager's op
        return False
    return True


def _runtime_checks(recording, items: dict) -> None:
    """Insert the checks torch's ops deferred to run time on numbers read from data
    (``.item()``, a selection's row count: ``x[m].narrow(0, 0, 2)`` checks ``2 <= u0``,
    ``x[m].reshape(2, 2)`` takes ``u0 == 2``) and the inputs' sizes, each right after the op
    that deferred it (``deferred_checks.py``) and the last read of its numbers. A size read
    from data is read (``prims.shape``) after the symbol that makes its first tensor."""
    symbols = recording.bound_symbols
    position = {id(b.output): i for i, b in enumerate(symbols) if isinstance(b.output, NumberProxy)}
    # After the branches' checks: a call that fails one goes to another entry, whose
    # branch may not run the op.
    branches = max((i for i, b in enumerate(symbols) if isinstance(b.symbol, DataCheck)), default=-1)
    after: dict[int, list] = {}
    seen, early = [], _before_branches(recording.fake_mode.shape_env)
    sizes = None  # a size read from data -> (index of the symbol making its first tensor, the tensor, dim)
    # The op that deferred each check (deferred_checks.py), found by its first output's fake.
    op_at = {id(p.fake): i for i, b in enumerate(symbols) for p in b.output_tensors()[:1]}
    for expr, message in runtime_asserts(recording.fake_mode.shape_env):
        numbers = sorted(expr.free_symbols, key=str)
        if message.startswith(_ASSUMPTION) or expr in seen or not _printable(expr):
            continue
        if not any(symbol_is_type(s, SymT.UNBACKED_INT) or s in items for s in numbers):
            continue  # (the inputs' sizes alone: guarded)
        sizes = _sizes_read_from_data(recording) if sizes is None else sizes
        if not all(s in items or s in sizes or s in recording.input_sizes for s in numbers):
            continue
        if recording.deferred_checks.assumed(expr, not any(s in items for s in numbers)):
            continue  # (torch's own assumption: ``deferred_checks.py``)
        _, made_by, _ = recording.deferred_checks.made_by.get(expr, (None, None, None))
        seen.append(expr)
        made, args, last = [], [], -1 if expr in early else branches
        for s in numbers:
            if s in items:
                args.append(items[s])
                last = max(last, position[id(items[s])])
                continue
            if s in sizes:
                index, proxy, dim = sizes[s]
                last = max(last, index)
                provenance = FromData(f"a size of {proxy.label}")
            else:
                proxy, dim = recording.input_sizes[s]
                provenance = NoProvenance(f"a size of {proxy.label}")
            args.append(NumberProxy(recording.new_name(), s, None, provenance))
            made.append(BoundSymbol(SHAPE, (proxy, dim), {}, args[-1]))
        last = max(last, op_at.get(id(made_by), -1))
        check = RuntimeCheck(
            "prims.runtime_check", globals=_CHECK_GLOBALS, expr=expr, symbols=tuple(numbers), message=str(message)
        )
        after.setdefault(last, []).extend([*made, BoundSymbol(check, tuple(args), {}, None, symbols[last].note)])
    if after:
        symbols[:] = [b for i, bsym in enumerate(symbols) for b in (bsym, *after.get(i, ()))]


def _sizes_read_from_data(recording) -> dict:
    """Each size read from data (a ``nonzero``'s count) the recording's tensors have: the
    index of the symbol that makes the first tensor with it, that tensor and the dim (noted
    when it was made: a check may since have replaced it by a number, ``x[m].reshape(2, 2)``)."""
    made_at = {}
    for index, bsym in enumerate(recording.bound_symbols):
        for proxy in bsym.output_proxies():
            made_at.setdefault(proxy.label, index)
    return {
        symbol: (made_at[proxy.label], proxy, dim)
        for symbol, (proxy, dim) in recording.deferred_checks.sizes_made.items()
        if proxy.label in made_at
    }


def _number_of(recording, symbols: list, reader: dict, symbol, size_reads: dict) -> NumberProxy:
    """The number a check reads for ``symbol``: the ``.item()`` that read it, or a size of the
    tensor that has it (read from data, or an input's), read once (``prims.shape``, ``size_reads``)."""
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
