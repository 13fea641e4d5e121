"""Compile time by depth: repeated blocks called or replayed, against every block traced.

Run: python scripts/bench_compile_depth.py          (runs itself under torchrun on 2 ranks)
  or torchrun --nproc-per-node N scripts/bench_compile_depth.py [--layers 2 8 32]

The Llama-style model of ``dtcompile.testing.models`` (tensor-parallel blocks, hidden
128), one forward under no_grad (with ``--training``, a forward and its backward),
compiled at each depth three ways, interleaved depth by depth, under both cache options:
its repeated blocks one program called per block (the default: ``capture/block_calls.py``;
with gradients a forward and a backward program), their symbols recorded again
(``capture/blocks.py``), and every block traced. Before the first, a one-layer model is compiled and
not counted, under each cache option: it pays the process's first-compile costs
(DTensor's sharding caches, the fake mode's, the symbolic shapes'), which would otherwise
land on whichever variant runs first. Each cell is the fastest of ``--repeat`` compiles
(interleaved with the other variants'). Prints compile seconds (the first call's time
beyond a second call's: running a deep program is not compiling it), each depth's time
over the smallest depth's, and the program's symbol count.
Each compiled result is compared with eager's (bit for bit; gradients closely), and the
replayed and traced variants must record the same program (the symbol count is that
program's).
"""

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from timing import finish, init_gloo, print0, sync
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import dtcompile
from dtcompile.capture import block_calls, tracer
from dtcompile.testing.models import parallel_llama

# name: (blocks replayed, replayed blocks called)
VARIANTS = {"blocks called": (True, True), "blocks replayed": (True, False), "every block traced": (False, False)}


def compile_once(mesh, layers: int, variant: tuple[bool, bool], cache: str, training: bool) -> tuple[float, str]:
    """Seconds of one compilation (the first call's time beyond the second's), and the
    recorded program (without its replay notes). With ``training``, a call is a forward
    and its backward (both compiled at the first)."""
    model = parallel_llama(mesh, layers=layers, dim=128, hidden=256, n_heads=4)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    saved = tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS
    tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS = variant
    try:
        with torch.set_grad_enabled(training):
            jitted = dtcompile.jit(model, cache=cache)
            sync()
            start = time.perf_counter()
            out = _step(jitted, tokens, training)
            first = time.perf_counter() - start
            grads = [p.grad for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            sync()
            start = time.perf_counter()
            _step(jitted, tokens, training)  # a call of the compiled program: what the first one did besides compiling
            seconds = first - (time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
            expected = _step(model, tokens, training)
    finally:
        tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS = saved
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want)  # (a block's gradient sums may take another order)
    program = "\n".join(line for line in str(dtcompile.last_traces(jitted)[0]).splitlines() if "replayed" not in line)
    return seconds, program


def _step(forward, tokens, training: bool):
    out = forward(tokens)
    out = out.to_local() if isinstance(out, DTensor) else out
    if training:
        out.float().pow(2).mean().backward()
    return out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--cache", nargs="+", default=["constant values", "symbolic values"])
    parser.add_argument("--repeat", type=int, default=3, help="compilations per cell; the fastest counts")
    parser.add_argument("--training", action="store_true", help="compile a forward and its backward")
    args = parser.parse_args()
    init_gloo()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for cache in args.cache:
        first, _ = compile_once(mesh, 1, VARIANTS["blocks called"], cache, args.training)
        print0(f"first compile in this process with {cache} (one layer, not counted below): {first:.2f} s")
    for cache in args.cache:
        seconds = {name: {} for name in VARIANTS}
        symbols = {}
        for layers in args.layers:
            programs = {}
            for name in VARIANTS:
                seconds[name][layers] = float("inf")
            for _ in range(args.repeat):  # interleaved: these machines are noisy
                for name, variant in VARIANTS.items():
                    elapsed, programs[name] = compile_once(mesh, layers, variant, cache, args.training)
                    seconds[name][layers] = min(seconds[name][layers], elapsed)
            if programs["blocks replayed"] != programs["every block traced"]:
                raise SystemExit(f"{layers} layers, {cache}: replayed blocks recorded another program")
            symbols[layers] = sum(1 for line in programs["every block traced"].splitlines() if " = " in line)
        smallest = args.layers[0]
        what = "a forward and its backward" if args.training else "a forward without gradients"
        print0(
            f"\ncache={cache!r}, {dist.get_world_size()} ranks, {what}: compile seconds (x the {smallest}-layer time)"
        )
        print0(f"  {'layers':>6} {'symbols':>8}" + "".join(f" {name:>24}" for name in VARIANTS))
        for layers in args.layers:
            cells = "".join(
                f" {seconds[name][layers]:>14.2f} ({seconds[name][layers] / seconds[name][smallest]:>5.1f}x)"
                for name in VARIANTS
            )
            print0(f"  {layers:>6} {symbols[layers]:>8}{cells}")
    finish()


def launch() -> None:
    """Run this script under torchrun on 2 ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node", "2", __file__, *sys.argv[1:]]
    subprocess.run(command, check=True, env=env)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        main()
    else:
        launch()
