"""Tensor-parallel modules compiled and compared with eager DTensor on Gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial

import dtcompile
from dtcompile.testing.models import parallel_block, parallel_mlp


def _compare(jitted, eager_module, x):
    with torch.no_grad():
        expected = eager_module(x)
        got = jitted(x)
        again = jitted(x)
    # Eager may return an AsyncCollectiveTensor (a lazily waited plain tensor); we return
    # the plain tensor itself.
    assert isinstance(got, DTensor) == isinstance(expected, DTensor)
    if isinstance(expected, DTensor):
        assert got.placements == expected.placements
        assert got.shape == expected.shape and got.stride() == expected.stride()
        got_local, expected_local = got._local_tensor, expected._local_tensor
    else:
        assert type(got) is torch.Tensor
        got_local, expected_local = got, expected
    assert got_local.shape == expected_local.shape
    assert got_local.stride() == expected_local.stride()
    torch.testing.assert_close(got_local, expected_local)
    torch.testing.assert_close(again if not isinstance(again, DTensor) else again._local_tensor, expected_local)
    return dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)


def mlp_case(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape) :])
    tp = mesh["tp"] if len(mesh_shape) == 2 else mesh
    model = parallel_mlp(tp, dim=32, hidden=64)
    torch.manual_seed(100 + dist.get_rank() // tp.size())  # dp ranks see different data
    x = torch.randn(4, 8, 32)
    return _compare(dtcompile.jit(model), model, x)


def block_case(mesh_shape, sequence_parallel):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape) :])
    tp = mesh["tp"] if len(mesh_shape) == 2 else mesh
    model = parallel_block(tp, dim=32, n_heads=4, hidden=64, sequence_parallel=sequence_parallel)
    torch.manual_seed(100 + dist.get_rank() // tp.size())
    seq = 8
    x = torch.randn(2, seq, 32)
    if sequence_parallel:  # each rank passes its sequence shard
        x = x.chunk(tp.size(), dim=1)[tp.get_local_rank()].contiguous()
    return _compare(dtcompile.jit(model), model, x)


@pytest.mark.parametrize("world", [2, 4])
def test_mlp_1d(world, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    assert pool.run(mlp_case, (world,)) == [(1, 1)] * world


def test_mlp_2d(ranks4):
    assert ranks4.run(mlp_case, (2, 2)) == [(1, 1)] * 4


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_llama_block(mesh_shape, sequence_parallel, ranks2, ranks4):
    pool = ranks2 if mesh_shape == (2,) else ranks4
    world = 2 if mesh_shape == (2,) else 4
    assert pool.run(block_case, mesh_shape, sequence_parallel) == [(1, 1)] * world


def summed_all_reduces_case(combine: bool):
    """Two all-reduced values summed, one of them also returned: with the combination asked
    for (``all_reduce_sums.ENABLED``), the sum may be reduced once, but the returned value
    must still be its own all-reduce; by default each is reduced as eager reduces it."""
    import torch.distributed._functional_collectives as funcol

    from dtcompile.transforms import all_reduce_sums

    all_reduce_sums.ENABLED = combine

    group = dist.group.WORLD

    def fn(x, y):
        a = funcol.all_reduce(x, "sum", group)
        b = funcol.all_reduce(y, "sum", group)
        return a + b, a, funcol.all_reduce(x * 2, "sum", group) + funcol.all_reduce(y * 3, "sum", group)

    rank = dist.get_rank()
    x, y = torch.arange(4.0) + rank, torch.ones(4) * (rank + 1)
    jitted = dtcompile.jit(fn)
    with torch.no_grad():
        got, expected = jitted(x, y), fn(x, y)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    collectives = [b for b in dtcompile.last_traces(jitted)[-1].bound_symbols if b.symbol.name.startswith("all_reduce")]
    all_reduce_sums.ENABLED = False
    if not combine:
        for g, e in zip(got, expected):
            assert torch.equal(g, e)  # (eager's sums, bit for bit)
    return len(collectives)


def test_summed_all_reduces_combine_only_where_nothing_else_reads_them(ranks2):
    # a and b stay (a is returned), the last two are summed into one: three in all.
    assert ranks2.run(summed_all_reduces_case, True) == [3, 3]
    assert ranks2.run(summed_all_reduces_case, False) == [4, 4]


def cancelling_partial_sums(cache: str):
    """Two Partial DTensors reduced and added: eager reduces each, then adds; one
    all-reduce of their sum rounds otherwise, and where they cancel gives another value."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    a = DTensor.from_local(torch.tensor([1e8 if rank == 0 else -1e8]), mesh, [Partial()])
    b = DTensor.from_local(torch.tensor([1.0 if rank == 0 else 0.0]), mesh, [Partial()])

    def fn(a, b):
        return a.full_tensor() + b.full_tensor()

    with torch.no_grad():
        return dtcompile.jit(fn, cache=cache)(a, b).item(), fn(a, b).item()


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_summed_partial_values_are_reduced_as_eager_reduces_them(ranks2, cache):
    assert ranks2.run(cancelling_partial_sums, cache) == [(1.0, 1.0)] * 2


