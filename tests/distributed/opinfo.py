"""The op-info table of the op tests: each op, the function that calls it, and its sample inputs.

An :class:`OpInfo` names an op, gives a function that calls it on its inputs, and lists
those inputs: a :class:`TensorArg` for each tensor input (its global shape and dtype,
from which :func:`global_inputs` makes seeded global values) and plain Python values for
the rest. The op tests distribute every tensor input over every placement it can take
(:func:`placement_choices`) and compare ``dtcompile.jit(fn)`` with eager DTensor.

Shapes are small and mix dims that a mesh of 2 (or 4) divides with dims it does not, so
that each op sees sharded, replicated and partial inputs without too many combinations.

The gradient tests use the same table: every op with ``grad=True`` (the default) and a
floating-point tensor input is run again with grad mode on and those inputs requiring
grad (:attr:`OpInfo.grad_positions`). Ops whose outputs are not differentiable (integer
results, comparisons, ``*_like`` creations) say ``grad=False``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication


@dataclass(frozen=True)
class TensorArg:
    """A tensor input: its global shape and dtype, and the kind of values it holds.

    ``values`` is ``"normal"`` (standard normal), ``"positive"`` (in [0.5, 2), for ops
    such as log and rsqrt), ``"index"`` (integers in [0, high)) or ``"mask"`` (booleans).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    values: str = "normal"
    high: int = 10


def T(*shape: int, dtype: torch.dtype = torch.float32) -> TensorArg:
    """A tensor input of standard normal values, the usual case of the table."""
    return TensorArg(shape, dtype)


def positive(*shape: int) -> TensorArg:
    """A tensor input of values in [0.5, 2)."""
    return TensorArg(shape, values="positive")


def index(*shape: int, high: int = 10) -> TensorArg:
    """An int64 tensor input of indices in [0, high)."""
    return TensorArg(shape, torch.int64, "index", high)


def mask(*shape: int) -> TensorArg:
    """A boolean tensor input."""
    return TensorArg(shape, torch.bool, "mask")


@dataclass(frozen=True)
class OpInfo:
    """One op of the table. ``args`` holds a :class:`TensorArg` per tensor input and the
    other arguments as they are passed. ``compare_values`` is False for ops whose values
    are not defined (``empty_like``): only their metadata is compared. ``grad`` is False
    for ops none of whose outputs is differentiable."""

    name: str
    fn: Callable
    args: tuple
    compare_values: bool = True
    grad: bool = True

    @property
    def tensor_positions(self) -> list[int]:
        """The positions of the tensor inputs among ``args``."""
        return [i for i, a in enumerate(self.args) if isinstance(a, TensorArg)]

    @property
    def grad_positions(self) -> list[int]:
        """The positions of the tensor inputs that require grad in the gradient tests: the
        floating-point ones, for an op with ``grad``; none otherwise."""
        if not self.grad:
            return []
        return [i for i in self.tensor_positions if self.args[i].dtype.is_floating_point]


def seed_of(name: str) -> int:
    """A seed that every rank computes alike (``hash`` of a str differs between processes)."""
    return zlib.crc32(name.encode())


def _values(arg: TensorArg, generator: torch.Generator) -> torch.Tensor:
    if arg.values == "index":
        return torch.randint(0, arg.high, arg.shape, generator=generator, dtype=arg.dtype)
    if arg.values == "mask":
        return torch.rand(arg.shape, generator=generator) < 0.5
    if arg.values == "positive":
        return (0.5 + 1.5 * torch.rand(arg.shape, generator=generator)).to(arg.dtype)
    return torch.randn(arg.shape, generator=generator).to(arg.dtype)


def global_inputs(op: OpInfo) -> list:
    """The op's arguments with every :class:`TensorArg` replaced by seeded global values."""
    generator = torch.Generator().manual_seed(seed_of(op.name))
    return [_values(a, generator) if isinstance(a, TensorArg) else a for a in op.args]


def partial_locals(value: torch.Tensor, world_size: int, seed: int) -> list[torch.Tensor]:
    """Per-rank tensors whose sum is ``value``: random parts for ranks 1.., the rest on rank 0."""
    generator = torch.Generator().manual_seed(seed)
    if value.dtype.is_floating_point:
        parts = [torch.randn(value.shape, generator=generator).to(value.dtype) for _ in range(world_size - 1)]
    else:
        parts = [
            torch.randint(-5, 5, value.shape, generator=generator, dtype=value.dtype) for _ in range(world_size - 1)
        ]
    first = value - sum(parts) if parts else value
    return [first, *parts]


