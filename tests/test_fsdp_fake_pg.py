"""FSDP2 with TP on 8x8 and 32x32 meshes, in one process with a fake process group: the per-rank
training program is made, and its gradients are sharded as FSDP2 shards the parameters
(values are garbage with the fake process group; only what was recorded is checked).
Each case runs in a process of its own: torch 2.10's DeviceMesh resolves groups by names
that an earlier fake world in the same process has used ("Could not resolve the process
group registered under the name 9")."""

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtcompile
from dtcompile.testing.models import parallel_llama


@pytest.mark.parametrize("dp, tp", [(8, 8), (32, 32)])
def test_fsdp_with_tp_on_fake_ranks(dp, tp):
    done = subprocess.run([sys.executable, __file__, str(dp), str(tp)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    print(done.stdout)


def fsdp_with_tp_on_fake_ranks(dp, tp):
    dist.init_process_group("fake", store=FakeStore(), rank=dp + 1, world_size=dp * tp)
    try:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = parallel_llama(mesh["tp"], vocab=512, dim=128, layers=2, n_heads=tp, hidden=256)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        jitted = dtcompile.jit(model)
        start = time.perf_counter()
        jitted(torch.randint(0, 512, (2, 16))).float().pow(2).mean().backward()
        print(f"{dp}x{tp}: compiled and ran one training step in {time.perf_counter() - start:.2f} s")
        for name, param in model.named_parameters():
            assert type(param.grad) is DTensor, name
            assert param.grad.placements == param.placements, (name, param.grad.placements, param.placements)
            assert param.grad._local_tensor.shape == param._local_tensor.shape, name
        over_dp = [c for c in dtcompile.collectives(jitted) if c.mesh_dim == "dp"]
        gathers = [c.program for c in over_dp if c.kind.startswith("all_gather")]
        scatters = [c.program for c in over_dp if c.kind == "reduce_scatter_tensor"]
        # Each bucket (a group's evenly sharded parameters; an uneven one alone, as at 32x32
        # where shards do not divide) is all-gathered in the forward and its gradient
        # reduce-scattered once in the backward; the blocks' are gathered again in the
        # backward (resharded after forward; the root is not). At 8x8 every parameter of a
        # group shares its bucket: one per group (the two blocks and the root).
        forward = gathers.count("forward")
        assert scatters == ["backward"] * forward, scatters
        assert 3 <= forward and 2 <= gathers.count("backward") < forward
        if dp == 8:
            assert (forward, gathers.count("backward")) == (3, 2)
        assert dtcompile.cache_misses(jitted) == 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    fsdp_with_tp_on_fake_ranks(int(sys.argv[1]), int(sys.argv[2]))
