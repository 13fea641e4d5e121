"""Recording a block's symbols again, with another block's tensors (``blocks.py``).

Each symbol is recorded again with its proxies swapped through a mapping from the first
block's labels to the later block's proxies, which learns each new output. Most ops are
not run again: where every output of an op is a tensor viewing one of its inputs' storage
or a fresh one (``output_aliases``), its outputs are fake tensors with the first block's
metadata (``torch_internals.fake_like``), viewing the new inputs' storages where the first
viewed the old ones' (the passes read aliasing from the fake storages). In-place ops
(which may change their inputs' metadata), factory ops (whose values tracing may know)
and ops with other outputs go through the recorder as the first block's did, and must
give the same metadata.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..core import NoProvenance, TensorProxy
from ..core.op_classes import written_tensors
from ..core.symbol import leaves, map_leaves
from ..core.torch_internals import dispatch_modes_off, fake_like
from .equivalence import tensor_key

_DETACH = torch.ops.aten.detach.default


def record_again(recording, symbols: list, aliases: list, mapping: dict[str, TensorProxy]) -> None:
    """Record ``symbols`` again through ``recording``, each proxy swapped
    through ``mapping`` (label -> proxy), which learns each new output. An op whose
    outputs' storage is known (``aliases``, from ``output_aliases``) is not run again: its
    outputs are fake tensors like the first's; any other op is recorded as the first was."""

    def mapped(x):
        return mapping[x.label] if isinstance(x, TensorProxy) else x

    for bsym, alias in zip(symbols, aliases, strict=True):
        args, kwargs = map_leaves(mapped, (bsym.args, bsym.kwargs))
        if alias is not None:
            out = _outputs_like(recording, bsym, alias, args, kwargs)
            recording.bound_symbols.append(bsym.but(args=args, kwargs=kwargs, output=out))
        else:
            before = len(recording.bound_symbols)
            with dispatch_modes_off():  # as the recorder runs it: its own calls are not recorded
                out = recording.record(bsym.op, args, kwargs)
            if len(recording.bound_symbols) != before + 1:
                raise ReplayDiverged
        for old, new in zip(leaves(bsym.output), leaves(out), strict=True):
            if isinstance(old, TensorProxy) != isinstance(new, TensorProxy):
                raise ReplayDiverged
            if isinstance(old, TensorProxy):
                if alias is None and tensor_key(old) != tensor_key(new):
                    raise ReplayDiverged
                mapping[old.label] = new
        if bsym.note is not None:
            recording.bound_symbols[-1] = recording.bound_symbols[-1].but(note=bsym.note.renamed(mapping))


def aliases_of(symbols: list) -> list:
    """:func:`output_aliases` of each symbol, but a ``detach`` of a tensor from outside
    whose memory a later one writes (``w.data.div_(...)``) is run again: made like the
    first's output, a view of a weight that requires grad, a write through it would hit
    autograd's leaf check."""
    written = {p.memory for b in symbols for p in written_tensors(b)}
    made = {p.label for b in symbols for p in b.output_tensors()}
    return [
        None
        if b.op is _DETACH
        and not any(i.label in made for i in b.input_tensors())
        and any(o.memory in written for o in b.output_tensors())
        else output_aliases(b)
        for b in symbols
    ]


def output_aliases(bsym) -> list[int | None] | None:
    """For an op whose outputs can be made from the first block's without running it: for
    each output, the index of the input tensor whose storage it views (None: fresh
    storage). None where the op must run again: it writes to its inputs (an in-place op
    may change their metadata), makes tensors from nothing (a factory op: its values may be
    known while tracing), returns more than tensors, outputs share a fresh storage, or an
    output has what ``fake_like`` does not make: a conjugate or negative bit, another dtype
    than the input it views, or a size read from data (a ``nonzero``'s count: each call of
    the op has its own)."""
    inputs = bsym.input_tensors()
    outputs = leaves(bsym.output)
    if (
        bsym.op._schema.is_mutable
        or any(isinstance(o, TensorProxy) and free_unbacked_symbols(o.meta.shape) for o in outputs)
        or not inputs
        or not outputs
        or not all(isinstance(o, TensorProxy) and o.value is None for o in outputs)
        or any(o.meta.is_conj() or o.meta.is_neg() for o in outputs)  # bits ``fake_like`` does not make
        or any(i.value is not None for i in inputs)
    ):
        return None
    storages = {i.memory: index for index, i in reversed(list(enumerate(inputs)))}
    aliases, fresh = [], set()
    for o in outputs:
        storage = o.memory
        index = storages.get(storage)
        if index is None:
            if storage in fresh or o.meta.storage_offset() != 0:
                return None
            fresh.add(storage)
        elif o.meta.dtype != inputs[index].meta.dtype:
            return None  # a view as another dtype (``x.view(torch.int32)``): ``fake_like`` keeps the input's
        aliases.append(index)
    return aliases


def _outputs_like(recording, bsym, aliases: list[int | None], args: tuple, kwargs: dict):
    """The outputs of ``bsym`` again, for ``args``: fake tensors with its outputs' metadata,
    viewing the new inputs' storages where its outputs viewed the old ones'."""
    inputs = [x for x in leaves((args, kwargs)) if isinstance(x, TensorProxy)]
    made_by = NoProvenance(str(bsym.op))

    def again(old, alias):
        like, mode = old.meta, recording.fake_mode  # (metadata only: a deferred fake stays unmade)
        if alias is None:  # memory of its own: its fake is made only if something reads it
            make = partial(fake_like, mode, like, None, like.requires_grad)
            return TensorProxy.deferred(like, make, recording.new_name(), made_by, old.requires_grad)
        fake = fake_like(mode, like, inputs[alias].fake, like.requires_grad)
        return TensorProxy(fake, recording.new_name(), made_by, requires_grad=old.requires_grad)

    olds = iter(zip(leaves(bsym.output), aliases))
    return map_leaves(lambda old: again(*next(olds)), bsym.output)


class ReplayDiverged(Exception):
    """A replayed op recorded otherwise than the template's (it should not happen)."""
