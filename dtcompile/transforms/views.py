"""Removal of views that change nothing.

DTensor's ``from_local`` issues ``view_as(x)``; factory ops under grad mode come back
``detach``ed. Compiled programs run without autograd, so these are the same tensor.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ..core import TensorProxy, Trace, renamed
from ..core.symbolic import known_equal, known_shape_equal

aten = torch.ops.aten
_VIEW_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.alias.default,
    aten.reshape.default,
    aten.detach.default,
}


def _is_identity_view(bsym) -> bool:
    if bsym.op not in _VIEW_OPS or not bsym.args or not isinstance(bsym.args[0], TensorProxy):
        return False
    source, result = bsym.args[0], bsym.output
    return (
        isinstance(result, TensorProxy)
        and known_shape_equal(result.shape, source.shape)
        and known_shape_equal(result.stride(), source.stride())
        and known_equal(result.storage_offset(), source.storage_offset())
    )


def remove_identity_views(trace: Trace) -> Trace:
    """Replace each identity view by its source. A returned view stays when its source is
    a trace input or is returned too, so that the caller never gets its own input back, or
    one tensor twice, where eager gives distinct tensors."""
    leaves, _ = tree_flatten(trace.output)
    returned = {x.label for x in leaves if isinstance(x, TensorProxy)}
    inputs = {p.label for p in trace.inputs}
    renames: dict[str, TensorProxy] = {}
    kept = []
    for bsym in trace.bound_symbols:
        bsym = bsym.with_inputs_renamed(renames) if renames else bsym
        if _is_identity_view(bsym):
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
