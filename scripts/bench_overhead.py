"""Per-call overhead: eager DTensor vs dtcompile vs hand-written per-rank code.

Run: python scripts/bench_overhead.py            (runs itself under torchrun on 1, then 2 ranks)
  or torchrun --nproc-per-node N scripts/bench_overhead.py

For a tensor-parallel MLP (batch 4, seq 32, hidden 256), a Llama-style block and an MoE
block with expert parallelism over every rank (8 experts, top 2), forward
under no_grad ("fw") and forward+backward ("fw+bw", gradients reset before each step),
the variants are interleaved call by call (a sync before each) and the medians printed
with their ratios. The hand-written code is what a person would write without DTensor,
Megatron style: local weight shards as plain tensors, an all_reduce closing each
row-parallel layer in the forward and opening each column-parallel one in the backward.
Targets: dtcompile within 1.1x of the hand-written code; the block's first call (trace
and compile) under 1 s.
"""

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import completed, finish, init_gloo, interleaved_medians, print0, sync
from torch.distributed.device_mesh import init_device_mesh

import dtcompile
from dtcompile.testing.models import parallel_block, parallel_mlp
from dtcompile.testing.moe import parallel_moe_block


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all_reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all_reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def _local(weight):
    """This rank's shard of a DTensor weight (or a plain weight) as a leaf of its own."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return local.detach().clone().requires_grad_(weight.requires_grad)


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def hand_written_mlp(model):
    """The MLP as per-rank code: column shard, gelu, row shard, all_reduce."""
    up, down = _local(model.up.weight), _local(model.down.weight)

    def forward(x):
        x = _CopyToParallel.apply(x) if torch.is_grad_enabled() else x
        y = F.linear(F.gelu(F.linear(x, up)), down)
        return _ReduceFromParallel.apply(y)

    return forward, [up, down]


def hand_written_block(model):
    """The Llama-style block as per-rank code (Megatron style, no sequence parallelism)."""
    attn, mlp = model.attn, model.mlp
    q, k, v, o = (_local(m.weight) for m in (attn.q, attn.k, attn.v, attn.o))
    gate, up, down = (_local(m.weight) for m in (mlp.gate, mlp.up, mlp.down))
    norm1, norm2 = _local(model.attn_norm.weight), _local(model.mlp_norm.weight)
    eps, head_dim = model.attn_norm.eps, attn.head_dim

    def forward(x):
        batch, seq, _ = x.shape
        h = _rms_norm(x, norm1, eps)
        h = _CopyToParallel.apply(h) if torch.is_grad_enabled() else h
        qs = F.linear(h, q).view(batch, seq, -1, head_dim).transpose(1, 2)
        ks = F.linear(h, k).view(batch, seq, -1, head_dim).transpose(1, 2)
        vs = F.linear(h, v).view(batch, seq, -1, head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        h = x + _ReduceFromParallel.apply(F.linear(a.transpose(1, 2).reshape(batch, seq, -1), o))
        m = _rms_norm(h, norm2, eps)
        m = _CopyToParallel.apply(m) if torch.is_grad_enabled() else m
        return h + _ReduceFromParallel.apply(F.linear(F.silu(F.linear(m, gate)) * F.linear(m, up), down))

    return forward, [norm1, q, k, v, o, norm2, gate, up, down]


def _step(fn, x, params):
    """One forward and backward, gradients reset first (as ``zero_grad`` does)."""
    for p in params:
        p.grad = None
    fn(x).sum().backward()


def bench(name, model, hand_written, x, calls, training):
    """One row; ``hand_written`` is None for a model whose eager code is per-rank code
    already (the MoE block's dispatch)."""
    forward, hand_params = hand_written or (None, [])
    context = torch.enable_grad() if training else torch.no_grad()
    with context:
        sync()
        start = time.perf_counter()
        jmodel = dtcompile.jit(model)
        completed(jmodel(x))
        first_call = time.perf_counter() - start
        torch.testing.assert_close(jmodel(x), completed(model(x)))
        params = list(model.parameters())
        if training:
            variants = {"eager": lambda: _step(model, x, params), "dtcompile": lambda: _step(jmodel, x, params)}
            if forward is not None:
                variants["hand-written"] = lambda: _step(forward, x, hand_params)
            label = f"{name} fw+bw"
        else:
            variants = {"eager": lambda: model(x), "dtcompile": lambda: jmodel(x)}
            if forward is not None:
                variants["hand-written"] = lambda: forward(x)
            label = f"{name} fw"
        if forward is not None:
            torch.testing.assert_close(forward(x), completed(model(x)))
        medians = interleaved_medians(variants, calls=calls)
    eager, compiled = medians["eager"], medians["dtcompile"]
    hand = medians.get("hand-written")
    hand_ms, ratio = (f"{hand * 1e3:>13.3f}", f"{compiled / hand:>9.2f}x") if hand else (f"{'-':>13}", f"{'-':>10}")
    print0(
        f"{label:<18} {dist.get_world_size():>5} {eager * 1e3:>9.3f} {compiled * 1e3:>10.3f} {hand_ms}"
        f" {ratio} {eager / compiled:>10.2f}x {first_call * 1e3:>12.0f}"
    )


def main() -> None:
    init_gloo()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    calls = int(os.environ.get("BENCH_CALLS", "200"))
    torch.manual_seed(0)
    x = torch.randn(4, 32, 256)
    if dist.get_rank() == 0 and world == 1:
        print(
            f"{'model':<18} {'ranks':>5} {'eager ms':>9} {'dtcompile':>10} {'hand-written':>13}"
            f" {'dtc/hand':>10} {'eager/dtc':>11} {'1st call ms':>12}"
        )
    mlp = parallel_mlp(mesh, dim=256, hidden=1024)
    block = parallel_block(mesh, dim=256, n_heads=8, hidden=512)
    # Expert parallelism over every rank (dtcompile/testing/moe.py): its dispatch is
    # per-rank code already (all_to_all sized by counts read from data).
    moe_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
    moe = parallel_moe_block(moe_mesh, dim=256, heads=8, hidden=512, experts=8, top_k=2)
    for training in (False, True):
        bench("MLP", mlp, hand_written_mlp(mlp), x, calls, training)
        bench("Llama block", block, hand_written_block(block), x, calls, training)
        bench("MoE block", moe, None, x, calls, training)
    finish()


def launch_all() -> None:
    """Run this script under torchrun on 1 and then 2 ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    for ranks in (1, 2):
        subprocess.run([torchrun, "--nproc-per-node", str(ranks), __file__], check=True, env=env)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        main()
    else:
        launch_all()
