"""A training step of the TP Llama-style model with FSDP2: eager vs dtcompile vs torch.compile.

Run: python scripts/bench_train.py          (runs itself under torchrun: 4 ranks as 2x2 dp x tp, then 2 ranks dp only)
  or torchrun --nproc-per-node 4 scripts/bench_train.py --dp 2 --tp 2 [--modes eager dtcompile]

The model is ``scripts/train.py``'s (vocabulary 512, hidden 256, 2 blocks, batch 4 x 32
tokens): TP inside each block over ``mesh["tp"]`` (with ``--tp 1``, no TP), then
``fully_shard`` on each block and the root over ``mesh["dp"]``. A step is forward,
cross-entropy, backward, AdamW and ``zero_grad``. Each mode trains its own copy from the
same weights on the same batches: ``eager`` (FSDP2's hooks, DTensor), ``dtcompile``
(``dtcompile.jit(model)``) and ``torch.compile`` (``torch.compile(model)``, Inductor; if
its first step fails the table says so, with the error's first line). The modes are
interleaved call by call with a sync before each call (``timing.interleaved_medians``),
one thread per rank, and every rank reports the slowest rank's median.

**Peak memory**, per mode, is the peak of live tensor bytes during one step above what
was live when the step began (parameters, optimizer state, the batch). It is measured in
a process of its own (``--fake-world``): the same model, mesh and steps on rank 0 of a
fake process group of the same size, where every collective completes at once on the
calling thread. The step runs under ``torch.profiler`` with ``profile_memory=True``,
which records every allocation and free of the CPU allocator in order; the peak is the
largest running sum (``dtcompile.testing.memory.peak_bytes``). So what is measured is
how long each mode's program keeps its tensors alive, exactly, the same at every run:
on Gloo ranks the profiler misses the frees Gloo's threads make (a collective's buffers,
let go when it completes), and the same step measured there moved by up to 4 MiB from
run to run, more than the modes differ. Collective buffers are alive there as here: each
program holds them until it waits. All modes have run three steps before, so the step
measured is a steady one. Not seen: memory outside torch's CPU allocator (Gloo's own
buffers, Python objects), the same for every mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import finish, init_gloo, interleaved_medians, print0, sync
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor._ops._mask_buffer import MaskBuffer
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtcompile
from dtcompile.testing import memory
from dtcompile.testing.models import LlamaModel, parallel_llama

MODES = ("eager", "dtcompile", "torch.compile")


def make_model(mesh, args):
    """The model of ``scripts/train.py``: TP over ``mesh["tp"]`` (unless 1 rank), FSDP2 over ``mesh["dp"]``."""
    tp = mesh["tp"].size()
    if tp > 1:
        model = parallel_llama(mesh["tp"], vocab=args.vocab, dim=args.dim, layers=args.layers)
    else:
        torch.manual_seed(0)
        model = LlamaModel(args.vocab, dim=args.dim, layers=args.layers)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def release_fake_masks() -> int:
    """Empty the embedding masks torch.compile's tracing left behind; returns how many.

    DTensor's row-parallel embedding stores its mask in the ``MaskPartial`` placement
    (a ``MaskBuffer``, reference-counted) and releases it when the partial output is
    reduced. Dynamo's trace materializes it with a FakeTensor and never releases it; the
    placement object is shared through DTensor's sharding caches, so eager's next
    embedding call then fails comparing its mask with the fake one (``torch.equal``).
    Found in torch 2.13, in this benchmark only (eager and dtcompile alone do not hit it)."""
    released = 0
    for obj in gc.get_objects():
        try:
            found = isinstance(obj, MaskBuffer) and isinstance(obj.data, FakeTensor)
        except ReferenceError:  # a weak proxy whose object is gone
            continue
        if found:
            obj.data, obj.refcount = None, 0
            released += 1
    return released


def fake_world_peaks(args) -> dict[str, int | None]:
    """Each mode's peak bytes in a step, measured in a process with a fake process group
    (see the module docstring); None where the mode does not run there."""
    command = [sys.executable, __file__, "--fake-world", "--dp", str(args.dp), "--tp", str(args.tp)]
    command += ["--modes", *args.modes, "--vocab", str(args.vocab), "--dim", str(args.dim)]
    command += ["--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("PEAKS ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the fake-world memory run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("PEAKS ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default: the rest)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--calls", type=int, default=int(os.environ.get("BENCH_CALLS", "20")))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--header", action="store_true", help="print the table's header first")
    parser.add_argument("--fake-world", action="store_true", help="only measure peak memory, on a fake process group")
    args = parser.parse_args()
    if args.fake_world:
        torch.set_num_threads(1)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.dp * (args.tp or 1))
    else:
        init_gloo()
    world = dist.get_world_size()
    args.tp = tp = args.tp or world // args.dp
    if args.dp * tp != world:
        raise SystemExit(f"--dp {args.dp} x --tp {tp} is not the {world} ranks started")
    mesh = init_device_mesh("cpu", (args.dp, tp), mesh_dim_names=("dp", "tp"))
    generator = torch.Generator().manual_seed(1000 * mesh["dp"].get_local_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def stepper(model, called):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            logits = called(inputs)
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        return step

    steps, first_call, failed, losses = {}, {}, {}, {}
    for mode in args.modes:
        if mode == "torch.compile" and tp > 1:
            failed[mode] = (
                "not run: in a process that also runs eager TP, its trace of the row-parallel embedding leaves "
                "a FakeTensor mask in DTensor's shared MaskPartial and eager's next call fails (torch 2.13)"
            )
            continue
        model = make_model(mesh, args)
        called = {"eager": model, "dtcompile": dtcompile.jit(model), "torch.compile": torch.compile(model)}[mode]
        step = stepper(model, called)
        sync()
        start = time.perf_counter()
        try:
            losses[mode] = step().item()
            first_call[mode] = time.perf_counter() - start
            step(), step()  # torch.compile compiles again at the second call
        except Exception as error:  # torch.compile may not run the model: say so
            failed[mode] = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
            continue
        steps[mode] = step
    if "torch.compile" in steps:
        release_fake_masks()  # not enough with TP: see above
    if args.fake_world:
        print(f"PEAKS {json.dumps({mode: memory.peak_bytes(step) for mode, step in steps.items()})}")
        return
    medians = interleaved_medians(steps, calls=args.calls, warmup=args.warmup)
    peaks = fake_world_peaks(args) if dist.get_rank() == 0 else {}
    sync()

    label = f"{args.dp}x{tp} dp x tp" if tp > 1 else f"{args.dp} dp"
    if args.header:
        print0(f"{'mesh':<12} {'mode':<14} {'ms/step':>9} {'eager/mode':>11} {'peak MiB':>9} {'1st step s':>11}")
    eager = medians.get("eager")
    for mode in args.modes:
        if mode in failed:
            print0(f"{label:<12} {mode:<14} failed: {failed[mode][:200]}")
            continue
        ratio = f"{eager / medians[mode]:>10.2f}x" if eager else f"{'-':>11}"
        peak = f"{peaks[mode] / 2**20:>9.2f}" if peaks.get(mode) is not None else f"{'-':>9}"
        print0(f"{label:<12} {mode:<14} {medians[mode] * 1e3:>9.1f} {ratio} {peak} {first_call[mode]:>11.1f}")
    if "eager" in losses:
        worst = max(abs(loss - losses["eager"]) / abs(losses["eager"]) for loss in losses.values())
        print0(f"{'':<12} first-step losses agree to {worst:.1e} (relative)")
    finish()


def launch_all() -> None:
    """Run this script under torchrun: 4 ranks as 2x2 dp x tp, then 2 ranks dp only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    extra = sys.argv[1:]
    for i, (ranks, dp, tp) in enumerate(((4, 2, 2), (2, 2, 1))):
        command = [torchrun, "--nproc-per-node", str(ranks), __file__, "--dp", str(dp), "--tp", str(tp), *extra]
        subprocess.run(command + (["--header"] if i == 0 else []), check=True, env=env)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ or "--fake-world" in sys.argv:
        main()
    else:
        launch_all()
