"""Short, readable names of DTensor placements (``Shard(0)``, ``Replicate()``, ``Partial(sum)``),
and of a torch-level call's arguments and result in the notes of its symbols."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..core import TensorProxy, TracingError
from ..core.symbolic import symbolic_expr


def describe_placement(placement) -> str:
    if type(placement) is Shard:
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    if isinstance(placement, Partial):
        return f"Partial({placement.reduce_op})"
    return repr(placement)


def describe_placements(placements) -> str:
    if len(placements) == 1:
        return describe_placement(placements[0])
    return "(" + ", ".join(describe_placement(p) for p in placements) + ")"


def describe_argument(value, proxies: list) -> str | None:
    """A bound symbol's note template for one argument of its torch-level call; the proxies it names are appended to ``proxies``."""
    if isinstance(value, DTensor):
        local = value._local_tensor
        placements = describe_placements(value.placements)
        if not isinstance(local, TensorProxy):
            return f"<constant>: {placements}"
        proxies.append(local)
        return f"{{{len(proxies) - 1}}}: {placements}"
    if isinstance(value, TensorProxy):
        proxies.append(value)
        return f"{{{len(proxies) - 1}}}"
    if isinstance(value, (list, tuple)):
        inner = [d for d in (describe_argument(v, proxies) for v in value) if d is not None]
        return f"[{', '.join(inner)}]" if inner else None
    return None


def describe_output(value) -> str:
    if isinstance(value, DTensor):
        return describe_placements(value.placements)
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(describe_output(v) for v in value) + ")"
    if isinstance(value, torch.Tensor):
        return "Tensor"
    return type(value).__name__


def respec_refusal(where: object | None) -> None:
    """Raise where the traced code changed, in place, the spec of a DTensor the call holds
    (``where`` names it): eager changes the caller's DTensor, the program only its local."""
    if where is not None:
        raise TracingError(
            f"dtcompile.jit: the call changes the placements or shape of {where} in place (squeeze_ "
            "re-indexing a Shard, an out= of other placements); a compiled call changes only its local "
            "tensor. Use the out-of-place op (y = x.squeeze(0))"
        )


def same_spec(spec, traced) -> bool:
    """``spec`` is ``traced``, or DTensor set an equal one (an ``out=`` DTensor's); sizes
    compared by their expressions (comparing SymInts would add guards)."""
    if spec is traced:
        return True
    sizes = zip((*spec.shape, *spec.stride), (*traced.shape, *traced.stride))
    return (
        spec.mesh == traced.mesh
        and spec.placements == traced.placements
        and spec.tensor_meta.dtype == traced.tensor_meta.dtype
        and all(symbolic_expr(a) == symbolic_expr(b) for a, b in sizes)
    )
