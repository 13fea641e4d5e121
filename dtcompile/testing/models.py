"""Small tensor-parallel models: a two-layer MLP and a Llama-style transformer block.

Each comes with the usual tensor-parallel plan: column-parallel in, row-parallel out, so
that one all-reduce (or, with sequence parallelism, an all-gather and a reduce-scatter)
closes each parallel region.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class MLP(nn.Module):
    def __init__(self, dim: int = 256, hidden: int = 1024, bias: bool = False):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def mlp_plan() -> dict:
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """RMSNorm, causal self-attention, RMSNorm, SwiGLU MLP, with residuals."""

    def __init__(self, dim: int = 256, n_heads: int = 8, hidden: int = 512):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


def block_plan(sequence_parallel: bool = False) -> dict:
    """q/k/v and gate/up column-parallel, o and down row-parallel. With sequence
    parallelism the norms run on sequence shards (Shard(1)) and the block's input and
    output are each rank's sequence shard."""
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "mlp.gate": ColwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update(
            {
                "attn_norm": SequenceParallel(),
                "mlp_norm": SequenceParallel(),
                "attn": gather,
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.o": RowwiseParallel(output_layouts=Shard(1)),
                "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
    return plan


def parallel_mlp(mesh, dim: int = 256, hidden: int = 1024, seed: int = 0) -> MLP:
    """An MLP with the same weights on every rank, sharded over ``mesh``."""
    torch.manual_seed(seed)
    return parallelize_module(MLP(dim, hidden), mesh, mlp_plan())


def parallel_block(
    mesh, dim: int = 256, n_heads: int = 8, hidden: int = 512, sequence_parallel: bool = False, seed: int = 0
) -> LlamaBlock:
    """A Llama-style block with the same weights on every rank, sharded over ``mesh``."""
    torch.manual_seed(seed)
    return parallelize_module(LlamaBlock(dim, n_heads, hidden), mesh, block_plan(sequence_parallel))


class LlamaModel(nn.Module):
    """A small Llama-style language model: embedding, blocks, final norm, output head."""

    def __init__(self, vocab: int = 512, dim: int = 256, layers: int = 2, n_heads: int = 8, hidden: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, n_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def llama_plan(layers: int) -> dict:
    """Row-parallel embedding (each rank holds a slice of the vocabulary), the blocks'
    plan, and a column-parallel output head whose logits are gathered."""
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(layers):
        plan.update({f"layers.{i}.{name}": style for name, style in block_plan().items()})
    return plan


def parallel_llama(
    mesh, vocab: int = 512, dim: int = 256, layers: int = 2, n_heads: int = 8, hidden: int = 512, seed: int = 0
) -> LlamaModel:
    """A small Llama-style model with the same weights on every rank, sharded over ``mesh``."""
    torch.manual_seed(seed)
    return parallelize_module(LlamaModel(vocab, dim, layers, n_heads, hidden), mesh, llama_plan(layers))


def hf_llama_plan(layers: int) -> dict:
    """The usual tensor-parallel plan of a Hugging Face Llama: q/k/v/gate/up column-wise,
    o/down row-wise (attention then runs on each rank's heads as plain tensors)."""
    plan = {}
    for i in range(layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


def parallel_hf_llama(
    mesh,
    vocab: int = 1024,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 8,
    kv_heads: int = 4,
    intermediate: int | None = None,
    max_positions: int = 2048,
    seed: int = 0,
):
    """A ``transformers`` ``LlamaForCausalLM`` from a small config, random weights equal on
    every rank (no download), sharded over ``mesh`` with :func:`hf_llama_plan`. Returns
    ``(model, config)``; the model is in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return parallelize_module(model, mesh, hf_llama_plan(layers)), config