def placement_choices(arg: TensorArg, world_size: int) -> list:
    """Every placement of a tensor input on a 1-D mesh: Replicate, Shard(d) for each dim the
    mesh divides, and Partial, except for masks, whose sum over ranks means nothing."""
    choices = [Replicate()]
    choices += [Shard(d) for d, size in enumerate(arg.shape) if size % world_size == 0]
    if arg.values != "mask":
        choices.append(Partial())
    return choices


# --- functions that need more than one call -------------------------------------------------


def add_arange(x):
    """A factory op with no tensor argument mixed with a DTensor: eager raises."""
    return x + torch.arange(x.shape[-1])


def add_arange_implicit(x):
    """The same under implicit replication: the plain tensor is taken as replicated."""
    with implicit_replication():
        return x + torch.arange(x.shape[-1], dtype=x.dtype)


def add_full_implicit(x):
    """``torch.full`` and ``torch.zeros`` with sizes read from the input, implicitly replicated."""
    with implicit_replication():
        return x * torch.full((x.shape[-1],), 0.5) + torch.zeros(x.shape[0], 1)


def add_arange_from_local(x):
    """A factory op made into a replicated DTensor on the input's mesh."""
    positions = torch.arange(x.shape[-1], dtype=x.dtype)
    return x * 2 + DTensor.from_local(positions, x.device_mesh, [Replicate()], run_check=False)


def causal_mask_fill(scores):
    """Hugging Face's causal mask: ``triu(ones)`` built in the function, then masked_fill."""
    n = scores.shape[-1]
    with implicit_replication():
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        return scores.masked_fill(causal, float("-inf"))


