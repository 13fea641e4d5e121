"""Errors on Gloo ranks: inputs a rank cannot take, ranks that compile different programs
(an error on every rank concerned, never a hang), and what must not be an error (uneven
shards, where ranks legitimately differ in local sizes and padding)."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import dtcompile

# A hang (a rank stuck in a collective or a store wait) fails the test instead of stalling it.
TIMEOUT = 60


def _outcome(fn, *args):
    """``("ok", result)`` or ``(error type name, message)``: errors come back as values so
    that every rank's outcome can be checked."""
    try:
        with torch.no_grad():
            return "ok", fn(*args)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return type(error).__name__, str(error)


def dtensor_outside_its_mesh():
    # Every rank takes part in making the mesh (it makes a process group); only ranks 0
    # and 1 belong to it. Elsewhere from_local must not check anything with the group.
    mesh = DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    x = DTensor.from_local(torch.randn(4, 3), mesh, [Replicate()], run_check=False)

    def scale(factor, inputs):
        return inputs["x"] * factor

    kind, value = _outcome(dtcompile.jit(scale), 2.0, {"x": x})
    if kind == "ok":
        with torch.no_grad():
            expected = scale(2.0, {"x": x})
        assert value.placements == expected.placements
        torch.testing.assert_close(value.to_local(), expected.to_local())
        return kind, None
    return kind, value


def test_dtensor_on_a_mesh_without_this_rank(ranks4):
    results = ranks4.run(dtensor_outside_its_mesh, timeout=TIMEOUT)
    assert results[:2] == [("ok", None)] * 2
    for rank in (2, 3):
        kind, message = results[rank]
        assert kind == "UnsupportedInputError"
        assert "args[1]['x']" in message and f"rank {rank}" in message


def different_local_ops():
    """Local ops that differ between ranks cannot hang: they run as in eager."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Replicate()])

    def fn(x):
        if dist.get_rank() == 0:
            x = x.sum(0, keepdim=True).expand_as(x)
        return x * (1.0 + dist.get_rank())  # a rank-dependent Python float, too

    kind, got = _outcome(dtcompile.jit(fn), x)
    assert kind == "ok", got
    with torch.no_grad():
        expected = fn(x)
    assert got.placements == expected.placements
    torch.testing.assert_close(got.to_local(), expected.to_local())
    return got.to_local()[0, 0].item()


def test_ranks_with_different_local_ops_run_as_in_eager(ranks4):
    firsts = ranks4.run(different_local_ops, timeout=TIMEOUT)
    assert firsts == [24.0, 0.0, 0.0, 0.0]  # rank 0's sum times 1, the others' x[0, 0] times rank + 1


def different_collectives():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])

    def fn(x):
        if dist.get_rank() == 1:  # eager would hang in this all-gather
            x = x.redistribute(mesh, [Replicate()])
        return x + 1

    return _outcome(dtcompile.jit(fn), x)


def test_ranks_with_different_collectives(ranks2):
    results = ranks2.run(different_collectives, timeout=TIMEOUT)
    for kind, message in results:
        assert kind == "RankMismatchError", message
        assert "ranks [0]; ranks [1]" in message
        assert "_c10d_functional.all_gather_into_tensor" in message


def equal_meshes():
    """DTensor caches sharding decisions by spec, and specs compare meshes by layout: on a
    second 2x2 mesh, a matmul of a Partial input runs its all_reduce on the groups of the
    first mesh, in eager and in the compiled program. Each rank's group of that mesh dim
    has a name of its own (rank 0's is not rank 1's): not a mismatch."""

    def fn(x, w):
        return torch.matmul(x, w)

    outcomes = []
    for _ in range(2):
        mesh = init_device_mesh("cpu", (2, 2))
        row = mesh.get_coordinate()[0]
        torch.manual_seed(dist.get_rank())
        x = DTensor.from_local(torch.randn(1, 4, 6), mesh, [Partial(), Shard(0)], run_check=False)
        torch.manual_seed(row)  # Replicate on mesh dim 1: the same on the ranks of a row
        w = DTensor.from_local(torch.randn(6, 8), mesh, [Partial(), Replicate()], run_check=False)
        kind, got = _outcome(dtcompile.jit(fn), x, w)
        if kind == "ok":
            with torch.no_grad():
                expected = fn(x, w)
            assert got.placements == expected.placements
            torch.testing.assert_close(got.full_tensor(), expected.full_tensor())
        outcomes.append(kind if kind == "ok" else got)
    return outcomes


def test_collectives_on_an_equal_earlier_meshs_groups_are_not_a_mismatch(ranks4):
    assert ranks4.run(equal_meshes, timeout=TIMEOUT) == [["ok", "ok"]] * 4


def uneven_shards():
    """Local sizes differ between ranks, and DTensor pads and narrows on some ranks only."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    cases = [
        (torch.randn(5, 4), Shard(0), lambda x: (x * 2).redistribute(mesh, [Replicate()]) + 1),
        (torch.randn(4, 5), Shard(1), lambda x: torch.softmax(x, dim=1)),
        (torch.randn(5, 6), Shard(0), lambda x: x.redistribute(mesh, [Shard(1)]).sum(0)),
        (torch.randn(7, 3), Shard(0), lambda x: x.sum(0).redistribute(mesh, [Replicate()])),
    ]
    local_rows = []
    for full, placement, fn in cases:
        x = distribute_tensor(full, mesh, [placement])
        local_rows.append(x.to_local().shape[placement.dim])
        kind, got = _outcome(dtcompile.jit(fn), x)
        assert kind == "ok", got
        with torch.no_grad():
            expected = fn(x)
        assert got.placements == expected.placements
        assert got.to_local().shape == expected.to_local().shape
        torch.testing.assert_close(got.full_tensor(), expected.full_tensor())
    return local_rows


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_shards_are_not_a_mismatch(world, ranks2, ranks4):
    local_rows = (ranks2 if world == 2 else ranks4).run(uneven_shards, timeout=TIMEOUT)
    assert len({tuple(rows) for rows in local_rows}) > 1  # the ranks' local shapes do differ


