"""Per-call overhead: eager DTensor vs dtcompile vs hand-written per-rank code.

Run: python scripts/bench_overhead.py            (runs itself under torchrun on 1, then 2 ranks)
  or torchrun --nproc-per-node N scripts/bench_overhead.py

For a tensor-parallel MLP (batch 4, seq 32, hidden 256) and a Llama-style block, forward
under no_grad, the variants are interleaved call by call (a barrier before each) and the
medians printed with their ratios. The hand-written code is what a person would write
without DTensor: local weight shards as plain tensors and an explicit dist.all_reduce
closing each row-parallel layer. Targets: dtcompile within 1.1x of the hand-written code;
the block's first call (trace and compile) under 1 s.
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


def hand_written_mlp(model):
    """The MLP as per-rank code: column shard, gelu, row shard, all_reduce."""
    up, down = model.up.weight.to_local(), model.down.weight.to_local()

    def forward(x):
        y = F.linear(F.gelu(F.linear(x, up)), down)
        dist.all_reduce(y)
        return y

    return forward


def hand_written_block(model):
    """The Llama-style block as per-rank code (Megatron style, no sequence parallelism)."""
    attn, mlp = model.attn, model.mlp
    q, k, v, o = (m.weight.to_local() for m in (attn.q, attn.k, attn.v, attn.o))
    gate, up, down = (m.weight.to_local() for m in (mlp.gate, mlp.up, mlp.down))
    norm1, norm2 = model.attn_norm, model.mlp_norm
    head_dim = attn.head_dim

    def forward(x):
        batch, seq, _ = x.shape
        h = norm1(x)
        qs = F.linear(h, q).view(batch, seq, -1, head_dim).transpose(1, 2)
        ks = F.linear(h, k).view(batch, seq, -1, head_dim).transpose(1, 2)
        vs = F.linear(h, v).view(batch, seq, -1, head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        a = F.linear(a.transpose(1, 2).reshape(batch, seq, -1), o)
        dist.all_reduce(a)
        h = x + a
        m = F.linear(F.silu(F.linear(norm2(h), gate)) * F.linear(norm2(h), up), down)
        dist.all_reduce(m)
        return h + m

    return forward


def bench(name, model, hand_written, x, calls):
    with torch.no_grad():
        sync()
        start = time.perf_counter()
        jmodel = dtcompile.jit(model)
        completed(jmodel(x))
        first_call = time.perf_counter() - start
        torch.testing.assert_close(jmodel(x), completed(model(x)))
        torch.testing.assert_close(hand_written(x), completed(model(x)))
        medians = interleaved_medians(
            {"eager": lambda: model(x), "dtcompile": lambda: jmodel(x), "hand-written": lambda: hand_written(x)},
            calls=calls,
        )
    eager, compiled, hand = medians["eager"], medians["dtcompile"], medians["hand-written"]
    print0(
        f"{name:<14} {dist.get_world_size():>5} {eager * 1e3:>9.3f} {compiled * 1e3:>10.3f} {hand * 1e3:>13.3f}"
        f" {compiled / hand:>14.2f}x {eager / compiled:>15.2f}x {first_call * 1e3:>11.0f}"
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
            f"{'model':<14} {'ranks':>5} {'eager ms':>9} {'dtcompile':>10} {'hand-written':>13}"
            f" {'dtc/hand':>15} {'eager/dtc':>16} {'1st call ms':>11}"
        )
    mlp = parallel_mlp(mesh, dim=256, hidden=1024)
    bench("MLP", mlp, hand_written_mlp(mlp), x, calls)
    block = parallel_block(mesh, dim=256, n_heads=8, hidden=512)
    bench("Llama block", block, hand_written_block(block), x, calls)
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
