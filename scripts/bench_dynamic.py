"""Compilations and compile time over changing sequence lengths: dtcompile vs torch.compile.

Run: python scripts/bench_dynamic.py               (runs itself under torchrun on 2 ranks)
  or torchrun --nproc-per-node N scripts/bench_dynamic.py [--models mlp,block] [--lengths 16:49]

For the tensor-parallel MLP and Llama-style block (batch 4, hidden 256), forward under
no_grad, each variant is called once at every sequence length in turn, as a serving loop
would: dtcompile with cache="constant values" and "symbolic values", torch.compile with
its default (static, then dynamic after the first recompilation) and dynamic=True. It
prints how many times each compiled, the seconds those compilations took, and the
steady time per call (medians at one length, variants interleaved call by call).
torch.compile's once-per-process start-up is paid before, on a small function, and
Inductor's on-disk caches are off.
Targets: symbolic values' steady time at most 1.15x constant values'; its total compile
time at least 10x lower than torch.compile's default.
"""

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from timing import completed, finish, init_gloo, interleaved_medians, print0, sync
from torch.distributed.device_mesh import init_device_mesh

import dtcompile
from dtcompile.testing.models import parallel_block, parallel_mlp

MODELS = {
    "mlp": lambda mesh: parallel_mlp(mesh, dim=256, hidden=1024),
    "block": lambda mesh: parallel_block(mesh, dim=256, n_heads=8, hidden=512),
}


def _graphs_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class Variant:
    """One way of running the model: how to make it, how to count its compilations."""

    def __init__(self, name, make):
        self.name, self.make = name, make
        self.fn = None
        self.compilations, self.compile_seconds = 0, 0.0

    def sweep(self, model, lengths, batch, dim):
        """Call once per length; count compilations and the time they took."""
        self.fn = self.make(model)
        for length in lengths:
            x = torch.randn(batch, length, dim)
            before = self._count()
            sync()
            start = time.perf_counter()
            completed(self.fn(x))
            elapsed = time.perf_counter() - start
            if self._count() > before:
                self.compilations += self._count() - before
                self.compile_seconds += elapsed

    def _count(self) -> int:
        if isinstance(self.fn, torch.nn.Module) and hasattr(self.fn, "_dtcompile"):
            return dtcompile.cache_misses(self.fn)
        return _graphs_compiled()


def bench(name, make_model, lengths, batch, dim, calls):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    variants = [
        Variant("dtcompile, constant values", lambda m: dtcompile.jit(m)),
        Variant("dtcompile, symbolic values", lambda m: dtcompile.jit(m, cache="symbolic values")),
        Variant("torch.compile, default", lambda m: torch.compile(m)),
        Variant("torch.compile, dynamic=True", lambda m: torch.compile(m, dynamic=True)),
    ]
    models = []
    with torch.no_grad():
        for variant in variants:
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = make_model(mesh)
            models.append(model)
            variant.sweep(model, lengths, batch, dim)
        steady_length = lengths[len(lengths) // 2]
        x = torch.randn(batch, steady_length, dim)
        eager = completed(models[0](x))
        for variant in variants:
            torch.testing.assert_close(completed(variant.fn(x)), eager, rtol=1e-4, atol=1e-4)
        medians = interleaved_medians({v.name: (lambda v=v: v.fn(x)) for v in variants}, calls=calls)
    print0(
        f"\n{name}: sequence lengths {lengths[0]}..{lengths[-1]}, batch {batch}, hidden {dim}, "
        f"{dist.get_world_size()} ranks; steady time at length {steady_length}"
    )
    print0(f"  {'variant':<30} {'compilations':>12} {'compile s':>10} {'steady ms':>10}")
    for variant in variants:
        print0(
            f"  {variant.name:<30} {variant.compilations:>12} {variant.compile_seconds:>10.2f} "
            f"{medians[variant.name] * 1e3:>10.3f}"
        )
    symbolic, constant, default = variants[1], variants[0], variants[2]
    print0(
        f"  symbolic / constant steady time: {medians[symbolic.name] / medians[constant.name]:.2f}x; "
        f"torch.compile default / symbolic compile seconds: "
        f"{default.compile_seconds / max(symbolic.compile_seconds, 1e-9):.1f}x"
    )


def warm_up_torch_compile() -> float:
    """Pay torch.compile's once-per-process start-up (imports, Inductor's workers) on a
    small function, so that neither of its variants is charged for it; its seconds."""
    start = time.perf_counter()
    compiled = torch.compile(lambda t: torch.nn.functional.gelu(t) * 2)
    compiled(torch.randn(8))
    torch._dynamo.reset()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,block")
    parser.add_argument("--lengths", default="16:49", help="start:stop of the sequence lengths")
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    init_gloo()
    print0(
        f"torch.compile's start-up in this process (a one-op function, not counted below): "
        f"{warm_up_torch_compile():.1f} s"
    )
    start, stop = (int(v) for v in args.lengths.split(":"))
    for name in args.models.split(","):
        bench(name, MODELS[name], list(range(start, stop)), batch=4, dim=256, calls=args.calls)
    finish()


def launch() -> None:
    """Run this script under torchrun on 2 ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Inductor's on-disk caches would let one run reuse another's kernels: every
    # compilation here is a cold one.
    env.update({"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"})
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node", "2", __file__, *sys.argv[1:]]
    subprocess.run(command, check=True, env=env)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        main()
    else:
        launch()
