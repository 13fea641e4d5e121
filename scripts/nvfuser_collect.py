"""The models' fusion programs, compiled and checked against eager DTensor.

Two uses, one collection:

- ``scripts/nvfuser_check.sh`` runs it under torchrun on CPU ranks (Gloo) with
  ``DTCOMPILE_FUSION_RECORD`` naming a folder, and the fusion executor on its reference
  backend (which runs anywhere): every program the executor forms is recorded there, for
  nvFuser's frontend to build. The op-info table and the MLP and the Llama-style block
  over sequence lengths come from the test suite (``tests/test_nvfuser.py``,
  ``tests/distributed/test_nvfuser_ranks.py``).
- ``scripts/gpu_check.sh`` runs it on one GPU (a 1-rank NCCL mesh) with
  ``--device cuda --backend nvfuser_direct``: the same programs, now run by nvFuser.

Either way each call is compared with eager DTensor (values, placements, local shapes and
strides): the Llama-style block forward and forward+backward (input and parameter
gradients), and a tensor-parallel Hugging Face Llama's prefill and greedy decode steps
with a ``DynamicCache``, each under constant and symbolic sizes. Exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dtcompile
from dtcompile.executors.fusion import CACHE
from dtcompile.executors.fusion.executor import RECORD_ENV
from dtcompile.testing.compare import assert_same
from dtcompile.testing.models import parallel_block, parallel_hf_llama

CACHE_OPTIONS = ("constant values", "symbolic values")


class Checker:
    """Compares results with eager's and keeps the differences."""

    def __init__(self, tolerance: dict):
        self.tolerance, self.failures, self.checked = tolerance, [], 0

    def __call__(self, got, expected, where: str) -> None:
        self.checked += 1
        try:
            assert_same(got, expected, where, **self.tolerance)
        except AssertionError as error:
            self.failures.append(f"{where}: {' '.join(str(error).split())[:300]}")


def block(mesh, executors, device: str, check: Checker) -> None:
    for cache in CACHE_OPTIONS:
        eager = parallel_block(mesh, dim=64, n_heads=4, hidden=128)
        compiled = parallel_block(mesh, dim=64, n_heads=4, hidden=128)
        model = dtcompile.jit(compiled, cache=cache, executors=executors)
        for seq in (5, 8):
            where = f"block, {cache}, seq {seq}"
            x = torch.randn(2, seq, 64, device=device)
            with torch.no_grad():
                check(model(x), eager(x), f"{where}, forward")
            xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            model(xc).sum().backward()
            eager(xe).sum().backward()
            check(xc.grad, xe.grad, f"{where}, input gradient")
            for (name, pe), (_, pc) in zip(eager.named_parameters(), compiled.named_parameters()):
                check(pc.grad, pe.grad, f"{where}, gradient of {name}")
                pe.grad = pc.grad = None


def hf_llama_decode(mesh, executors, device: str, check: Checker) -> None:
    try:
        from transformers import DynamicCache
    except ImportError:  # the GPU machine may lack it (and no network to install it)
        print("HF Llama left out: transformers is not installed here")
        return

    for cache in CACHE_OPTIONS:
        eager, config = parallel_hf_llama(mesh, vocab=128, hidden=64, layers=2, heads=4, kv_heads=2)
        compiled, _ = parallel_hf_llama(mesh, vocab=128, hidden=64, layers=2, heads=4, kv_heads=2)
        jitted = dtcompile.jit(compiled, cache=cache, executors=executors)
        kv_eager, kv_compiled = DynamicCache(config=config), DynamicCache(config=config)
        inputs = torch.randint(0, 128, (1, 6), device=device)
        with torch.no_grad():
            for step in range(4):
                expected = eager(input_ids=inputs, past_key_values=kv_eager, use_cache=True)
                got = jitted(input_ids=inputs, past_key_values=kv_compiled, use_cache=True)
                check(got.logits, expected.logits, f"HF Llama, {cache}, step {step}, logits")
                inputs = expected.logits[:, -1].argmax(-1, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backend", default="reference", choices=("reference", "nvfuser_direct"))
    args = parser.parse_args()
    if args.device == "cpu" and not os.environ.get(RECORD_ENV):
        raise SystemExit(f"set {RECORD_ENV} to the folder the programs go to")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    executors = ["nvfuser" if args.backend == "nvfuser_direct" else "nvfuser:reference", "torch"]
    # nvFuser on a GPU reorders float sums; the reference backend runs eager's own ops.
    check = Checker({"atol": 1e-4, "rtol": 1e-4} if args.device == "cuda" else {})
    block(mesh, executors, args.device, check)
    hf_llama_decode(mesh, executors, args.device, check)
    rank = dist.get_rank()
    print(
        f"rank {rank}: {len(CACHE)} distinct fusions with the {args.backend} backend on {args.device}; "
        f"{check.checked} results against eager, {len(check.failures)} differ"
    )
    for line in check.failures[:40]:
        print(f"rank {rank}:   {line}")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if check.failures else 0)


if __name__ == "__main__":
    main()
