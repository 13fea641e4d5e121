"""Train a small tensor-parallel Llama-style model with eager DTensor and with dtcompile.

Run: torchrun --nproc-per-node 2 scripts/train.py [--steps 20] [--layers 2]
     torchrun --nproc-per-node 4 scripts/train.py --dp 2 --tp 2 [--trace]  (FSDP2 over dp, TP over tp)
     torchrun --nproc-per-node 2 scripts/train.py --accelerate      (processes set up by Accelerate)
     accelerate launch --cpu --num_processes 4 --num_machines 1 --mpirun_hostfile FILE \
         scripts/train.py --accelerate --dp 2 --tp 2   (MPI; see docs/guide-training.md)

Two copies of the model start from the same weights; each trains with AdamW on the same
batches, one eagerly and one compiled by dtcompile. With ``--dp N`` the ranks form an
N x M mesh (``--tp M``): TP inside each block over ``mesh["tp"]``, then FSDP2's
``fully_shard`` on each block and on the root over ``mesh["dp"]``, each dp rank with its
own batches, as torchtitan does. ``--trace`` prints rank 0's compiled forward and
backward: the parameters' all-gathers and the gradients' reduce-scatters are collectives
there. The losses are printed side by side
and must agree to float tolerance (the compiled program sums some gradients in another
order, see docs/design.md), with a single compilation for all steps.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import finish, print0
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtcompile
from dtcompile.testing.models import LlamaModel, parallel_llama


def setup_processes(use_accelerate: bool) -> None:
    torch.set_num_threads(1)
    if use_accelerate:
        from accelerate import Accelerator  # only needed on this path

        accelerator = Accelerator(cpu=True)  # initializes the process group (Gloo on CPU)
        print0(
            f"processes set up by Accelerate: {accelerator.state.distributed_type}, "
            f"{accelerator.num_processes} processes, backend {dist.get_backend()}"
        )
    else:
        dist.init_process_group("gloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--accelerate", action="store_true", help="set up the processes with Accelerate")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks, parameters sharded by FSDP2")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default: the rest)")
    parser.add_argument("--trace", action="store_true", help="print rank 0's compiled forward and backward")
    args = parser.parse_args()
    setup_processes(args.accelerate)
    world = dist.get_world_size()
    tp = args.tp or world // args.dp
    if args.dp * tp != world:
        raise SystemExit(f"--dp {args.dp} x --tp {tp} is not the {world} ranks started")
    mesh = init_device_mesh("cpu", (args.dp, tp), mesh_dim_names=("dp", "tp"))

    vocab, batch, seq = 512, 4, 32

    def make_model():
        if tp > 1:
            model = parallel_llama(mesh["tp"], vocab=vocab, dim=256, layers=args.layers)
        else:
            torch.manual_seed(0)
            model = LlamaModel(vocab, dim=256, layers=args.layers)
        if args.dp > 1:
            for layer in model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        return model

    eager, compiled_model = make_model(), make_model()
    jitted = dtcompile.jit(compiled_model)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    compiled_opt = torch.optim.AdamW(compiled_model.parameters(), lr=1e-3)

    def step(model, opt, tokens, targets):
        start = time.perf_counter()
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item(), time.perf_counter() - start

    print0(f"{'step':>4} {'eager loss':>12} {'dtcompile loss':>15} {'difference':>11}")
    worst, eager_time, compiled_time = 0.0, 0.0, 0.0
    for i in range(args.steps):
        # The same batch on the ranks of a tp group; each dp rank has its own.
        generator = torch.Generator().manual_seed(1000 * mesh["dp"].get_local_rank() + i)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        eager_loss, eager_seconds = step(eager, eager_opt, inputs, targets)
        compiled_loss, compiled_seconds = step(jitted, compiled_opt, inputs, targets)
        if i > 0:  # the first step of dtcompile includes tracing and compiling
            eager_time, compiled_time = eager_time + eager_seconds, compiled_time + compiled_seconds
        worst = max(worst, abs(eager_loss - compiled_loss) / abs(eager_loss))
        print0(f"{i:>4} {eager_loss:>12.6f} {compiled_loss:>15.6f} {compiled_loss - eager_loss:>11.2e}")

    print0(
        f"largest relative difference {worst:.2e}; dtcompile compiled {dtcompile.cache_misses(jitted)} time(s) "
        f"in {sum(dtcompile.compile_seconds(jitted)) * 1e3:.0f} ms"
    )
    if args.trace and dist.get_rank() == 0:
        for trace in dtcompile.last_traces(jitted):
            if trace.title.startswith("execution"):
                print(trace)
    if args.steps > 1:
        steps = args.steps - 1
        print0(
            f"time per step after the first: eager {eager_time / steps * 1e3:.1f} ms, "
            f"dtcompile {compiled_time / steps * 1e3:.1f} ms"
        )
    if worst > 1e-4:
        raise SystemExit(f"the losses differ by {worst:.2e} (relative), more than float tolerance")
    finish()


if __name__ == "__main__":
    main()
