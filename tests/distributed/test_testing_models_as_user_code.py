"""The models of ``dtcompile.testing`` (what the tests, the scripts and a user's first trial
run) are traced as the user's code is, in every place that asks whose code runs a torch
call (``core/code_origin.py``). A sequence-parallel block of theirs closed over by a jitted
function got no gradients for its norms' weights: the closed-over DTensor parameter was
taken for dtcompile's own and the call was compiled without autograd."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import dtcompile
from dtcompile.testing.models import parallel_block

CACHES = ["constant values", "symbolic values"]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def closed_over_block_grads(cache: str, sequence_parallel: bool):
    """Per length: (whether the outputs are eager's, the parameters whose gradients are not)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    eager, compiled = (
        parallel_block(mesh, dim=16, n_heads=2, hidden=32, sequence_parallel=sequence_parallel) for _ in range(2)
    )
    jitted = dtcompile.jit(lambda x: compiled(x), cache=cache)
    results = []
    for length in (4, 6):
        torch.manual_seed(length)
        x = torch.randn(2, length * mesh.size(), 16)
        if sequence_parallel:  # each rank passes its sequence shard
            x = x.chunk(mesh.size(), dim=1)[mesh.get_local_rank()].contiguous()
        got, expected = jitted(x), eager(x)
        _full(got).square().sum().backward()
        _full(expected).square().sum().backward()
        same_out = torch.equal(_full(got), _full(expected))
        differ = []
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            if p.grad is None or not torch.allclose(_full(p.grad), _full(q.grad), rtol=1e-5, atol=1e-6):
                differ.append(name)
        results.append((same_out, differ))
    return results


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tensor parallel", "sequence parallel"])
@pytest.mark.parametrize("cache", CACHES)
def test_a_closed_over_testing_block_gets_eagers_gradients(ranks2, cache, sequence_parallel):
    for per_length in ranks2.run(closed_over_block_grads, cache, sequence_parallel):
        assert per_length == [(True, [])] * 2
