"""Symbolic values on Gloo ranks: DTensors with uneven shards (sizes the mesh does not
divide) are traced with their sizes as they are, and give eager DTensor's results."""

import pytest
import torch
import torch.distributed as dist
from checks import assert_all_same, counts, data
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtcompile
from dtcompile.core.symbolic import is_symbolic

SYMBOLIC = "symbolic values"


# ---------------------------------------------------------------------------------------
# 4. Uneven shards: traced with their sizes as they are


def _uneven_ops(a, b):
    """An all-gather (with DTensor's padding of uneven shards), a local op and a partial
    reduction of ``a``; a product with ``b``, which may be symbolic where ``a`` is not."""
    full = a.redistribute(a.device_mesh, [Replicate()] * a.device_mesh.ndim)
    return full * 2, (a + 1).sum(0), full @ b


def _evenly_divided(shape, mesh, placements) -> bool:
    factors = [1] * len(shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            factors[placement.dim] *= mesh.size(mesh_dim)
    return all(size % factor == 0 for size, factor in zip(shape, factors))


def uneven_shards(mesh_shape):
    """Returns per call: (misses, hits), whether the input was traced with symbolic sizes
    (divided evenly and contiguous), and the key of its shape, placements and layout."""
    mesh = init_device_mesh("cpu", mesh_shape)
    if mesh.ndim == 1:
        cases = [
            ([Shard(0)], (5, 8), 4),
            ([Shard(0)], (7, 6), 4),
            ([Shard(0)], (5, 8), 10),  # the first entry: b is symbolic
            ([Shard(0)], (9, 6), 4),
            ([Shard(0)], (8, 6), 5),  # even: the symbolic entry (distinct sizes: no duck sizing)
            ([Shard(0)], (12, 4), 6),  # even: the symbolic entry again
            ([Shard(1)], (6, 5), 4),
            ([Shard(0)], (7, 6), 3),  # the second entry
            # Divided evenly but not contiguous (a transposed Shard(1) DTensor): its sizes as they are.
            ([Shard(0)], (8, 6), 4, "transposed"),
            ([Shard(0)], (12, 6), 5, "transposed"),
            ([Shard(0)], (8, 6), 7, "transposed"),
        ]
        if mesh.size() == 4:
            cases += [([Shard(0)], (3, 8), 4), ([Shard(0)], (6, 6), 5)]  # a rank without rows; 2, 2, 2, 0 rows
    else:
        cases = [
            ([Shard(0), Shard(1)], (6, 5), 4),
            ([Shard(0), Shard(0)], (6, 4), 4),
            ([Shard(0), Shard(1)], (8, 6), 5),  # even (distinct sizes: no duck sizing)
            ([Shard(0), Shard(1)], (6, 5), 7),
            ([Shard(0), Shard(1)], (10, 4), 4),  # even
        ]
    jitted = dtcompile.jit(_uneven_ops, cache=SYMBOLIC)
    seen = []
    for step, (placements, shape, k, *layout) in enumerate(cases):
        if layout:
            a = distribute_tensor(data(*reversed(shape), seed=step), mesh, [Shard(1)]).t()
            assert list(a.placements) == placements and not a._local_tensor.is_contiguous()
        else:
            a = distribute_tensor(data(*shape, seed=step), mesh, placements)
        b = distribute_tensor(data(shape[1], k, seed=30 + step), mesh, [Replicate()] * mesh.ndim)
        with torch.no_grad():
            got, expected = jitted(a, b), _uneven_ops(a, b)
        assert_all_same(got, expected, f"{placements}, {shape}, {k} {layout}")
        symbolic = _evenly_divided(shape, mesh, placements) and not layout
        if len(seen) == 0 or dtcompile.cache_misses(jitted) > seen[-1][0][0]:
            # A new entry: ``a`` was traced with symbolic sizes exactly when expected.
            traced_a = dtcompile.last_traces(jitted)[0].inputs[0]
            assert traced_a.label == "a" and any(is_symbolic(s) for s in traced_a.shape) == symbolic, (shape, layout)
        seen.append((counts(jitted), symbolic, (tuple(placements), shape, *layout)))
    return seen


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2 ranks", "4 ranks", "2x2"])
def test_uneven_shards_match_eager_one_entry_per_uneven_shape(mesh_shape, ranks2, ranks4):
    pool = ranks2 if mesh_shape == (2,) else ranks4
    for seen in pool.run(uneven_shards, mesh_shape):
        # What the guards imply: an uneven (or non-contiguous) input is traced with its
        # sizes, so each new such shape (with its placements) is one entry; even inputs
        # with the same placements share a symbolic entry, whatever the sizes.
        entries, misses = set(), []
        for _, symbolic, key in seen:
            entries.add(key[0] if symbolic else key)
            misses.append(len(entries))
        assert [counts[0] for counts, _, _ in seen] == misses, seen
        assert [sum(counts) for counts, _, _ in seen] == list(range(1, len(seen) + 1)), seen
        assert any(symbolic for _, symbolic, _ in seen) and not all(symbolic for _, symbolic, _ in seen)


def _first_row_and_whole(x):
    first = x.to_local()[:1]  # a real slice on a rank holding 2 rows, the whole shard on one holding 1
    return first * 2, x.full_tensor()


def local_slices_of_uneven_shards():
    """Passes that decide from local sizes (a slice that keeps the whole shard) may decide
    differently on each rank; the ranks' programs must still agree, and match eager."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)])  # local rows: 2 and 1
    with torch.no_grad():
        expected = [t.wait() if hasattr(t, "wait") else t for t in _first_row_and_whole(x)]
        got = dtcompile.jit(_first_row_and_whole)(x)
    return all(torch.equal(g, e) for g, e in zip(got, expected))


def test_local_slices_of_uneven_shards_match_eager(ranks2):
    assert ranks2.run(local_slices_of_uneven_shards) == [True, True]


def one_row_gathered(cache):
    """A [1, n] DTensor sharded over its columns, gathered: DTensor views the padded
    gather as [1, n] after a narrow, and eager's view gives the row its own stride."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    jitted = dtcompile.jit(lambda x: x.full_tensor(), cache=cache)
    for n in (3, 5, 7):
        x = distribute_tensor(data(1, n, seed=n), mesh, [Shard(1)])
        with torch.no_grad():
            got, expected = jitted(x), x.full_tensor()
        assert got.stride() == expected.stride() and torch.equal(got, expected), (n, got.stride(), expected.stride())
    return True


@pytest.mark.parametrize("cache", ["constant values", SYMBOLIC])
def test_one_row_gathered_has_eagers_strides(cache, ranks2):
    assert all(ranks2.run(one_row_gathered, cache))


def _gathered_two_ways(x, y):
    """``x`` gathered by two DTensor paths: ``full_tensor``, and ``cat``'s redistribution.
    A rank whose shard DTensor pads gathers two different padded copies (``F.pad`` and
    ``aten.pad``); a rank with no padding gathers its shard itself, twice."""
    return x.full_tensor(), torch.cat([x, y]), (x * 2).sum(0), x.mT @ y


def uneven_shards_gathered_two_ways(mesh_shape, cache):
    """A pass that merges alike computations (CSE) must not merge collectives on some ranks
    only: each rank's programs agree, and match eager, as the sizes change."""
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] * mesh.ndim
    jitted = dtcompile.jit(_gathered_two_ways, cache=cache)
    for step, rows in enumerate((5, 7, 3, 6, 9)):
        x, y = (distribute_tensor(data(rows, 3, seed=10 * step + k), mesh, placements) for k in (0, 1))
        with torch.no_grad():
            assert_all_same(jitted(x, y), _gathered_two_ways(x, y), f"{rows} rows, {cache}")
    return dtcompile.cache_misses(jitted) >= 1


