"""The cache on Gloo ranks: what is a hit, what is a miss, and correct outputs after each.

Each rank function makes the same sequence of calls on every rank (the ranks must agree
on hits and misses, or they would compile different programs) and compares every output
with eager DTensor's.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dtcompile


def reduce_then_gather(x):
    """A local op, a reduction over dim 0 and a redistribution to Replicate: the
    collectives it needs depend on the placement and run on the DTensor's mesh."""
    y = torch.relu(x * 2 - 1).sum(0)
    return y.redistribute(y.device_mesh, [Replicate()] * y.device_mesh.ndim), y


def assert_same_as_eager(got, expected):
    for g, e in zip(got, expected):
        assert isinstance(g, DTensor)
        assert g.placements == e.placements and g.device_mesh == e.device_mesh
        assert g.shape == e.shape and g.stride() == e.stride()
        assert g._local_tensor.shape == e._local_tensor.shape and g._local_tensor.stride() == e._local_tensor.stride()
        torch.testing.assert_close(g.full_tensor(), e.full_tensor())


def _call(jitted, x, grad_mode=False):
    with torch.set_grad_enabled(grad_mode):
        expected = reduce_then_gather(x)
        got = jitted(x)
    assert_same_as_eager(got, expected)
    return dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)


def _data(*shape, dtype=torch.float32):
    # Different values on every call; the same on every rank, as distribute_tensor expects.
    return torch.randn(*shape, dtype=dtype)


def misses_and_hits_4_ranks():
    """Returns, per case, the (misses, hits) after a first call and after the replay."""
    torch.manual_seed(0)
    world = init_device_mesh("cpu", (4,))
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cases = {
        "base": lambda: (distribute_tensor(_data(8, 6), world, [Shard(0)]), False),
        "placement Shard(1)": lambda: (distribute_tensor(_data(8, 8), world, [Shard(1)]), False),
        "placement Replicate": lambda: (distribute_tensor(_data(8, 6), world, [Replicate()]), False),
        "shape": lambda: (distribute_tensor(_data(12, 6), world, [Shard(0)]), False),
        "dtype": lambda: (distribute_tensor(_data(8, 6, dtype=torch.float64), world, [Shard(0)]), False),
        # tp is ranks {0, 1} and {2, 3}; dp is {0, 2} and {1, 3}: same size, other ranks.
        "mesh tp": lambda: (distribute_tensor(_data(4, 6), mesh2d["tp"], [Shard(0)]), False),
        "mesh dp": lambda: (distribute_tensor(_data(4, 6), mesh2d["dp"], [Shard(0)]), False),
        "2-D mesh": lambda: (distribute_tensor(_data(8, 6), mesh2d, [Shard(0), Shard(1)]), False),
        "grad mode": lambda: (distribute_tensor(_data(8, 6), world, [Shard(0)]), True),
    }
    jitted = dtcompile.jit(reduce_then_gather)
    first = {}
    for name, make in cases.items():
        x, grad_mode = make()
        first[name] = _call(jitted, x, grad_mode)
        if name == "base":  # the same call again, with new values
            first["base again"] = _call(jitted, distribute_tensor(_data(8, 6), world, [Shard(0)]))
    replay = {}
    for name, make in cases.items():  # every earlier entry is still there
        x, grad_mode = make()
        replay[name] = _call(jitted, x, grad_mode)
    return first, replay


def test_each_new_input_is_one_miss_and_old_entries_stay(ranks4):
    for first, replay in ranks4.run(misses_and_hits_4_ranks):
        assert list(first.values()) == [(1, 0), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1), (8, 1), (9, 1)]
        assert list(replay.values()) == [(9, 2 + i) for i in range(9)]


def equal_and_submesh_2_ranks():
    """On two ranks: a 1-D mesh, an equal 1-D mesh made again, and the 1-D "tp" submesh of
    a (1, 2) mesh over the same ranks (same size and ranks, another mesh)."""
    torch.manual_seed(1)
    world = init_device_mesh("cpu", (2,))
    world_again = init_device_mesh("cpu", (2,))
    tp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))["tp"]
    jitted = dtcompile.jit(reduce_then_gather)
    counts = []
    for mesh in (world, world_again, tp, world, tp):
        counts.append(_call(jitted, distribute_tensor(_data(6, 4), mesh, [Shard(0)])))
    return counts


def test_equal_meshes_hit_and_other_meshes_miss(ranks2):
    for counts in ranks2.run(equal_and_submesh_2_ranks):
        assert counts == [(1, 0), (1, 1), (2, 1), (2, 2), (2, 3)]


def module_on_ranks():
    """A tensor-parallel MLP: the cache keys on the parameters' DTensor specs too."""
    from dtcompile.testing.models import parallel_mlp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parallel_mlp(mesh, dim=16, hidden=32)
    jitted = dtcompile.jit(model)
    torch.manual_seed(2)
    counts = []
    with torch.no_grad():
        for shape in ((3, 16), (3, 16), (5, 16), (3, 16)):
            x = torch.randn(*shape)
            torch.testing.assert_close(jitted(x), model(x))
            counts.append((dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)))
    return counts


def test_module_cache(ranks2):
    for counts in ranks2.run(module_on_ranks):
        assert counts == [(1, 0), (1, 1), (2, 1), (2, 2)]


def no_caching_on_ranks():
    torch.manual_seed(3)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    jitted = dtcompile.jit(reduce_then_gather, cache="no caching")
    x = distribute_tensor(_data(6, 4), mesh, [Shard(0)])
    return [_call(jitted, x) for _ in range(3)]


def test_no_caching_compiles_every_call(ranks2):
    for counts in ranks2.run(no_caching_on_ranks):
        assert counts == [(1, 0), (2, 0), (3, 0)]


def parameter_changes_on_ranks():
    """The module's tensors are checked in a few batched passes (the prologue's ``HELD``
    lists): each way a parameter can change is still seen, with eager's output after it."""
    from dtcompile.testing.models import parallel_mlp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parallel_mlp(mesh, dim=16, hidden=32)
    jitted = dtcompile.jit(model)
    torch.manual_seed(4)
    up = model.up  # colwise: weight Shard(0), bias Shard(0)

    def replaced_same_spec():  # a new object, same metadata: the entry serves it
        up.weight = torch.nn.Parameter(distribute_tensor(torch.randn(32, 16), mesh, [Shard(0)]))

    def replicated():  # same global shape, another placement
        up.weight = torch.nn.Parameter(up.weight.redistribute(mesh, [Replicate()]))

    def frozen():
        up.weight.requires_grad_(False)

    def strided_local():  # the local tensor's strides changed in place
        local = up.weight._local_tensor
        local.data = local.data.t().contiguous().t()

    def offset_local():  # the local tensor now starts inside a larger storage
        local = up.weight._local_tensor
        local.data = torch.cat([torch.zeros(1, local.shape[1]), local.data])[1:]

    counts = []
    with torch.no_grad():
        for change in (None, None, replaced_same_spec, replicated, frozen, strided_local, offset_local):
            if change is not None:
                change()
            x = torch.randn(3, 16)
            torch.testing.assert_close(jitted(x), model(x))
            counts.append((dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)))
    return counts


def test_each_change_of_a_parameter_is_seen(ranks2):
    for counts in ranks2.run(parameter_changes_on_ranks):
        assert counts == [(1, 0), (1, 1), (1, 2), (2, 2), (3, 2), (4, 2), (5, 2)], counts
