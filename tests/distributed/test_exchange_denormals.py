"""On two Gloo ranks a sum or product all_reduce runs as an exchange: each rank gathers
both tensors and combines them itself (executors/collectives.py). Gloo combines in its own
threads, which keep denormals where the caller's thread flushes them
(``torch.set_flush_denormal(True)``); the exchange flushed them to zero, so a tensor-parallel
layer's reduced values lost their smallest bits with no error."""

import torch
import torch.distributed as dist
from checks import assert_same
from torch.distributed.tensor import DTensor, Partial, Replicate, init_device_mesh

import dtcompile


def _reduced(x, op):
    y = x.clone()  # (a product would flush the denormals here)
    dist.all_reduce(y, op=op)
    return y


def _partial_replicated(local, mesh):
    partial = DTensor.from_local(local.clone(), mesh, [Partial()], run_check=False)
    return partial.redistribute(mesh, [Replicate()]).to_local()


def _bits(t):
    return t.view(torch.int32)


def denormals_kept_as_gloo_keeps_them():
    mesh = init_device_mesh("cpu", (2,))
    tiny = [torch.tensor([1e-39, 3e-39, 1.0, -2e-39]) * (c + 1) for c in range(3)]  # (made before flushing)
    summed = dtcompile.jit(_reduced)
    replicated = dtcompile.jit(_partial_replicated)
    assert torch.set_flush_denormal(True)
    try:
        for call, x in enumerate(tiny):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT):
                assert_same(_bits(summed(x, op)), _bits(_reduced(x, op)), f"call {call}, {op}")
            assert_same(_bits(replicated(x, mesh)), _bits(_partial_replicated(x, mesh)), f"call {call}, DTensor")
        assert torch.equal(torch.tensor([1e-39]) * 1, torch.zeros(1))  # (the caller's flushing, left on)
    finally:
        torch.set_flush_denormal(False)
    return True


def test_an_exchange_keeps_denormals_the_caller_flushes(ranks2):
    assert ranks2.run(denormals_kept_as_gloo_keeps_them) == [True, True]
