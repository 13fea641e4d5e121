"""Mixture-of-experts with expert parallelism (issue 14, item 1), compiled against eager on
Gloo ranks: token counts exchanged with all_to_all_single and read with ``.tolist()``,
tokens dispatched and combined with all_to_all_single (the autograd variant), experts
sharded over ``ep`` and attention tensor-parallel over ``tp``. Every batch routes
differently (uneven splits, experts that receive no token); one compilation serves them
all, under both cache options, forward and forward+backward."""

import pytest
import torch
import torch.distributed as dist
from checks import assert_same
from torch.distributed.device_mesh import init_device_mesh

import dtcompile
from dtcompile.testing.moe import parallel_moe_block

DIM = 32


def _routing_log(block, top_k: int, experts: int) -> list:
    """Records, at each call of the eager block, how many tokens each expert gets from
    this rank."""
    log = []

    def hook(module, args, logits):
        chosen = logits.softmax(-1).topk(top_k, dim=-1).indices
        log.append(torch.bincount(chosen.reshape(-1), minlength=experts).tolist())

    block.moe.router.register_forward_hook(hook)
    return log


def moe_against_eager(ep: int, top_k: int, cache: str, training: bool, experts: int = 4, steps: int = 3):
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ep, world // ep), mesh_dim_names=("ep", "tp"))
    eager = parallel_moe_block(mesh, dim=DIM, experts=experts, top_k=top_k)
    compiled = parallel_moe_block(mesh, dim=DIM, experts=experts, top_k=top_k)
    log = _routing_log(eager, top_k, experts)
    jitted = dtcompile.jit(compiled, cache=cache)
    generator = torch.Generator().manual_seed(10 + mesh["ep"].get_local_rank())  # tokens differ over ep
    for step in range(steps):
        x = torch.randn(2, 3 + step, DIM, generator=generator)  # and so does the length
        if not training:
            with torch.no_grad():
                assert_same(jitted(x), eager(x), f"step {step}")
            continue
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = eager(xe), jitted(xc)
        assert_same(got, expected, f"step {step}")
        cotangent = torch.randn(expected.shape, generator=generator)
        expected.backward(cotangent)
        got.backward(cotangent)
        assert_same(xc.grad, xe.grad, f"step {step}, input gradient")
        for (name, pe), (_, pc) in zip(eager.named_parameters(), compiled.named_parameters()):
            assert_same(pc.grad, pe.grad, f"step {step}, gradient of {name}")
            pe.grad = pc.grad = None
    return log, dtcompile.cache_misses(jitted)


def _check(results, compilations: int):
    logs = [log for log, _ in results]
    # The routing differs between steps and ranks, and some expert gets no token from some rank.
    assert any(0 in counts for log in logs for counts in log), logs
    assert len({tuple(c) for log in logs for c in log}) > 1, logs
    # One compilation for all routings: one per length under constant values.
    assert [n for _, n in results] == [compilations] * len(results)


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_on_2_ranks(ranks2, top_k, training):
    _check(ranks2.run(moe_against_eager, 2, top_k, "constant values", training), 3)
    _check(ranks2.run(moe_against_eager, 2, top_k, "symbolic values", training), 1)


@pytest.mark.parametrize("ep", [2, 4], ids=["ep2xtp2", "ep4"])
def test_moe_on_4_ranks(ranks4, ep):
    _check(ranks4.run(moe_against_eager, ep, 2, "symbolic values", True, 8), 1)


def moe_constant_values_compile_once_per_length(ep: int):
    """Under constant values, a new length is a new entry, but new routing is not."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ep, world // ep), mesh_dim_names=("ep", "tp"))
    eager, compiled = parallel_moe_block(mesh, dim=DIM), parallel_moe_block(mesh, dim=DIM)
    jitted = dtcompile.jit(compiled)
    generator = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 5, DIM, generator=generator)
            assert_same(jitted(x), eager(x))
    return dtcompile.cache_misses(jitted)


def test_moe_new_routing_is_not_a_new_compilation(ranks4):
    assert ranks4.run(moe_constant_values_compile_once_per_length, 2) == [1] * 4
