"""FSDP2 with TP on an 8x8 mesh, in one process with a fake process group: the per-rank
training program is made, and its gradients are sharded as FSDP2 shards the parameters
(values are garbage with the fake process group; only what was recorded is checked)."""

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtcompile
from dtcompile.testing.models import parallel_llama


def test_fsdp_with_tp_on_8x8_fake_ranks():
    dist.init_process_group("fake", store=FakeStore(), rank=9, world_size=64)
    try:
        mesh = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
        model = parallel_llama(mesh["tp"], vocab=512, dim=128, layers=2, n_heads=8, hidden=256)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        jitted = dtcompile.jit(model)
        start = time.perf_counter()
        jitted(torch.randint(0, 512, (2, 16))).float().pow(2).mean().backward()
        print(f"8x8: compiled and ran one training step in {time.perf_counter() - start:.2f} s")
        for name, param in model.named_parameters():
            assert type(param.grad) is DTensor, name
            assert param.grad.placements == param.placements, (name, param.grad.placements, param.placements)
            assert param.grad._local_tensor.shape == param._local_tensor.shape, name
        programs = "\n".join(str(t) for t in dtcompile.last_traces(jitted) if t.title.startswith("execution"))
        forward, backward = programs.split("def backward")
        parameters = len(list(model.parameters()))
        # Every parameter is all-gathered over dp in the forward (a _StridedShard one in
        # more than one step), the blocks' again in the backward; each gradient is
        # reduce-scattered over dp once.
        assert forward.count("all_gather_single(") >= parameters
        assert backward.count("all_gather_single(") >= 2 * 9
        assert backward.count("reduce_scatter_tensor.default(") == parameters
        assert dtcompile.cache_misses(jitted) == 1
    finally:
        dist.destroy_process_group()
