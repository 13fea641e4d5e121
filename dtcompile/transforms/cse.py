"""Common-subexpression elimination: one symbol per distinct (op, arguments)."""

from __future__ import annotations

from torch.utils._pytree import tree_flatten, tree_structure

from ..core import TensorProxy, Trace, is_proxy, renamed
from ..core.op_classes import is_communication, written_tensors
from ..core.printing import Unprintable, python_literal
from .effects import has_side_effects, mutates, storage_bases


def _key(bsym) -> str | None:
    # The symbol itself, not only its name: a size expression's expression is part of it.
    symbol = bsym.symbol.name if bsym.op is not None else repr(bsym.symbol)
    try:
        return f"{symbol}|{python_literal(tuple(bsym.args))}|{python_literal(tuple(bsym.kwargs.items()))}"
    except Unprintable:
        return None


def cse(trace: Trace) -> Trace:
    """Merge repeated pure computations.

    A mutation ends what is known of the memory it writes: computations that read or made
    it before are not merged with those after (a value read before and after a mutation
    is not the same value). Two computations whose results (or views of them) are both
    returned stay apart: eager returns distinct tensors there, and merging them would hand
    the caller one tensor twice, or two outputs that share memory, so that writing to one
    changes the other; so do a training call's output and a value its backward reads. Nor are two computations whose memory is written in place anywhere
    in the trace (two ``empty_like`` buffers a collective then fills): merged, both writes
    would land in one buffer. Nor are collectives: whether two are alike here depends on
    this rank's local computation (a rank whose uneven shard DTensor pads gathers a padded
    copy, one that needs no padding gathers the shard itself), so a merge made on one rank
    only would leave the ranks running different collectives.
    """
    base = storage_bases(trace, inputs_may_alias=True)
    written_anywhere = {base.get(p.label) for bsym in trace.bound_symbols for p in written_tensors(bsym)}
    leaves, _ = tree_flatten(trace.output)
    returned = {base[x.label] for x in leaves if isinstance(x, TensorProxy)}  # storages the caller gets
    # A training call's joint trace: a forward output and a value its backward reads stay
    # apart too (eager makes two tensors: the caller may write to the output after the call).
    made_in_backward = {p.label for b in trace.bound_symbols if b.in_backward for p in b.output_tensors()}
    backward_reads = {base.get(p.label) for b in trace.bound_symbols if b.in_backward for p in b.input_tensors()}
    forward_returned = {base[x.label] for x in leaves if isinstance(x, TensorProxy) and x.label not in made_in_backward}
    seen: dict[str, object] = {}
    touching: dict[object, list] = {}  # storage -> (key, symbol) of the seen that read or made it
    renames: dict[str, TensorProxy] = {}
    kept = []
    for bsym in trace.bound_symbols:
        bsym = bsym.with_inputs_renamed(renames) if renames else bsym
        if mutates(bsym):
            # What a merge would reuse (a result) or compare (an argument) is stale now.
            for storage in {base.get(p.label) for p in bsym.input_tensors()}:
                for k, b in touching.pop(storage, ()):
                    if seen.get(k) is b:
                        del seen[k]
        key = None if has_side_effects(bsym) or is_communication(bsym.op) else _key(bsym)
        if key is not None and any(base.get(p.label) in written_anywhere for p in bsym.output_tensors()):
            key = None
        earlier = seen.get(key) if key is not None else None
        if earlier is not None and tree_structure(earlier.output) == tree_structure(bsym.output):
            old, _ = tree_flatten(bsym.output)
            new, _ = tree_flatten(earlier.output)
            pairs = [(o, n) for o, n in zip(old, new) if is_proxy(o)]
            # (two ``x[mask]`` of one mask: each its own size read from data, ``u0`` and ``u1``,
            # which the symbols after them were recorded with)
            alike = all(o.type_string() == n.type_string() for o, n in pairs if isinstance(o, TensorProxy))
            if alike and not any(
                (base.get(o.label) in returned and base.get(n.label) in returned)
                or (base.get(o.label) in forward_returned and base.get(n.label) in backward_reads)
                or (base.get(n.label) in forward_returned and base.get(o.label) in backward_reads)
                for o, n in pairs
            ):
                for o, n in pairs:
                    renames[o.label] = n
                    for storages in (returned, forward_returned, backward_reads):
                        if base.get(o.label) in storages:  # (the earlier one's storage now plays its part)
                            storages.add(base.get(n.label))
                continue
        if key is not None and earlier is None:
            seen[key] = bsym
            for storage in {base.get(p.label) for p in (*bsym.input_tensors(), *bsym.output_tensors())}:
                touching.setdefault(storage, []).append((key, bsym))
        kept.append(bsym)

    return trace.derive(
        f"{trace.fn_name}, after common-subexpression elimination", kept, renamed(trace.output, renames)
    )