def plain_tensors_beside_dtensors():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(torch.randn(3, 4), mesh, [Shard(0)])

    def fn(t, x):
        return t * 2 + x

    scalar = _outcome(dtcompile.jit(fn), torch.tensor(3.0), x)
    with torch.no_grad():
        expected = fn(torch.tensor(3.0), x)
    assert scalar[0] == "ok", scalar
    assert scalar[1].placements == expected.placements
    torch.testing.assert_close(scalar[1].to_local(), expected.to_local())
    # A non-scalar tensor beside a DTensor: eager's own error, not a crash of ours.
    eager_error = _outcome(fn, torch.ones(4), x)
    jit_error = _outcome(dtcompile.jit(fn), torch.ones(4), x)
    assert eager_error[0] != "ok" and jit_error == eager_error
    return True


def test_plain_tensors_beside_dtensors_behave_as_in_eager(ranks2):
    assert ranks2.run(plain_tensors_beside_dtensors, timeout=TIMEOUT) == [True, True]


def collectives_of_dtensors_made_inside():
    """No DTensor among the inputs: the function makes its own, so only the collectives
    in the trace say which ranks must agree."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def fn(x):
        d = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
        if dist.get_rank() == 0:
            return d.redistribute(mesh, [Replicate()]).to_local()  # an all-gather
        return d.sum(0).redistribute(mesh, [Replicate()]).to_local()  # an all-reduce

    return _outcome(dtcompile.jit(fn), torch.ones(2, 3))


def test_ranks_with_different_collectives_on_dtensors_made_inside(ranks2):
    results = ranks2.run(collectives_of_dtensors_made_inside, timeout=TIMEOUT)
    for kind, message in results:
        assert kind == "RankMismatchError", message
        assert "_c10d_functional.all_gather_into_tensor" in message and "_c10d_functional.all_reduce" in message


def only_one_rank_compiles(timeout_s: str):
    previous = os.environ.get("DTCOMPILE_SYNC_TIMEOUT")
    os.environ["DTCOMPILE_SYNC_TIMEOUT"] = timeout_s
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))

        def fn(x):
            y = x * 2
            if x.shape[0] != 4:  # an all-gather: not the collectives the ranks agreed on (none)
                y = y.redistribute(mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
            return y

        jitted = dtcompile.jit(fn)  # no collectives at (4, 4): rank 0 runs it alone
        x = DTensor.from_local(torch.ones(4, 4), mesh, [Replicate()], run_check=False)
        first = _outcome(jitted, x)[0]
        # Rank 0 calls again with the same input (a hit), rank 1 with a new shape (a miss).
        if dist.get_rank() != 0:
            x = DTensor.from_local(torch.ones(2, 4), mesh, [Replicate()], run_check=False)
        kind, value = _outcome(jitted, x)
        return first, kind, value if kind != "ok" else None, dtcompile.cache_hits(jitted)
    finally:
        if previous is None:
            del os.environ["DTCOMPILE_SYNC_TIMEOUT"]
        else:
            os.environ["DTCOMPILE_SYNC_TIMEOUT"] = previous


def test_a_rank_that_compiles_alone_times_out(ranks2):
    try:
        rank0, rank1 = ranks2.run(only_one_rank_compiles, "2", timeout=TIMEOUT)
    finally:
        # The ranks now disagree on how many programs they compiled together: later tests
        # get fresh ranks.
        ranks2.close()
    assert rank0 == ("ok", "ok", None, 1)
    first, kind, message, hits = rank1
    assert (first, kind, hits) == ("ok", "RankMismatchError", 0)
    assert "rank 1 compiled" in message and "ranks [0] did not compile" in message and "within 2 s" in message
