"""Fusion programs of the models, for ``scripts/nvfuser_check.sh`` to build with nvFuser.

Run under torchrun on CPU ranks (Gloo) with ``DTCOMPILE_FUSION_RECORD`` naming a folder:
every fusion program the executor forms (on its reference backend, which runs anywhere)
is recorded there. The op-info table and the MLP and Llama-style block over sequence
lengths come from the test suite (``tests/test_nvfuser.py``,
``tests/distributed/test_nvfuser_ranks.py``); this adds what the tests do not run with
fusion: the Llama-style block forward and forward+backward, and a tensor-parallel Hugging
Face Llama's prefill and greedy decode steps with a ``DynamicCache``, each under constant
and symbolic sizes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dtcompile
from dtcompile.executors.fusion import CACHE
from dtcompile.executors.fusion.executor import RECORD_ENV
from dtcompile.testing.models import parallel_block, parallel_hf_llama

EXECUTORS = ["nvfuser:reference", "torch"]
CACHE_OPTIONS = ("constant values", "symbolic values")


def block(mesh) -> None:
    for cache in CACHE_OPTIONS:
        model = dtcompile.jit(parallel_block(mesh, dim=64, n_heads=4, hidden=128), cache=cache, executors=EXECUTORS)
        for seq in (5, 8):
            x = torch.randn(2, seq, 64)
            with torch.no_grad():
                model(x)
            model(x.requires_grad_()).sum().backward()


def hf_llama_decode(mesh) -> None:
    from transformers import DynamicCache

    for cache in CACHE_OPTIONS:
        model, config = parallel_hf_llama(mesh, vocab=128, hidden=64, layers=2, heads=4, kv_heads=2)
        jitted = dtcompile.jit(model, cache=cache, executors=EXECUTORS)
        kv, inputs = DynamicCache(config=config), torch.randint(0, 128, (1, 6))
        with torch.no_grad():
            for _ in range(4):
                out = jitted(input_ids=inputs, past_key_values=kv, use_cache=True)
                inputs = out.logits[:, -1].argmax(-1, keepdim=True)


def main() -> None:
    if not os.environ.get(RECORD_ENV):
        raise SystemExit(f"set {RECORD_ENV} to the folder the programs go to")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    block(mesh)
    hf_llama_decode(mesh)
    print(f"rank {dist.get_rank()}: {len(CACHE)} distinct fusions compiled")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
