"""The ops that compute a number read from tensor data (its cone), and whether they may run
at the program's start: what ``data_branches.py`` computes now and checks at run time."""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_flatten

from ..core import BoundSymbol, FromData, NumberProxy, TensorProxy
from ..core.symbolic import SYMBOLIC_TYPES


def read_symbols(number: NumberProxy) -> set:
    """The unbacked symbols a number read from data stands for (``u0`` of a bool's ``Eq(u0, 1)``)."""
    return set(number.expr.free_symbols) if isinstance(number.provenance, FromData) else set()


def data_sizes(proxy, every_dim: bool = False) -> list:
    """The sizes of a tensor that are symbols read from data (a ``nonzero``'s count);
    with ``every_dim``, one entry per dimension, None where the size is not one."""
    if not isinstance(proxy, TensorProxy):
        return []
    found = []
    for size in proxy.fake.shape:
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        found.append(expr if expr is not None and expr.is_Symbol and free_unbacked_symbols(size) else None)
    return found if every_dim else [s for s in found if s is not None]


def cone_of(symbols: list[BoundSymbol], source: TensorProxy, inputs: frozenset = frozenset()) -> list[int] | None:
    """The indices of the symbols ``source`` depends on (its producers, theirs, and the
    readers of numbers they use), or None when one of them cannot run now. With ``inputs``
    (the memories of the call's inputs), also each in-place write before it to memory the
    cone itself makes (a composite's own: ``isclose`` writes its fresh result with
    ``bitwise_or_``, ``quantile`` its index with ``ceil_``) and what that write reads,
    unless a symbol outside the cone reads that memory before the write (moved to the
    program's start with the cone, the write would come before it)."""
    cone = first = _cone(symbols, {source.label})
    writes: set[int] = set()
    while cone is not None and inputs:
        made = {p.memory for i in cone for p in symbols[i].output_tensors()} - inputs
        more = {
            i
            for i, b in enumerate(symbols)
            if i not in writes and b.op is not None and b.op._schema.is_mutable and _writes_only(b, made)
        }
        # Only those a symbol of the cone after them reads (one after the number's last op
        # changes nothing it computes, and moved, a collective would run before the check).
        more = {i for i in more if _read_after(symbols, cone, i, {p.memory for p in _written(symbols[i])})}
        if not more:
            break
        writes |= more
        needed = {p.label for i in writes for p in symbols[i].input_proxies()}
        grown = _cone(symbols, needed, allowed=writes)
        if grown is None or any(symbols[i].op.namespace in _COLLECTIVES for i in set(grown) - set(first)):
            return first  # (``write_before`` then bars it)
        cone = sorted(set(cone) | set(grown) | writes)
    if cone is None or not writes:
        return cone
    in_cone = set(cone)
    for index in writes:
        written = {p.memory for p in _written(symbols[index])}
        for i in range(index):
            if i not in in_cone and any(p.memory in written for p in symbols[i].input_tensors()):
                return first  # (``write_before`` then bars it)
    return cone


# A collective a write brings into the cone (``dist.all_reduce(y)`` of a clone, copied into it)
# would run at the program's start, before a check that ranks may fail apart (the branch
# reading local data too): the write then bars the branch, as any write did.
_COLLECTIVES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _read_after(symbols: list[BoundSymbol], cone: list[int], index: int, memories: set) -> bool:
    return any(i > index and any(p.memory in memories for p in symbols[i].input_tensors()) for i in cone)


def _writes_only(bsym: BoundSymbol, memories: set) -> bool:
    written = [p.memory for p in _written(bsym)]
    return bool(written) and all(m in memories for m in written)


def _cone(symbols: list[BoundSymbol], needed: set, allowed: set = frozenset()) -> list[int] | None:
    """The indices of the symbols the labels ``needed`` depend on (see ``cone_of``); None
    where one is random or writes in place (but those ``allowed``)."""
    number_of = {
        s: b.output.label for b in symbols if isinstance(b.output, NumberProxy) for s in read_symbols(b.output)
    }
    for bsym in symbols:  # sizes read from data (``nonzero``'s): the first tensor that has each
        for proxy in bsym.output_proxies():
            for symbol in data_sizes(proxy):
                number_of.setdefault(symbol, proxy.label)
    needed, cone = set(needed), []
    for index in range(len(symbols) - 1, -1, -1):
        bsym = symbols[index]
        if not any(p.label in needed for p in bsym.output_proxies()) and index not in allowed:
            continue
        op = bsym.op
        if (
            op is None
            or (op._schema.is_mutable and index not in allowed)
            or torch.Tag.nondeterministic_seeded in op.tags
        ):
            return None
        cone.append(index)
        needed |= {p.label for p in bsym.input_proxies()}
        for leaf in tree_flatten((bsym.args, bsym.kwargs))[0]:
            if isinstance(leaf, SYMBOLIC_TYPES):
                needed |= {number_of[s] for s in free_unbacked_symbols(leaf) if s in number_of}
    cone.reverse()
    return cone


def input_memories(recording) -> frozenset:
    return frozenset(p.memory for p in recording.input_proxies)


def write_before(recording, cone: list[int], source: TensorProxy) -> BoundSymbol | None:
    """An in-place op (or ``out=``) so far, outside the cone, writing memory that a symbol of
    the cone after it reads or makes, or that ``source`` is (views too; where they touch an
    input, any input's: they may share memory the trace did not see). A write after the
    cone's last use of that memory leaves its values as they were: the cone may move to the
    program's start before it (``y = x.clone()`` branched on, ``x.mul_(2)`` before the branch)."""
    symbols, inputs = recording.bound_symbols, {p.memory for p in recording.input_proxies}
    touched = [(len(symbols), {source.memory})]
    for i in cone:
        tensors = (*symbols[i].input_tensors(), *symbols[i].output_proxies())
        touched.append((i, {p.memory for p in tensors if isinstance(p, TensorProxy)}))
    in_cone = set(cone)  # (its own writes to memory it makes: ``cone_of``)
    for index, bsym in enumerate(symbols):
        if bsym.op is None or not bsym.op._schema.is_mutable or index in in_cone:
            continue
        memories = set().union(*(m for i, m in touched if i > index))
        memories |= inputs if memories & inputs else set()
        if any(p.memory in memories for p in _written(bsym)):
            return bsym
    return None


def _written(bsym: BoundSymbol) -> list:
    """The tensors an in-place op writes: its arguments the schema marks written."""
    arguments = [(i, a.name) for i, a in enumerate(bsym.op._schema.arguments) if a.alias_info and a.alias_info.is_write]
    values = [bsym.args[i] if i < len(bsym.args) else bsym.kwargs.get(name) for i, name in arguments]
    return [t for t in tree_flatten(values)[0] if isinstance(t, TensorProxy)] or bsym.input_tensors()


def barring_write(recording, symbols: set) -> BoundSymbol | None:
    """The write that bars computing now the number read from data standing for one of
    ``symbols`` (``write_before`` of its read's cone), for the refusal to name; None if none."""
    for bsym in recording.bound_symbols:
        if isinstance(bsym.output, NumberProxy) and read_symbols(bsym.output) & symbols and bsym.input_tensors():
            source = bsym.input_tensors()[0]
            cone = cone_of(recording.bound_symbols, source, input_memories(recording))
            return None if cone is None else write_before(recording, cone, source)
    return None