def exchange_case():
    """An all_reduce of two Gloo ranks runs as an all_gather and one add: the same numbers
    as eager's ring all_reduce, bit for bit; with more ranks the all_reduce stays."""
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parallel_mlp(mesh, dim=32, hidden=64)
    torch.manual_seed(1)
    x = torch.randn(4, 8, 32)
    jitted = dtcompile.jit(model)
    with torch.no_grad():
        expected = model(x)
        jitted(x)
        with CommDebugMode() as comms:
            got = jitted(x)
    execution = dtcompile.last_traces(jitted)[-1]
    ops = {str(op).rsplit(".", 1)[-1]: n for op, n in comms.get_comm_counts().items() if n}
    return torch.equal(_plain(got), _plain(expected)), "allgather_into(" in str(execution), ops, _pair(execution)


def _pair(execution) -> str:
    """The all_reduce's start and wait in the execution trace: what the start outputs, what
    the wait reads, and what ``verify`` says once the start is gone (the all_reduce's
    output named ``t``)."""
    from dtcompile.core import FutureProxy, TraceError, verify

    symbols = execution.bound_symbols
    index = next(i for i, b in enumerate(symbols) if b.op is torch.ops._c10d_functional.all_reduce.default)
    source, (tensor, work) = symbols[index].args[0], symbols[index].output
    waits = [b for b in symbols if any(p is work for p in b.input_proxies())]
    assert isinstance(work, FutureProxy) and [w.args for w in waits] == [(work, tensor)]
    try:
        verify(execution.derive("no start", symbols[:index] + symbols[index + 1 :]))
        broken = "verify passed"
    except TraceError as error:
        broken = str(error)
    kind = "both" if tuple(tensor.shape) == (2, *source.shape) else "tensor"
    name = work.label.removesuffix("_work")  # the all_reduce's output, ``t`` below
    return f"{kind} {tensor.label} {work.label}; {broken.split(') ')[-1]}".replace(name, "t")


def _plain(value):
    """The local tensor, waited for (eager returns an AsyncCollectiveTensor)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    value = value._local_tensor if isinstance(value, DTensor) else value
    return value.wait() if isinstance(value, AsyncCollectiveTensor) else value


def test_two_gloo_ranks_all_reduce_as_an_exchange(ranks2, ranks4):
    # The start outputs the (2, ...) buffer both tensors are gathered into and its work
    # handle; the wait reads both, so without the start the trace fails ``verify``.
    pair = "both t_both t_work; uses t_work before it is defined"
    assert ranks2.run(exchange_case) == [(True, True, {"_allgather_base_": 1}, pair)] * 2
    equal, exchanged, ops, pair = ranks4.run(exchange_case)[0]
    assert equal and not exchanged and ops == {"allreduce_": 1}
    assert pair == "tensor t t_work; uses t_work before it is defined"