@pytest.mark.parametrize("cache", ["constant values", SYMBOLIC])
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2 ranks", "4 ranks", "2x2"])
def test_uneven_shards_gathered_two_ways_match_eager(mesh_shape, cache, ranks2, ranks4):
    pool = ranks2 if mesh_shape == (2,) else ranks4
    assert all(pool.run(uneven_shards_gathered_two_ways, mesh_shape, cache))


def closed_over_uneven_shards_updated_in_place(cache):
    """A DTensor the traced code closes over, whose shard is a view of DTensor's padded
    buffer (its rows not divided by the ranks), read and updated in place at every call."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = dist.get_world_size() + 1  # one rank holds two rows, the others one

    def make(buffers):
        def step(x):
            buffers[0].add_(x)
            buffers[1].mul_(0.5).add_(buffers[0])
            return buffers[0] + buffers[1], buffers[1].full_tensor()

        return step

    compiled_buffers, eager_buffers = (
        [distribute_tensor(data(rows, 3, seed=k), mesh, [Shard(0)]) for k in (1, 2)] for _ in range(2)
    )
    jitted, eager = dtcompile.jit(make(compiled_buffers), cache=cache), make(eager_buffers)
    for i in range(3):
        x = distribute_tensor(data(rows, 3, seed=10 + i), mesh, [Shard(0)])
        with torch.no_grad():
            assert_all_same(jitted(x), eager(x), f"call {i}, {cache}")
        assert_all_same(compiled_buffers, eager_buffers, f"buffers after call {i}, {cache}")
    return counts(jitted)


@pytest.mark.parametrize("cache", ["constant values", SYMBOLIC])
@pytest.mark.parametrize("world", [2, 4])
def test_closed_over_uneven_shards_updated_in_place_match_eager(world, cache, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    assert pool.run(closed_over_uneven_shards_updated_in_place, cache) == [(1, 2)] * world


def _contract_over_a_sharded_weight(w, x):
    """``x @ w`` with ``w`` sharded on the contracted dim: DTensor shards ``x`` to match,
    so ``x``'s gradient comes back sharded where ``x`` is replicated."""
    return x + torch.tanh((x @ w).redistribute(w.device_mesh, [Replicate()]))


