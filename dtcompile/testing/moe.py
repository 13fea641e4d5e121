"""A small mixture-of-experts model with expert parallelism, built the way torchtitan
builds one, for tests and benchmarks.

On a 2-D mesh ``(ep, tp)``: each ``ep`` rank holds its own tokens (data parallel over
``ep``) and ``experts / ep`` of the experts; attention is tensor-parallel over ``tp``.
The MoE layer:

1. a router scores each token and keeps its top ``k`` experts;
2. counts the tokens sent to each expert (``bincount``) and exchanges the counts with the
   other ``ep`` ranks (``all_to_all_single``), reading them with ``.tolist()``;
3. sends each token to the rank holding its expert (``all_to_all_single`` with those
   split sizes, the autograd variant), where the tokens are grouped by local expert,
   each expert (a SwiGLU MLP) runs on its tokens (``split`` by the counts), and the
   results go back the same way;
4. combines each token's ``k`` results weighted by its router scores.

Every size after step 2 comes from the data: compiled, they are numbers the program
reads at run time, and one compilation serves every routing.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Experts(nn.Module):
    """``experts`` SwiGLU MLPs; with expert parallelism, the weights are DTensors sharded
    over the ``ep`` mesh (dim 0: each rank holds its experts' weights)."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)

    def forward(self, tokens: torch.Tensor, counts: list) -> torch.Tensor:
        """``tokens`` grouped by local expert, ``counts[e]`` tokens for expert ``e``: a
        matmul chain per expert. (torchtitan's ``torch._grouped_mm`` runs float32 on CPU in
        torch 2.13, but its meta function, which tracing runs, accepts bfloat16 only.)"""
        w1, w3, w2 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w3, self.w2))
        outputs = []
        for e, chunk in enumerate(tokens.split(counts)):
            outputs.append((F.silu(chunk @ w1[e]) * (chunk @ w3[e])) @ w2[e])
        return torch.cat(outputs)


class MoE(nn.Module):
    """Top-``k`` routing over ``experts`` experts, dispatched over the ``ep`` group."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, ep_group=None, ep_size: int = 1):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts, dim, hidden)
        self.top_k, self.num_experts = top_k, experts
        self.ep_group, self.ep_size = ep_group, ep_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = self.router(x).softmax(-1)
        top_scores, chosen = scores.topk(self.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # token copies grouped by expert
        routed = x[order // self.top_k]
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        local_experts = self.num_experts // self.ep_size
        if self.ep_size > 1:
            received_counts = funcol.all_to_all_single(per_expert, None, None, self.ep_group).wait()
            send = per_expert.view(self.ep_size, local_experts).sum(1).tolist()
            receive = received_counts.view(self.ep_size, local_experts).sum(1).tolist()
            routed = funcol.all_to_all_single_autograd(routed, receive, send, self.ep_group)
            routed = funcol.wait_tensor(routed)
            # Received from each rank in turn, grouped by local expert within each: group
            # them by local expert across ranks.
            local_ids = torch.arange(local_experts, device=x.device).repeat(self.ep_size)
            expert_of = torch.repeat_interleave(local_ids, received_counts)
            regroup = expert_of.argsort(stable=True)
            counts = received_counts.view(self.ep_size, local_experts).sum(0).tolist()
            expert_out = torch.empty_like(routed)
            expert_out = expert_out.index_copy(0, regroup, self.experts(routed[regroup], counts))
            routed_out = funcol.wait_tensor(funcol.all_to_all_single_autograd(expert_out, send, receive, self.ep_group))
        else:
            routed_out = self.experts(routed, per_expert.tolist())
        weights = top_scores.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add(0, order // self.top_k, routed_out * weights)
        return out.reshape(shape)


class Attention(nn.Module):
    """Multi-head self-attention, tensor-parallel over ``tp`` (q/k/v column-wise, o row-wise)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(batch, seq, -1))


class MoEBlock(nn.Module):
    """Attention and an MoE layer, each after an RMSNorm, with residuals."""

    def __init__(self, dim: int, heads: int, hidden: int, experts: int, top_k: int, ep_group=None, ep_size: int = 1):
        super().__init__()
        self.attention_norm, self.moe_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.moe = MoE(dim, hidden, experts, top_k, ep_group, ep_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.moe(self.moe_norm(h))


def parallel_moe_block(
    mesh, dim: int = 32, heads: int = 4, hidden: int = 48, experts: int = 4, top_k: int = 2, seed: int = 0
) -> MoEBlock:
    """An :class:`MoEBlock` with the same weights on every rank, on a 2-D mesh with dims
    named ``ep`` and ``tp``: attention tensor-parallel over ``tp`` (its outputs plain local
    tensors again), experts sharded over ``ep``, router and norms replicated."""
    ep, tp = mesh["ep"], mesh["tp"]
    torch.manual_seed(seed)
    block = MoEBlock(dim, heads, hidden, experts, top_k, ep.get_group(), ep.size())
    attention_plan = {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "o": RowwiseParallel(output_layouts=Replicate()),
    }
    block.attention.heads //= tp.size()
    parallelize_module(block.attention, tp, attention_plan)
    for name in ("w1", "w3", "w2"):
        weight = getattr(block.moe.experts, name)
        sharded = distribute_tensor(weight.detach(), ep, [Shard(0)])
        setattr(block.moe.experts, name, nn.Parameter(sharded))
    return block
