"""dtcompile on a tensor-parallel MLP: the per-rank program, a check against eager, timings.

Run: torchrun --nproc-per-node 2 scripts/demo.py      (CPU ranks, Gloo)
"""

import torch
import torch.distributed as dist
from timing import finish, init_gloo, interleaved_medians, print0
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtcompile
from dtcompile.testing.models import MLP


def main() -> None:
    init_gloo()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    # Column-parallel up projection, row-parallel down projection whose partial sums
    # are reduce-scattered over the batch: the output is a DTensor sharded on dim 0.
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Shard(0), use_local_output=False)}
    model = parallelize_module(MLP(dim=256, hidden=1024), mesh, plan)
    jmodel = dtcompile.jit(model)
    x = torch.randn(8, 32, 256)

    with torch.no_grad():
        expected = model(x)
        y = jmodel(x)

    print0(dtcompile.last_traces(jmodel)[-1])
    assert isinstance(y, DTensor) and y.placements == expected.placements
    assert y.shape == expected.shape and y._local_tensor.stride() == expected._local_tensor.stride()
    torch.testing.assert_close(y.full_tensor(), expected.full_tensor())
    print0(
        f"output: DTensor{tuple(y.shape)} {y.placements}, local {tuple(y._local_tensor.shape)} "
        f"stride {y._local_tensor.stride()}: equal to eager DTensor's"
    )

    with torch.no_grad():
        medians = interleaved_medians({"eager DTensor": lambda: model(x), "dtcompile": lambda: jmodel(x)}, calls=50)
    eager, compiled = medians["eager DTensor"], medians["dtcompile"]
    print0(
        f"per call on {world} ranks: eager DTensor {eager * 1e3:.3f} ms, dtcompile {compiled * 1e3:.3f} ms "
        f"({eager / compiled:.2f}x faster); compiled in {dtcompile.compile_seconds(jmodel)[0] * 1e3:.0f} ms, "
        f"{dtcompile.cache_misses(jmodel)} compilation, {dtcompile.cache_hits(jmodel)} cache hits"
    )
    finish()


if __name__ == "__main__":
    main()
