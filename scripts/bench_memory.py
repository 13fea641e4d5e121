"""Peak tensor memory of one training step: eager DTensor against dtcompile.

Run with torchrun, e.g. on 2 CPU ranks (Gloo):
  OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/bench_memory.py --layers 8

A training step (forward, cross-entropy, backward, AdamW step, gradients set to None) of
a tensor-parallel model, ``--model llama`` (the Llama-style model of ``scripts/train.py``)
or ``--model hf`` (the Hugging Face Llama of ``scripts/benchmark_inference.py``), on the
same weights in each mode. Each mode first runs ``--warmup`` steps (dtcompile compiles;
AdamW makes its state), then one step is measured under ``torch.profiler`` with
``profile_memory=True``: every allocation and free of torch's CPU allocator during the
step, in order, whose running sum is the bytes of tensors alive beyond what lived before
the step (the parameters and the optimizer's state are there in both modes and are not
counted); its maximum is the step's peak. Gloo's own buffers are not torch allocations and
are left out in both modes. Each rank measures its own; the largest is printed.

With ``--fake-world N`` it runs as one process, rank 0 of a fake process group of N
ranks, where every collective completes at once on the calling thread (its values are
garbage, so losses are not compared): the profiler then sees every free, so the peak is
exact and the same at every run. On Gloo ranks it misses the frees Gloo's threads make
(a collective's buffers, let go when it completes), and the peak moves by a few percent
from run to run. ``python scripts/bench_memory.py --fake-world 2 --layers 8``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import finish, init_gloo, print0
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtcompile
from dtcompile.testing.memory import peak_bytes
from dtcompile.testing.models import parallel_hf_llama, parallel_llama


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("llama", "hf"), default="llama")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--fake-world", type=int, default=None, metavar="N", help="one process: rank 0 of N fake ranks")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.fake_world:
        torch.set_num_threads(1)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    else:
        init_gloo()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    vocab = 1024 if args.model == "hf" else 512

    def make_model():
        if args.model == "hf":
            model, _ = parallel_hf_llama(mesh, vocab=vocab, layers=args.layers)
            return model.train()
        return parallel_llama(mesh, vocab=vocab, dim=256, layers=args.layers)

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def logits_of(model):
        out = model(input_ids=inputs) if args.model == "hf" else model(inputs)
        return out.logits if args.model == "hf" else out

    def measure(mode: str) -> tuple[float, float]:
        """The step's peak bytes on the largest rank, and the loss of the step after it."""
        model = make_model()
        run = dtcompile.jit(model) if mode == "dtcompile" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            logits = logits_of(run)
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        for _ in range(args.warmup):
            step()
        peak = torch.tensor([peak_bytes(step)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return peak.item(), step()

    peaks, losses = {}, {}
    for mode in ("eager", "dtcompile"):
        peaks[mode], losses[mode] = measure(mode)
    print0(
        f"{args.model} {args.layers} layers, batch {args.batch} x {args.seq} tokens, "
        f"{dist.get_world_size()} rank(s): peak tensor memory of a training step (largest rank)"
    )
    for mode, peak in peaks.items():
        print0(f"{mode:<10} {peak / 2**20:>9.2f} MiB {peak / peaks['eager']:>7.2f}x eager")
    if args.fake_world:
        print0("(a fake process group: exact peaks, garbage values, losses not compared)")
    else:
        print0(f"losses after the measured step: eager {losses['eager']:.6f}, dtcompile {losses['dtcompile']:.6f}")


if __name__ == "__main__":
    main()
    if dist.get_backend() == "fake":
        dist.destroy_process_group()
    else:
        finish()
