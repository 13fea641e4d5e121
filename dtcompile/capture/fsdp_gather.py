"""The all-gathers of the parameters FSDP2 manages, as DTensor redistributions
(``fsdp.py``'s FSDPTracing unshards a module's parameters with these before its forward):
one parameter alone, or a bucket of alike ones with one all-gather, as FSDP2 buckets a
group's; in backward, DTensor's reduce-scatter of their gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

if TYPE_CHECKING:
    from .fsdp import ShardedParameter


def unshard(sharded: DTensor, param: ShardedParameter) -> torch.Tensor:
    """The unsharded parameter of ``sharded`` (a DTensor sharded over mesh dim 0, the dp
    dim): DTensor's all-gather of it, and in backward DTensor's reduce-scatter (an
    average over dp) of its gradient."""
    placements = [Replicate(), *sharded.placements[1:]]
    full = sharded.redistribute(
        sharded.device_mesh, placements, forward_dtype=param.param_dtype, backward_dtype=param.reduce_dtype
    )
    local = full.to_local(grad_placements=[Partial("avg"), *placements[1:]])
    return _as_tp_dtensor(local, param)


def _as_tp_dtensor(local: torch.Tensor, param: ShardedParameter) -> torch.Tensor:
    spec = param.tp_spec
    if spec is None:
        return local
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)


def unshard_group(sharded: list[DTensor], params: list[ShardedParameter]) -> list[torch.Tensor]:
    """The unsharded parameters of ``sharded`` (alike: evenly sharded on dim 0, one dtype,
    one mixed-precision policy, one dp mesh) with one all-gather and, in backward, one
    reduce-scatter, as FSDP2 buckets a group's parameters.

    The local shards are flattened and concatenated (FSDP2's copy-in) into one 1-D
    DTensor sharded over dp, which DTensor redistributes to Replicate (the all-gather);
    its gradient is declared ``Partial("avg")``, so DTensor's backward is one
    reduce-scatter of the concatenated gradients. The gathered buffer holds each rank's
    concatenation in rank order: viewed as ``(ranks, n)`` and split by columns, each
    parameter's column block, rows concatenated, is its unsharded tensor (FSDP2's
    copy-out). Each value is the one :func:`unshard` gives: the same elements are
    gathered, and the same elements averaged."""
    first = params[0]
    mesh, ranks = first.dp_mesh, first.dp_mesh.size()
    locals_ = [value.to_local() for value in sharded]  # gradients: DTensors sharded as ``sharded``
    flat_local = torch.cat([local.reshape(-1) for local in locals_])
    n = flat_local.numel()
    flat = DTensor.from_local(flat_local, mesh, [Shard(0)], run_check=False, shape=(ranks * n,), stride=(1,))
    full = flat.redistribute(mesh, [Replicate()], forward_dtype=first.param_dtype, backward_dtype=first.reduce_dtype)
    gathered = full.to_local(grad_placements=[Partial("avg")])
    columns = gathered.view(ranks, n).split([local.numel() for local in locals_], dim=1)
    unsharded = [column.reshape(ranks * local.shape[0], *local.shape[1:]) for column, local in zip(columns, locals_)]
    # A frozen member's needs no gradient, as eager's does not (the buffer needs one where any member does).
    unsharded = [u if value.requires_grad else u.detach() for u, value in zip(unsharded, sharded)]
    return [_as_tp_dtensor(u, param) for u, param in zip(unsharded, params)]


def buckets(params: list[ShardedParameter]) -> list[list[int]]:
    """The parameters of a module (by index) that share an all-gather: those evenly
    sharded on dim 0 with the same dtypes, in FSDP2's order; every other one alone."""
    buckets: dict[object, list[int]] = {}
    for i, param in enumerate(params):
        key = (param.dtype, param.param_dtype, param.reduce_dtype, id(param.dp_mesh)) if param.even_on_dim0 else i
        buckets.setdefault(key, []).append(i)
    return list(buckets.values())