def _sequence_sharded_inside(w, x):
    """``x`` sharded on its (symbolic) sequence dim inside the call: its gradient too."""
    y = x.redistribute(x.device_mesh, [Shard(1)])
    return (y * w.redistribute(w.device_mesh, [Replicate()])[0]).redistribute(y.device_mesh, [Replicate()])


def gradients_sharded_unevenly(fn_name, dim, cache):
    """An input's gradient sharded unevenly (a dim of ``dim`` over 2 ranks, or an odd
    sequence length) where the input is replicated: eager's gradient values and shape, over
    several lengths."""
    fn = globals()[fn_name]
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    w = distribute_tensor(torch.randn(dim, dim) / 4, mesh, [Shard(0)]).requires_grad_()
    jitted = dtcompile.jit(lambda x: fn(w, x), cache=cache)  # the weight closed over, as a module's
    for length in (8, 11, 12, 5):
        torch.manual_seed(length)
        x = distribute_tensor(torch.randn(2, length, dim), mesh, [Replicate()]).requires_grad_()
        got = torch.autograd.grad(jitted(x).full_tensor().pow(2).sum(), [w, x])
        want = torch.autograd.grad(fn(w, x).full_tensor().pow(2).sum(), [w, x])
        for a, b in zip(got, want):
            assert a.shape == b.shape
            torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache", ["constant values", SYMBOLIC])
@pytest.mark.parametrize(
    "fn_name, dim", [("_contract_over_a_sharded_weight", 15), ("_sequence_sharded_inside", 16)], ids=["dim", "sequence"]
)
def test_gradients_sharded_unevenly_where_the_input_is_not(fn_name, dim, cache, ranks2):
    ranks2.run(gradients_sharded_unevenly, fn_name, dim, cache)


