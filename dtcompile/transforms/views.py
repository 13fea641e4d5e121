"""Removal of redundant views.

Identity views: DTensor's ``from_local`` issues ``view_as(x)``; factory ops under grad
mode come back ``detach``ed; ``x[..., 0:]`` and ``expand(-1, ...)`` keep the whole tensor.
Compiled programs run without autograd, so these are the same tensor; but for a detach
of an input's memory, which says that the caller gets a tensor that does not require grad.

View chains: ``view(unsqueeze(view(x)))`` of a row-major ``x`` is one ``view`` of ``x``
(DTensor's ``linear`` ends in a ``view`` that the model's ``view`` reshapes again; masks
are built by chains of ``unsqueeze``).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ..core import TensorProxy, Trace, aten_symbol, renamed
from ..core.op_classes import MAYBE_IDENTITY_VIEWS, ORDER_KEEPING_VIEWS, RESHAPES, is_row_major, makes_view
from ..core.symbolic import known_equal, known_shape_equal

aten = torch.ops.aten
_LARGE = 2**62  # a slice's end at or past this is "to the end"


def _whole_on_every_rank(bsym) -> bool:
    """A ``slice`` or ``expand`` that keeps the whole tensor whatever its size: ``[0:]``
    (step 1), ``expand(-1, ...)``. Whether ``x[:2]`` or ``expand(1, 12)`` keeps it depends
    on the local size, which uneven shards make differ between ranks; removing the op on
    some ranks only would make their programs differ."""
    args = bsym.args
    if bsym.op is aten.slice.Tensor:
        start = args[2] if len(args) > 2 else bsym.kwargs.get("start")
        end = args[3] if len(args) > 3 else bsym.kwargs.get("end")
        step = args[4] if len(args) > 4 else bsym.kwargs.get("step", 1)
        # Asked without guarding: a start or step may be a number read from tensor data.
        starts_at_0 = start is None or known_equal(start, 0)
        return starts_at_0 and (end is None or (type(end) is int and end >= _LARGE)) and known_equal(step, 1)
    if bsym.op is aten.expand.default:
        return all(type(size) is int and size == -1 for size in args[1])
    return True


def _free_stride_unknown(source: TensorProxy) -> bool:
    """Eager's reshape computes a dim of size 1 its own stride, where the fake mode's keeps
    the source's (a ``[1, 3]`` slice of a ``[1, 4]`` tensor viewed as ``[1, 3]``: ``(3, 1)``
    in eager); and the stride of a size-1 dim of the source itself may be the fake kernel's
    guess, not eager's kernel's (``(t.T * 2)`` of an ``[n, 1]`` tensor: the fake's ``(n,
    1)``, eager's ``(1, 1)``, which ``view(1, n)`` makes ``(n, 1)``). Such a view is kept."""
    return any(known_equal(size, 1) for size in source.shape)


def _is_identity_view(bsym) -> bool:
    if bsym.op not in MAYBE_IDENTITY_VIEWS or not bsym.args or not isinstance(bsym.args[0], TensorProxy):
        return False
    if not _whole_on_every_rank(bsym):
        return False
    source, result = bsym.args[0], bsym.output
    if bsym.op in (aten.view.default, aten._unsafe_view.default) and _free_stride_unknown(source):
        return False
    return (
        isinstance(result, TensorProxy)
        and result.dtype == source.dtype
        and known_shape_equal(result.shape, source.shape)
        and known_shape_equal(result.stride(), source.stride())
        and known_equal(result.storage_offset(), source.storage_offset())
        and result.is_conj() == source.is_conj()
        and result.is_neg() == source.is_neg()
    )


_REPOINTING = (aten.set_, aten.resize_, aten.resize_as_, aten.as_strided_)


def _repoints(bsym) -> bool:
    return getattr(bsym.op, "overloadpacket", None) in _REPOINTING and bool(bsym.args)


def remove_identity_views(trace: Trace) -> Trace:
    """Replace each identity view by its source. A returned view stays when its source is
    a trace input or is returned too, so that the caller never gets its own input back, or
    one tensor twice, where eager gives distinct tensors."""
    leaves, _ = tree_flatten(trace.output)
    returned = {x.label for x in leaves if isinstance(x, TensorProxy)}
    inputs = {p.label for p in trace.inputs}
    # A view whose own storage the code re-points (``x.detach().set_(y)``) is a tensor of its
    # own: on its source, the caller's ``x`` would be re-pointed.
    repointed = {b.args[0].label for b in trace.bound_symbols if _repoints(b) and isinstance(b.args[0], TensorProxy)}
    # A detach of an input (or a view of one) is kept: under no_grad the caller's input may
    # require grad, and a view of it returned without the detach would too.
    of_inputs = set(inputs)
    renames: dict[str, TensorProxy] = {}
    kept = []
    for bsym in trace.bound_symbols:
        bsym = bsym.with_inputs_renamed(renames) if renames else bsym
        source = bsym.args[0] if bsym.args else None
        if isinstance(source, TensorProxy) and source.label in of_inputs and makes_view(bsym.op):
            if bsym.op is aten.detach.default:
                kept.append(bsym)
                continue
            of_inputs.update(
                x.label for x in tree_flatten(bsym.output)[0] if isinstance(x, TensorProxy)
            )  # (split's list)
        if _is_identity_view(bsym) and bsym.output.label not in repointed:
            source, label = bsym.args[0], bsym.output.label
            if label not in returned:
                renames[label] = source
                continue
            if source.label not in inputs and source.label not in returned:
                renames[label] = source
                returned.add(source.label)
                continue
        kept.append(bsym)

    return trace.derive(f"{trace.fn_name}, after removing identity views", kept, renamed(trace.output, renames))


def collapse_view_chains(trace: Trace) -> Trace:
    """Reshape a row-major tensor directly instead of through intermediate views: the
    last op of an order-keeping view chain from a row-major ``x``, whose result is
    row-major, becomes a ``view`` of ``x`` (the same ``view``/``reshape`` call, or a
    ``view`` to the result's shape where that shape is constant); the intermediates are
    left to dead-code elimination. Same storage, offset, shape and strides: the same tensor."""
    root: dict[str, TensorProxy] = {}  # label -> the row-major tensor it relabels in order
    symbols = []
    for bsym in trace.bound_symbols:
        source = bsym.args[0] if bsym.args else None
        # A detach left by ``remove_identity_views`` says the result does not require grad:
        # a view of it is not a view of its source.
        keeps_chain = bsym.op in ORDER_KEEPING_VIEWS and bsym.op is not aten.detach.default
        if keeps_chain and isinstance(source, TensorProxy) and isinstance(bsym.output, TensorProxy):
            origin = root.get(source.label)
            if origin is None and is_row_major(source):
                origin = source
            if origin is not None:
                if origin is not source and is_row_major(bsym.output):
                    if bsym.op in RESHAPES:
                        bsym = bsym.but(args=(origin, *bsym.args[1:]))
                    elif all(type(size) is int for size in bsym.output.shape):  # unsqueeze(unsqueeze(x))
                        view = aten.view.default
                        bsym = bsym.but(
                            symbol=aten_symbol(view), args=(origin, list(bsym.output.shape)), kwargs={}, op=view
                        )
                root[bsym.output.label] = origin
        symbols.append(bsym)
    return trace.derive(f"{trace.fn_name}, after collapsing view chains", symbols, trace.output)