def attention(q, k, v):
    """Attention written out: scores, softmax, weighted values."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return torch.softmax(scores, dim=-1) @ v


def split_last(x):
    return torch.split(x, 2, dim=-1)


OPS: list[OpInfo] = [
    # elementwise unary
    OpInfo("neg", torch.neg, (T(4, 6),)),
    OpInfo("abs", torch.abs, (T(4, 6),)),
    OpInfo("exp", torch.exp, (T(4, 6),)),
    OpInfo("log", torch.log, (positive(4, 6),)),
    OpInfo("rsqrt", torch.rsqrt, (positive(4, 6),)),
    OpInfo("tanh", torch.tanh, (T(2, 4, 6),)),
    OpInfo("sigmoid", torch.sigmoid, (T(4, 6),)),
    OpInfo("relu", F.relu, (T(4, 6),)),
    OpInfo("gelu", F.gelu, (T(2, 4, 6),)),
    OpInfo("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), (T(4, 6),)),
    OpInfo("silu", F.silu, (T(2, 4, 6),)),
    OpInfo("clamp", torch.clamp, (T(4, 6), -0.5, 0.5)),
    OpInfo("to_float64", lambda x: x.to(torch.float64), (T(4, 6),)),
    OpInfo("clone", torch.clone, (T(4, 6),)),
    OpInfo("contiguous", lambda x: x.transpose(0, 1).contiguous(), (T(4, 6),)),
    # elementwise binary, broadcasting, Python scalars
    OpInfo("add", torch.add, (T(4, 6), T(4, 6))),
    OpInfo("add_broadcast", torch.add, (T(2, 4, 6), T(6))),
    OpInfo("add_alpha", lambda x, y: torch.add(x, y, alpha=2), (T(4, 6), T(4, 6))),
    OpInfo("sub_broadcast", torch.sub, (T(4, 1), T(1, 6))),
    OpInfo("mul", torch.mul, (T(4, 6), T(4, 6))),
    OpInfo("div_broadcast", torch.div, (T(4, 6), positive(4, 1))),
    OpInfo("maximum", torch.maximum, (T(4, 6), T(6))),
    OpInfo("add_int", torch.add, (index(4, 6), index(4, 6)), grad=False),
    OpInfo("add_scalar", lambda x: x + 2.5, (T(4, 6),)),
    OpInfo("rsub_scalar", lambda x: 1.0 - x, (T(4, 6),)),
    OpInfo("mul_scalar_arg", torch.mul, (T(4, 6), 3)),
    OpInfo("div_scalar", lambda x: x / 4, (T(4, 6),)),
    OpInfo("pow_scalar", lambda x: x**2, (T(4, 6),)),
    OpInfo("pow_tensor", torch.pow, (positive(4, 6), T(4, 6))),
    OpInfo("gt", torch.gt, (T(4, 6), T(4, 6)), grad=False),
    OpInfo("where", torch.where, (mask(4, 6), T(4, 6), T(6))),
    OpInfo("where_scalar", lambda c, x: torch.where(c, x, 0.0), (mask(4, 6), T(4, 6))),
    OpInfo("masked_fill", torch.Tensor.masked_fill, (T(4, 6), mask(4, 6), -1.0)),
    # reductions
    OpInfo("sum", torch.sum, (T(4, 6),)),
    OpInfo("sum_dim", lambda x: x.sum(dim=1), (T(2, 4, 6),)),
    OpInfo("sum_dims_keepdim", lambda x: x.sum(dim=(0, 2), keepdim=True), (T(2, 4, 6),)),
    OpInfo("mean", torch.mean, (T(4, 6),)),
    OpInfo("mean_dim", lambda x: x.mean(dim=-1), (T(4, 6),)),
    OpInfo("amax", torch.amax, (T(4, 6),)),
    OpInfo("amax_dim", lambda x: x.amax(dim=0), (T(4, 6),)),
    OpInfo("amin_dim_keepdim", lambda x: x.amin(dim=1, keepdim=True), (T(4, 6),)),
    OpInfo("max_dim", lambda x: torch.max(x, dim=1), (T(4, 6),)),
    OpInfo("argmax_dim", lambda x: x.argmax(dim=-1), (T(4, 6),), grad=False),
    OpInfo("var_dim", lambda x: x.var(dim=1), (T(4, 6),)),
    OpInfo("vector_norm", lambda x: torch.linalg.vector_norm(x, dim=-1), (T(4, 6),)),
    OpInfo("cumsum", lambda x: x.cumsum(dim=1), (T(4, 6),)),
    # matrix products
    OpInfo("mm", torch.mm, (T(4, 6), T(6, 8))),
    OpInfo("mm_bfloat16", torch.mm, (T(4, 6, dtype=torch.bfloat16), T(6, 8, dtype=torch.bfloat16))),
    OpInfo("matmul", torch.matmul, (T(2, 4, 6), T(6, 8))),
    OpInfo("matmul_vector", torch.matmul, (T(4, 6), T(6))),
    OpInfo("linear", F.linear, (T(2, 4, 6), T(8, 6), T(8))),
    OpInfo("bmm", torch.bmm, (T(2, 4, 6), T(2, 6, 8))),
    OpInfo("addmm", torch.addmm, (T(8), T(4, 6), T(6, 8))),
    OpInfo("einsum", lambda x, w: torch.einsum("bij,jk->bik", x, w), (T(2, 4, 6), T(6, 8))),
    # normalizations and activations of models
    OpInfo("softmax", lambda x: torch.softmax(x, dim=-1), (T(2, 4, 6),)),
    OpInfo("log_softmax", lambda x: F.log_softmax(x, dim=1), (T(2, 4, 6),)),
    OpInfo("layer_norm", lambda x, w, b: F.layer_norm(x, (6,), w, b), (T(2, 4, 6), T(6), T(6))),
    OpInfo("layer_norm_no_affine", lambda x: F.layer_norm(x, (6,)), (T(4, 6),)),
    OpInfo("rms_norm", lambda x, w: F.rms_norm(x, (6,), w, eps=1e-6), (T(2, 4, 6), T(6))),
    OpInfo("embedding", F.embedding, (index(2, 4), T(10, 6))),
    OpInfo(
        "embedding_replicated",
        lambda i, w: F.embedding(i, w).redistribute(w.device_mesh, [Replicate()]),
        (index(2, 4), T(10, 6)),
    ),
    # 3-D inputs take SDPA's math path on CPU, whose ops have sharding rules (with is_causal
    # it builds a plain-tensor mask, and eager raises). 4-D inputs take the fused CPU kernel,
    # which has none: eager DTensor then searches its decomposition for a strategy, about 15 s
    # for each new mix of sharded placements, so no dim is shardable there.
    OpInfo("sdpa", F.scaled_dot_product_attention, (T(2, 4, 8), T(2, 4, 8), T(2, 4, 8))),
    OpInfo(
        "sdpa_causal",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        (T(2, 4, 8), T(2, 4, 8), T(2, 4, 8)),
    ),
    OpInfo("sdpa_fused", F.scaled_dot_product_attention, (T(1, 1, 3, 5), T(1, 1, 3, 5), T(1, 1, 3, 5))),
    OpInfo(
        "sdpa_fused_causal",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        (T(1, 1, 3, 5), T(1, 1, 3, 5), T(1, 1, 3, 5)),
    ),
    OpInfo("attention", attention, (T(2, 4, 8), T(2, 4, 8), T(2, 4, 8))),
    # views and shape ops
    OpInfo("reshape", lambda x: x.reshape(8, 6), (T(2, 4, 6),)),
    OpInfo("reshape_size_arg", torch.reshape, (T(2, 4, 6), torch.Size([8, 6]))),
    OpInfo("view_split_dim", lambda x: x.view(2, 4, 2, 3), (T(2, 4, 6),)),
    OpInfo("flatten", lambda x: x.flatten(1), (T(2, 4, 6),)),
    OpInfo("unsqueeze", lambda x: x.unsqueeze(1), (T(4, 6),)),
    OpInfo("transpose", lambda x: x.transpose(0, 1), (T(2, 4, 6),)),
    OpInfo("t", torch.t, (T(4, 6),)),
    OpInfo("permute", lambda x: x.permute(2, 0, 1), (T(2, 4, 6),)),
    OpInfo("expand", lambda x: x.expand(2, 4, 6), (T(4, 1),)),
    OpInfo("slice", lambda x: x[:, 1:5], (T(4, 6),)),
    OpInfo("slice_step", lambda x: x[..., ::2], (T(2, 4, 6),)),
    OpInfo("select", lambda x: x[1], (T(4, 6),)),
    OpInfo("narrow", lambda x: x.narrow(0, 0, 2), (T(4, 6),)),
    OpInfo("cat", lambda x, y: torch.cat([x, y], dim=0), (T(4, 6), T(2, 6))),
    OpInfo("cat_last", lambda x, y: torch.cat([x, y], dim=-1), (T(4, 6), T(4, 2))),
    OpInfo("stack", lambda x, y: torch.stack([x, y]), (T(4, 6), T(4, 6))),
    OpInfo("split", split_last, (T(4, 6),)),
    OpInfo("chunk", lambda x: x.chunk(2, dim=0), (T(4, 6),)),
    # DTensor's own API: explicit redistribution, results that are not DTensors
    OpInfo("redistribute", lambda x: x.redistribute(x.device_mesh, [Replicate()]), (T(4, 6),)),
    OpInfo(
        "redistribute_flattened", lambda x: x.flatten(0, 1).redistribute(x.device_mesh, [Replicate()]), (T(2, 4, 6),)
    ),
    OpInfo("full_tensor", lambda x: (x * 2).full_tensor(), (T(4, 6),)),
    OpInfo("to_local", lambda x: (x + 1).to_local(), (T(4, 6),)),
    OpInfo("with_shape", lambda x: (x.sum(dim=0), x.shape, x.placements), (T(4, 6),)),
    # creations
    OpInfo("ones_like", torch.ones_like, (T(4, 6),), grad=False),
    OpInfo("zeros_like", torch.zeros_like, (T(2, 4, 6),), grad=False),
    OpInfo("full_like", torch.full_like, (T(4, 6), 3.0), grad=False),
    OpInfo("empty_like", torch.empty_like, (T(4, 6),), compare_values=False, grad=False),
    OpInfo("add_arange", add_arange, (T(4, 6),)),
    OpInfo("add_arange_implicit", add_arange_implicit, (T(4, 6),)),
    OpInfo("add_arange_from_local", add_arange_from_local, (T(4, 6),)),
    OpInfo("add_full_implicit", add_full_implicit, (T(4, 6),)),
    OpInfo("causal_mask_fill", causal_mask_fill, (T(2, 4, 4),)),
    OpInfo("mul_scalar_tensor", lambda x: x * torch.tensor(0.5), (T(4, 6),)),
]

OPS_BY_NAME: dict[str, OpInfo] = {op.name: op for op in OPS}
GRAD_OPS: list[OpInfo] = [op for op in OPS if op.grad_positions]
assert len(OPS_BY_NAME) == len(OPS), "op names must be unique"