def sequence_parallel_one_row(cache):
    """A sequence-parallel column-wise layer at batch 1 with one token: the rank's gathered
    input is a one-row slice of strides (2K, K, 1), which eager DTensor multiplies with
    ``view`` and ``mm``; ``aten::linear`` on it takes ``bmm``, bits apart (the linear pass
    must not put it back)."""
    import copy

    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    results = []
    for bias, tokens in ((False, 1), (True, 1), (False, 3)):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=bias))
        parallelize_module(model, mesh, {"0": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)})
        prepare = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
        )
        parallelize_module(model, mesh, prepare)
        jitted = dtcompile.jit(copy.deepcopy(model), cache=cache)
        for seed in range(4):
            x = torch.randn(1, tokens, 16, generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                results.append(torch.equal(jitted(x).to_local(), model(x).to_local()))
    return all(results)


@pytest.mark.parametrize("cache", ["constant values", SYMBOLIC])
def test_a_one_row_sequence_parallel_shard_multiplies_as_eager(cache, ranks2):
    assert ranks2.run(sequence_parallel_one_row, cache) == [True, True]


def async_local_tensor(cache):
    """A DTensor whose local tensor is an AsyncCollectiveTensor (``redistribute(...,
    async_op=True)``, what a row-wise layer with ``use_local_output=False`` hands on): eager's
    results at two lengths (under symbolic values its fake is made from the waited data)."""
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (2,))
    jitted = dtcompile.jit(lambda x: (x * 2).redistribute(placements=[Shard(1)]), cache=cache)
    same = []
    for rows in (6, 8, 6):
        local = data(rows, 4, seed=rows)
        x = DTensor.from_local(local, mesh, [Partial()], run_check=False).redistribute(
            placements=[Shard(0)], async_op=True
        )
        y = DTensor.from_local(local, mesh, [Partial()], run_check=False).redistribute(
            placements=[Shard(0)], async_op=True
        )
        assert type(x._local_tensor).__name__ == "AsyncCollectiveTensor"
        same.append(torch.equal(jitted(x).full_tensor(), (y * 2).redistribute(placements=[Shard(1)]).full_tensor()))
    return all(same)


@pytest.mark.parametrize("cache", ["constant values", SYMBOLIC])
def test_a_dtensor_around_an_async_collective_tensor(cache, ranks2):
    assert ranks2.run(async_local_tensor, cache) == [True, True]


def in_place_into_a_row_wise_output(cache):
    """A training call writing in place into a row-wise layer's plain output (its
    ``to_local()``, a custom Function's view): eager raises autograd's view error, and so
    must the compiled call (its calls recorded again made the output without that view)."""
    import copy

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            o = self.down(torch.relu(self.up(x)))
            o.add_(x)
            return o

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = parallelize_module(Block(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    jitted = dtcompile.jit(copy.deepcopy(model), cache=cache)
    x = data(2, 5, 8, seed=1)
    errors = []
    for fn in (model, jitted):
        try:
            fn(x.clone())
            errors.append(None)
        except RuntimeError as error:
            errors.append(str(error)[:40])
    with torch.no_grad():  # (no autograd check there: both run)
        same = torch.equal(model(x.clone()), jitted(x.clone()))
    return errors[0] is not None and errors[0] == errors[1] and same


@pytest.mark.parametrize("cache", ["constant values", SYMBOLIC])
def test_in_place_into_a_row_wise_output_raises_eagers_error(cache, ranks2):
    assert ranks2.run(in_place_into_a_row_wise_output, cache) == [True, True]


def addmv_of_a_row_shard(cache):
    """``x.addmv_(m, v)`` of a ``Shard(0)`` DTensor: DTensor derives its strategy through a
    decomposition, once per candidate placement, found outside tracing's modes (it took 20
    to 37 s to compile, eager's first call 1 s)."""
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (2,))
    jitted = dtcompile.jit(lambda x, m, v: x.addmv_(m, v), cache=cache)
    x0, m0, v0 = data(5, seed=1), data(5, 5, seed=2), data(5, seed=3)

    def make():
        return (
            distribute_tensor(x0.clone(), mesh, [Shard(0)]),
            distribute_tensor(m0.clone(), mesh, [Replicate()]),
            distribute_tensor(v0.clone(), mesh, [Replicate()]),
        )

    expected, got = make()[0].addmv_(*make()[1:]), jitted(*make())
    return torch.equal(got.full_tensor(), expected.full_tensor()) and got.placements == expected.placements


@pytest.mark.parametrize("cache", ["constant values", SYMBOLIC])
def test_addmv_of_a_row_shard(cache, ranks2):
    assert ranks2.run(addmv_of_a_row_shard, cache) == [True, True]
