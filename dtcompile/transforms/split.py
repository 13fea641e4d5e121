"""Splitting a forward-and-backward trace into a forward and a backward program.

Passes that rename values (identity views, CSE) run on the joint trace first, so the
forward and the backward agree on every name, and a value both would compute is
computed once, by the forward.

The saved set is what the backward reads that the forward made or received: after dead
code is dropped from the backward, every value a backward symbol (or a gradient output)
uses and the backward does not compute itself is saved by the forward. Values the
forward computed only for the backward's sake stay in the forward. Saving a view
(``t(w)``, a reshape) costs no memory: it shares its base's storage.

Nothing is recomputed, except what is computed from the inputs named ``recompute_from``
alone (the sharded parameters of FSDP2 modules that reshard after forward): a value the
backward reads whose every producer back to those inputs is a pure op (a cast, an
all-gather and its wait, views) is computed again in the backward, right before its
first reader, from the input, which the forward saves at no cost. The unsharded
parameter is then not kept alive between forward and backward, as FSDP2's
``reshard_after_forward`` frees it and all-gathers it again in backward; each such
all-gather starts one ahead, after the wait of the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils._pytree import tree_flatten

from ..core import BoundSymbol, FromData, NoProvenance, NumberProxy, TensorProxy, Trace
from ..core.op_classes import is_collective, is_wait
from ..core.prims import size_query
from ..core.symbolic import is_symbolic, size_hint, symbolic_expr
from .dce import dce
from .effects import has_side_effects, storage_bases


@dataclass
class SplitTraces:
    forward: Trace  # returns the call's outputs, then the saved values
    backward: Trace  # takes the saved values, then the cotangents; returns the gradients
    saved: list[TensorProxy | NumberProxy]


def _holders_of_missing_sizes(
    backward: Trace, available: list[TensorProxy], primals: list, read_from_data: dict
) -> tuple[list[TensorProxy | NumberProxy], list[BoundSymbol]]:
    """What the forward saves so that the backward can read every symbolic size it uses:
    its own inputs may not hold them all (an input's size the gradients do not carry).
    A number, read by the forward from an input that holds the size (the symbols that
    read them, for the forward) or from tensor data (``read_from_data``: symbol ->
    number). Not the input itself, as eager's autograd keeps sizes: saving it would keep
    it alive, check its version at the backward (a buffer refilled in between would fail)
    and refuse an inference tensor."""
    needed = set()
    for bsym in backward.bound_symbols:
        for leaf in tree_flatten((bsym.args, bsym.kwargs))[0]:
            if is_symbolic(leaf):
                needed |= symbolic_expr(leaf).free_symbols
    forward_inputs = [p for p in primals if isinstance(p, TensorProxy)]
    holders, reads = [], []
    for symbol in sorted(needed, key=str):
        if size_query(symbol, available) is None:
            found = size_query(symbol, forward_inputs)
            if found is not None:
                number = NumberProxy(f"saved_{symbol}", symbol, None, NoProvenance("the forward, for its backward"))
                reads.append(BoundSymbol(found[0], found[1], {}, number))
                holders.append(number)
            elif symbol in read_from_data:  # a number read from data: saved itself
                holders.append(read_from_data[symbol])
    return holders, reads


def saved_note(forward: Trace, forward_outputs: int) -> str:
    """What a forward saves for the backward (its outputs after the call's own), and the
    memory that keeps alive: a line for the trace's header."""
    leaves, _ = tree_flatten(forward.output)
    saved = [p for p in leaves[forward_outputs:] if isinstance(p, TensorProxy)]
    symbolic = any(is_symbolic(size) for p in saved for size in p.shape)
    return (
        f"saved for the backward: {len(saved)} tensors holding {_held_bytes(forward, saved) / 2**20:.3f} MiB "
        f"{'at the traced sizes ' if symbolic else ''}beyond the inputs: {', '.join(p.label for p in saved) or 'none'}"
    )


def _held_bytes(forward: Trace, saved: list[TensorProxy]) -> int:
    """The memory saving keeps alive between forward and backward: each storage the saved
    values view, counted once, except the forward's inputs' (alive anyway)."""
    bases = storage_bases(forward)
    by_label = {p.label: p for b in forward.bound_symbols for p in b.output_proxies()}
    inputs = {p.label for p in forward.inputs}
    held = {bases[p.label] for p in saved if p.label in bases} - inputs
    # A size read from tensor data has no traced value: such tensors count as empty.
    return sum(
        size_hint(by_label[label].numel(), 0) * by_label[label].element_size() for label in held if label in by_label
    )


def _recomputable(forward_symbols: list, sources: frozenset[str]) -> dict[str, object]:
    """For each forward value computed from the inputs ``sources`` alone by pure ops, the
    symbol that makes it."""
    producers: dict[str, object] = {}
    if not sources:
        return producers
    for bsym in forward_symbols:
        inputs = bsym.input_proxies()
        if inputs and not has_side_effects(bsym) and all(p.label in sources or p.label in producers for p in inputs):
            for p in bsym.output_proxies():
                producers[p.label] = bsym
    return producers


def _with_recomputation(backward_symbols: list, producers: dict[str, object]) -> list:
    """The backward's symbols, with the recomputable values they read computed again right
    before their first reader (each producer once, inputs first). A recomputed collective
    (an FSDP group's all-gather) starts one ahead: right after the wait of the one
    recomputed before it, so that it runs while that group's backward computes, as FSDP2
    prefetches in its backward."""
    recomputed = {id(b) for b in producers.values()}
    order = [b for b in _recomputed(backward_symbols, producers, {}) if is_collective(b.op) and id(b) in recomputed]
    following = {order[i].output.label: order[i + 1] for i in range(len(order) - 1)}
    return _recomputed(backward_symbols, producers, following)


def _recomputed(backward_symbols: list, producers: dict[str, object], following: dict[str, object]) -> list:
    """``_with_recomputation``'s symbols; after the wait of each collective named in
    ``following``, the start of the collective that follows it (with its inputs)."""
    done: set[int] = set()
    result = []

    def emit(label: str) -> None:
        bsym = producers.get(label)
        if bsym is None or id(bsym) in done:
            return
        done.add(id(bsym))
        for p in bsym.input_proxies():
            emit(p.label)
        result.append(bsym)
        if is_wait(bsym.op) and bsym.args[0].label in following:
            emit(following[bsym.args[0].label].output.label)

    for bsym in backward_symbols:
        for p in bsym.input_proxies():
            emit(p.label)
        result.append(bsym)
    return result


def split_forward_backward(
    joint: Trace, cotangents: list[TensorProxy], forward_outputs: int, recompute_from: frozenset[str] = frozenset()
) -> SplitTraces:
    """``joint``'s symbols marked ``in_backward`` are the backward, the others the forward;
    its inputs are the forward's followed by ``cotangents``; its output is the forward's
    ``forward_outputs`` outputs followed by the gradients. Values computed from the inputs
    ``recompute_from`` alone are computed again in the backward (see the module docstring)."""
    outputs, _ = tree_flatten(joint.output)
    user_outputs, grads = tuple(outputs[:forward_outputs]), tuple(outputs[forward_outputs:])
    cotangent_labels = {c.label for c in cotangents}
    primals = [p for p in joint.inputs if p.label not in cotangent_labels]

    forward_symbols = [b for b in joint.bound_symbols if not b.in_backward]
    backward_only = joint.derive(joint.title, [b for b in joint.bound_symbols if b.in_backward], grads)
    backward_only = dce(backward_only)
    producers = _recomputable(forward_symbols, frozenset(recompute_from) & {p.label for p in primals})
    if producers:
        backward_only.bound_symbols = _with_recomputation(backward_only.bound_symbols, producers)
    made_by_backward = {p.label for b in backward_only.bound_symbols for p in b.output_proxies()}
    saved: list[TensorProxy | NumberProxy] = []
    seen: set[str] = set(cotangent_labels) | made_by_backward
    reads = [p for b in backward_only.bound_symbols for p in b.input_proxies()]
    reads += [g for g in grads if isinstance(g, TensorProxy)]
    for proxy in reads:
        if proxy.label not in seen:
            seen.add(proxy.label)
            saved.append(proxy)
    read_from_data = {  # by its symbol (a bool read is ``Eq(u0, 1)``)
        symbol: b.output
        for b in forward_symbols
        if isinstance(b.output, NumberProxy) and isinstance(b.output.provenance, FromData)
        for symbol in b.output.expr.free_symbols
    }
    available = [p for p in saved if isinstance(p, TensorProxy)] + list(cotangents)
    holders, size_reads = _holders_of_missing_sizes(backward_only, available, primals, read_from_data)
    forward_symbols += size_reads
    for proxy in holders:
        if proxy.label not in seen:
            seen.add(proxy.label)
            saved.append(proxy)

    forward = joint.derive("forward, as recorded", forward_symbols, user_outputs + tuple(saved))
    forward.inputs = primals
    forward.fn_name = "forward"
    forward = dce(forward)
    forward.title = "forward, split from the backward"
    backward = Trace(
        fn_name="backward",
        inputs=saved + list(cotangents),
        bound_symbols=backward_only.bound_symbols,
        output=grads,
        title="backward, split from the forward",
        header_notes=list(joint.header_notes),
        input_notes={p.label: "saved by the forward" for p in saved},
        globals=dict(joint.globals),
    )
    return SplitTraces(forward, backward, saved)
