"""Short, readable names of DTensor placements: ``Shard(0)``, ``Replicate()``, ``Partial(sum)``."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard


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
