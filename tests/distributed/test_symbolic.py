"""Symbolic values on Gloo ranks: one compilation for every size, compared with eager DTensor.

Under ``cache="symbolic values"`` the sizes of a call's tensors are traced as symbols: the
per-rank program reads them at run time (``prims.shape``) and the prologue checks only
what the trace assumed of them. Each rank function below makes the same calls on every
rank and compares every result with eager DTensor's (types, placements, global and local
shapes and strides, values); the tests then check how many compilations the calls took.
Cases are batched into few ``pool.run`` calls to keep the runtime low.
"""

import pytest
import torch
import torch.distributed as dist
from checks import assert_all_same, assert_same, assert_same_grads, counts, data, rank_data
from collective_counts import comm_counts, executed_counts, trace_collectives, trace_counts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_flatten

import dtcompile
from dtcompile.core import NumberProxy, TensorProxy
from dtcompile.core.prims import ShapeQuery, ShapeRead
from dtcompile.core.symbolic import SYMBOLIC_TYPES, is_symbolic
from dtcompile.testing.models import parallel_block, parallel_mlp

SYMBOLIC = "symbolic values"
# Equal sizes of a call share one symbol (duck sizing): a model dim equal to a traced
# sequence length would pin the length to the weights' size (see ``failing_guards``), so
# the model dim is none of the lengths (16..48, local shards 8..24).
DIM, HEADS, HIDDEN, BATCH = 64, 4, 32, 2
KINDS = ("mlp", "block", "block-sp")


def _meshes(mesh_shape):
    """The mesh and its tensor-parallel part (``mesh["tp"]`` on a dp x tp mesh)."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape) :])
    return mesh, (mesh["tp"] if len(mesh_shape) == 2 else mesh)


def _model(kind, tp):
    if kind == "mlp":
        return parallel_mlp(tp, dim=DIM, hidden=HIDDEN)
    return parallel_block(tp, dim=DIM, n_heads=HEADS, hidden=HIDDEN, sequence_parallel=kind == "block-sp")


def _lengths(kind, tp):
    """Sequence lengths 16..48; with sequence parallelism those the tp ranks split evenly."""
    return range(16, 49, tp.size() if kind == "block-sp" else 1)


def _batch(kind, mesh, tp, seq, batch=BATCH):
    """An input and a cotangent of ``seq`` tokens: the same on the ranks of a tp group,
    different across dp ranks; with sequence parallelism each rank takes its shard."""
    dp_rank = mesh["dp"].get_local_rank() if mesh.ndim == 2 else 0
    generator = torch.Generator().manual_seed(1000 * seq + 10 * batch + dp_rank)
    x, cotangent = (torch.randn(batch, seq, DIM, generator=generator) for _ in range(2))
    if kind == "block-sp":
        x, cotangent = (t.chunk(tp.size(), dim=1)[tp.get_local_rank()].contiguous() for t in (x, cotangent))
    return x, cotangent


# ---------------------------------------------------------------------------------------
# 1. One compilation for every sequence length


def sequence_lengths(mesh_shape, kinds, executors=None):
    """Each model, forward under no_grad and forward+backward, one call per sequence
    length, each compared with eager; returns ``{case: (misses, hits, calls)}``."""
    mesh, tp = _meshes(mesh_shape)
    results = {}
    for kind in kinds:
        for training in (False, True):
            eager, compiled = _model(kind, tp), _model(kind, tp)
            jitted = dtcompile.jit(compiled, cache=SYMBOLIC, executors=executors)
            lengths = _lengths(kind, tp)
            for seq in lengths:
                x, cotangent = _batch(kind, mesh, tp, seq)
                where = f"{kind}, {'forward+backward' if training else 'forward'}, sequence length {seq}"
                if not training:
                    with torch.no_grad():
                        expected, got = eager(x), jitted(x)
                    assert not got.requires_grad
                    assert_same(got, expected, where)
                    continue
                x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
                expected, got = eager(x_eager), jitted(x_compiled)
                assert got.requires_grad and got.grad_fn is not None, where
                assert_same(got.detach(), expected.detach(), where)
                expected.backward(cotangent)
                got.backward(cotangent)
                assert_same(x_compiled.grad, x_eager.grad, f"{where}: input gradient")
                assert_same_grads(compiled, eager, where)
                eager.zero_grad(set_to_none=True)
                compiled.zero_grad(set_to_none=True)
            results[f"{kind} {'training' if training else 'inference'}"] = (*counts(jitted), len(lengths))
    return results


@pytest.mark.parametrize(
    "mesh_shape, kinds",
    [((2,), KINDS), ((4,), ("mlp",)), ((2, 2), ("mlp",))],
    ids=["2 ranks", "4 ranks", "dp2 x tp2"],
)
def test_one_compilation_serves_every_sequence_length(mesh_shape, kinds, ranks2, ranks4):
    pool = ranks2 if mesh_shape == (2,) else ranks4
    for results in pool.run(sequence_lengths, mesh_shape, kinds):
        assert set(results) == {f"{kind} {mode}" for kind in kinds for mode in ("inference", "training")}
        for case, (misses, hits, calls) in results.items():
            assert calls >= 17, case
            assert (misses, hits) == (1, calls - 1), case


# ---------------------------------------------------------------------------------------
# 2. DTensor.from_local inside the function; DTensors passed directly


def _from_local(local, mesh):
    """Wraps each rank's local tensor, gathers it, and reduces it three ways."""
    y = DTensor.from_local(local, mesh, [Shard(0)])
    z = y.redistribute(mesh, [Replicate()])
    return y * 2, z.sum(1), y.sum(0), torch.tanh(z) + 1, y.shape


def _matmul_and_gather(a, b):
    """Shard(0) @ Replicate, a Partial sum of it, an all-gather and a Replicate op."""
    c = a @ b
    return c, c.sum(0), a.redistribute(a.device_mesh, [Replicate()]), b * 2 + 1


def _reduce_partial(p):
    """A Partial input, reduced (an all-reduce) and scaled (still Partial)."""
    return p.redistribute(p.device_mesh, [Replicate()]), p * 3


def dtensor_sizes():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def from_local(local):
        return _from_local(local, mesh)

    results = {}
    # from_local of locals (8, 8), then (16, 16): one compilation.
    jitted = dtcompile.jit(from_local, cache=SYMBOLIC)
    seen = []
    for step, shape in enumerate(((8, 8), (16, 16))):
        local = rank_data(*shape, seed=step)
        with torch.no_grad():
            got, expected = jitted(local), from_local(local)
        assert got[-1] == (dist.get_world_size() * shape[0], shape[1])
        assert_all_same(got, expected, f"from_local of {shape}")
        seen.append(counts(jitted))
    results["from_local"] = seen

    # The same with a gradient for the local tensor.
    jitted = dtcompile.jit(from_local, cache=SYMBOLIC)
    seen = []
    for step, shape in enumerate(((8, 8), (16, 16))):
        local = rank_data(*shape, seed=10 + step)
        grads = []
        for fn in (from_local, jitted):
            leaf = local.clone().requires_grad_()
            out = fn(leaf)
            loss = sum(o.pow(2).sum().full_tensor() for o in out[:-1] if o.requires_grad)
            loss.backward()
            grads.append((out, leaf.grad))
        assert_all_same(grads[1][0], grads[0][0], f"from_local of {shape}, training")
        assert_same(grads[1][1], grads[0][1], f"from_local of {shape}: gradient of the local tensor")
        seen.append(counts(jitted))
    results["from_local training"] = seen

    # Shard(0) and Replicate DTensors of growing sizes, passed directly; the first call's
    # sizes are distinct (equal ones would share a symbol), so later ones may be anything.
    jitted = dtcompile.jit(_matmul_and_gather, cache=SYMBOLIC)
    seen = []
    for step, (n, m, k) in enumerate(((12, 4, 10), (8, 6, 6), (16, 10, 4), (20, 20, 20), (34, 3, 7))):
        a = distribute_tensor(data(n, m, seed=step), mesh, [Shard(0)])
        b = distribute_tensor(data(m, k, seed=50 + step), mesh, [Replicate()])
        with torch.no_grad():
            got, expected = jitted(a, b), _matmul_and_gather(a, b)
        assert [o.shape for o in got] == [(n, k), (k,), (n, m), (m, k)]
        assert [o.placements for o in got] == [(Shard(0),), (Partial(),), (Replicate(),), (Replicate(),)]
        assert_all_same(got, expected, f"DTensors of {(n, m)} and {(m, k)}")
        seen.append(counts(jitted))
    results["DTensor inputs"] = seen

    # Partial DTensors (each rank's own summand) of growing sizes.
    jitted = dtcompile.jit(_reduce_partial, cache=SYMBOLIC)
    seen = []
    for step, shape in enumerate(((6, 4), (10, 12), (8, 8))):
        p = DTensor.from_local(rank_data(*shape, seed=70 + step), mesh, [Partial()])
        with torch.no_grad():
            got, expected = jitted(p), _reduce_partial(p)
        assert [o.shape for o in got] == [shape, shape]
        assert_all_same(got, expected, f"Partial DTensor of {shape}")
        seen.append(counts(jitted))
    results["Partial input"] = seen
    return results


def test_from_local_and_dtensor_inputs_compile_once(ranks2):
    for results in ranks2.run(dtensor_sizes):
        assert results["from_local"] == [(1, 0), (1, 1)]
        assert results["from_local training"] == [(1, 0), (1, 1)]
        assert results["DTensor inputs"] == [(1, i) for i in range(5)]
        assert results["Partial input"] == [(1, i) for i in range(3)]


def _tanh_of_matmul(a, b):
    return torch.tanh(a @ b)


def dtensor_inputs_with_gradients():
    """DTensor inputs that require grad, of growing sizes: outputs and the inputs'
    DTensor gradients (their global shape is each call's) as eager's."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    jitted = dtcompile.jit(_tanh_of_matmul, cache=SYMBOLIC)
    seen = []
    for step, (n, m, k) in enumerate(((12, 4, 10), (8, 6, 6), (16, 10, 4))):
        a0 = distribute_tensor(data(n, m, seed=step), mesh, [Shard(0)])
        b0 = distribute_tensor(data(m, k, seed=50 + step), mesh, [Replicate()])
        results = []
        for fn in (_tanh_of_matmul, jitted):
            a, b = a0.detach().requires_grad_(), b0.detach().requires_grad_()
            out = fn(a, b)
            out.pow(2).sum().full_tensor().backward()
            results.append((out.detach(), a.grad, b.grad))
        assert results[1][1].shape == (n, m) and results[1][2].shape == (m, k)
        assert_all_same(results[1], results[0], f"DTensors of {(n, m)} and {(m, k)}, training")
        seen.append(counts(jitted))
    return seen


def test_dtensor_inputs_with_gradients_compile_once(ranks2):
    for seen in ranks2.run(dtensor_inputs_with_gradients):
        assert seen == [(1, 0), (1, 1), (1, 2)]


# ---------------------------------------------------------------------------------------
# 3. Guards: what stays guarded, and guards that fail


def _reduce_and_gather(x):
    y = (x * 2).sum(0)
    return y.redistribute(y.device_mesh, [Replicate()] * y.device_mesh.ndim), x + 1


def placements_and_meshes():
    """Mesh and placements stay guarded: another placement or mesh is a miss, new sizes
    with a placement and mesh seen before are hits."""
    world = init_device_mesh("cpu", (2,))
    # Same ranks and size as ``world``, another mesh with its own process group.
    tp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))["tp"]
    jitted = dtcompile.jit(_reduce_and_gather, cache=SYMBOLIC)
    calls = [
        (world, Shard(0), (8, 6)),  # miss
        (world, Shard(0), (12, 10)),  # hit
        (world, Shard(1), (8, 6)),  # another placement: miss
        (world, Shard(1), (6, 12)),  # hit
        (world, Replicate(), (8, 6)),  # another placement: miss
        (tp, Shard(0), (8, 6)),  # another mesh: miss
        (tp, Shard(0), (10, 4)),  # hit
        (world, Shard(0), (16, 6)),  # the first entry again
        (world, Replicate(), (5, 7)),  # the third entry: nothing to divide
    ]
    seen = []
    for step, (mesh, placement, shape) in enumerate(calls):
        x = distribute_tensor(data(*shape, seed=step), mesh, [placement])
        with torch.no_grad():
            got, expected = jitted(x), _reduce_and_gather(x)
        assert_all_same(got, expected, f"{placement} on {mesh}, {shape}")
        seen.append(counts(jitted))
    return seen


def test_mesh_and_placements_stay_guarded(ranks2):
    for seen in ranks2.run(placements_and_meshes):
        assert seen == [(1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (4, 2), (4, 3), (4, 4), (4, 5)]


def _equal_or_not(a, b):
    """Branches on whether two sizes are equal: the trace assumes one answer."""
    if a.shape[0] == b.shape[0]:
        return a + b
    return a.sum(0) + b.sum(0)


def failing_guards():
    """Guards that fail and compile a new entry; returns, per case, the (misses, hits)
    after each call and which calls each entry's prologue accepts."""
    mesh, tp = _meshes((dist.get_world_size(),))
    results = {}

    # The MLP: DTensor's view rule asks whether the batch divides evenly over the mesh
    # (a guard of the trace): odd batches need a second entry, which guards oddness.
    eager, compiled = _model("mlp", tp), _model("mlp", tp)
    jitted = dtcompile.jit(compiled, cache=SYMBOLIC)
    seen, accepts = [], {}
    calls = [(2, 10), (4, 11), (3, 12), (5, 13), (6, 14), (7, 15), (9, 20), (8, 21)]
    for batch, seq in calls:
        x, _ = _batch("mlp", mesh, tp, seq, batch=batch)
        with torch.no_grad():
            assert_same(jitted(x), eager(x), f"MLP, batch {batch}, sequence length {seq}")
            if dtcompile.cache_misses(jitted) > len(accepts):  # a new entry: which calls its guards accept
                prologue = dtcompile.last_prologue(jitted).fn
                accepts[(batch, seq)] = [
                    prologue(compiled, (_batch("mlp", mesh, tp, s, batch=b)[0],), {}) is not None
                    for b, s in ((2, 17), (3, 17), (4, 9), (5, 9))
                ]
        seen.append(counts(jitted))
    # Sizes 0 and 1 are traced as constants (a symbol stands for 2 and more): a sequence
    # of one token is a new entry, which then serves any batch with one token (the batch
    # stays symbolic); a plain matrix (another rank) is another.
    for batch, seq in ((2, 1), (4, 1)):
        x, _ = _batch("mlp", mesh, tp, seq, batch=batch)
        with torch.no_grad():
            assert_same(jitted(x), eager(x), f"MLP, batch {batch}, sequence length {seq}")
        seen.append(counts(jitted))
    for rows in (12, 20):
        x = data(rows, DIM, seed=rows)
        with torch.no_grad():
            assert_same(jitted(x), eager(x), f"MLP, {rows} rows")
        seen.append(counts(jitted))
    results["mlp"] = (seen, accepts)

    # Duck sizing: traced with a sequence length equal to the model dim, the two share a
    # symbol, which the weights pin to DIM; another length is a second entry, with its own
    # symbol, which serves every length after it.
    eager, compiled = _model("mlp", tp), _model("mlp", tp)
    jitted = dtcompile.jit(compiled, cache=SYMBOLIC)
    seen = []
    for seq in (DIM, DIM, DIM + 1, 17, 2 * DIM, DIM):
        x, _ = _batch("mlp", mesh, tp, seq)
        with torch.no_grad():
            assert_same(jitted(x), eager(x), f"MLP, sequence length {seq}")
        seen.append(counts(jitted))
    results["duck"] = seen

    # Two sizes traced as equal, then differing: the branch taken was guarded.
    jitted = dtcompile.jit(_equal_or_not, cache=SYMBOLIC)
    seen = []
    for step, (n, m) in enumerate(((8, 8), (10, 10), (8, 12), (14, 6), (12, 12), (6, 10))):
        a = distribute_tensor(data(n, 6, seed=step), mesh, [Shard(1)])
        b = distribute_tensor(data(m, 6, seed=20 + step), mesh, [Shard(1)])
        with torch.no_grad():
            assert_same(jitted(a, b), _equal_or_not(a, b), f"sizes {n} and {m}")
        seen.append(counts(jitted))
    results["equal sizes"] = seen
    return results


def test_guards_that_fail_compile_exactly_the_entries_they_imply(ranks2):
    for results in ranks2.run(failing_guards):
        seen, accepts = results["mlp"]
        # Batches 2 and 4 share the first entry; 3 needs a second; every later call hits
        # one of the two. Then one token (a third entry, serving batches 2 and 4), then
        # a 2-D input (a fourth).
        assert seen == [(1, 0), (1, 1), (2, 1), (2, 2), (2, 3), (2, 4), (2, 5), (2, 6)] + [
            (3, 6),
            (3, 7),
            (4, 7),
            (4, 8),
        ]
        # The first two entries' prologues: each accepts the batches of its parity, at any
        # sequence length (batches 2, 3, 4, 5 at lengths 17 and 9).
        assert accepts == {(2, 10): [True, False, True, False], (3, 12): [False, True, False, True]}, accepts
        assert results["duck"] == [(1, 0), (1, 1), (2, 1), (2, 2), (2, 3), (2, 4)]
        # Equal sizes: the first entry; differing sizes: the second, whatever they are.
        assert results["equal sizes"] == [(1, 0), (1, 1), (2, 1), (2, 2), (2, 3), (2, 4)]


# ---------------------------------------------------------------------------------------
# 5. The per-rank traces: sizes read at run time, eager's collectives


def _check_sizes_computed(trace, where):
    """Every size the trace uses is a number it computes: no SymInt is left, every view
    with a symbolic shape takes its sizes from numbers the trace read with
    ``prims.shape`` (or computed from those), and those reads are of its tensors."""
    produced = {}
    for bsym in trace.bound_symbols:
        leaves = tree_flatten((bsym.args, bsym.kwargs))[0]
        assert not any(isinstance(x, SYMBOLIC_TYPES) for x in leaves), (where, bsym.lines())
        for x in leaves:
            if isinstance(x, NumberProxy):
                assert x.label in produced, (where, x.label, bsym.lines())
        if isinstance(bsym.output, NumberProxy):
            produced[bsym.output.label] = bsym
        if bsym.op in (
            torch.ops.aten.view.default,
            torch.ops.aten._unsafe_view.default,
            torch.ops.aten.reshape.default,
        ):
            shape = bsym.args[1]
            out = bsym.output
            for size, traced in zip(shape, out.shape):
                assert isinstance(size, NumberProxy) == is_symbolic(traced), (where, bsym.lines())
    queries = [b for b in produced.values() if isinstance(b.symbol, (ShapeQuery, ShapeRead))]
    assert all(isinstance(b.args[0], TensorProxy) for b in queries), where
    reads = [b for b in queries if b.symbol.name in ("prims.shape", "shape")]
    for bsym in reads:
        assert is_symbolic(bsym.args[0].shape[bsym.args[1]]), (where, bsym.lines())
    return reads


def traces_and_collectives():
    """For each model: the forward (no_grad) and the training step compiled at one
    sequence length, run at another under CommDebugMode beside eager."""
    mesh, tp = _meshes((dist.get_world_size(),))
    report = {}
    for kind in KINDS:
        for training in (False, True):
            where = f"{kind} {'training' if training else 'inference'}"
            eager, compiled = _model(kind, tp), _model(kind, tp)
            jitted = dtcompile.jit(compiled, cache=SYMBOLIC)
            x, _ = _batch(kind, mesh, tp, 20)
            with torch.set_grad_enabled(training):
                jitted(x.clone().requires_grad_(training))  # compiles at length 20
            traces = dtcompile.last_traces(jitted)
            executed = [t for t in traces if t.title.startswith("execution trace")]
            assert len(executed) == (2 if training else 1), where

            # Before lowering, sizes are prims.shape queries; the execution trace reads them.
            before = [
                t for t in traces if t not in executed and any(b.symbol.name == "prims.shape" for b in t.bound_symbols)
            ]
            assert before and "prims.shape(" in str(before[-1]), where  # the MLP's are dropped later
            for trace in executed:
                reads = _check_sizes_computed(trace, where)
                assert all(isinstance(b.symbol, ShapeRead) for b in reads), where
                assert (".shape[" in str(trace)) == bool(reads), where
            # The forward reads the sequence length from its input, where it needs it: the
            # MLP's inference has none left (its linear layers are one call each).
            x_label = executed[0].inputs[0].label
            reads = _check_sizes_computed(executed[0], where)
            if kind == "mlp" and not training:
                assert not reads and "linear(" in str(executed[0]), where
            else:
                assert any(b.args[0].label == x_label and b.args[1] == 1 for b in reads), where

            # Collectives work on symbolic sizes.
            for trace in executed:
                for bsym in trace_collectives(trace):
                    assert any(is_symbolic(s) for s in bsym.args[0].shape), (where, bsym.lines())

            # At another length: eager's collectives, those of the execution traces, and
            # what the compiled program issues.
            x, cotangent = _batch(kind, mesh, tp, 32)
            x_eager, x_compiled = x.clone().requires_grad_(training), x.clone().requires_grad_(training)
            with torch.set_grad_enabled(training):
                with CommDebugMode() as eager_forward:
                    expected = eager(x_eager)
                with CommDebugMode() as compiled_forward:
                    got = jitted(x_compiled)
            assert counts(jitted) == (1, 1), where
            assert_same(got.detach(), expected.detach(), where)
            eager_counts = comm_counts(eager_forward)
            assert eager_counts, where
            assert trace_counts(executed[0]) == eager_counts, where
            assert comm_counts(compiled_forward) == executed_counts(executed[0]), where
            report[where] = {"forward": dict(eager_counts)}
            if training:
                with CommDebugMode() as eager_backward:
                    expected.backward(cotangent)
                with CommDebugMode() as compiled_backward:
                    got.backward(cotangent)
                assert_same(x_compiled.grad, x_eager.grad, where)
                assert_same_grads(compiled, eager, where)
                eager_counts, compiled_counts = comm_counts(eager_backward), trace_counts(executed[1])
                assert eager_counts and comm_counts(compiled_backward) == executed_counts(executed[1]), where
                if kind == "block":  # summed all-reduces may be combined (one per sum); nothing else changes
                    assert set(compiled_counts) == set(eager_counts), where
                    assert compiled_counts <= eager_counts, where
                else:
                    assert compiled_counts == eager_counts, where
                report[where]["backward"] = dict(eager_counts)
                report[where]["compiled backward"] = dict(compiled_counts)
    return report


def test_traces_compute_sizes_and_issue_eagers_collectives(ranks2):
    for report in ranks2.run(traces_and_collectives):
        # With sequence parallelism the block gathers the sequence before attention and
        # the MLP, and reduce-scatters after each: all on symbolic sizes.
        assert report["block-sp inference"]["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
        assert report["block-sp training"]["backward"].get("all_gather_into_tensor") == 2
        assert report["block-sp training"]["backward"].get("reduce_scatter_tensor") == 2
        assert report["mlp inference"]["forward"] == {"all_reduce": 1}


def loss_parallel_inside_with_gradients(reduction: str):
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    head = parallelize_module(
        torch.nn.Linear(12, 40, bias=False), mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    )

    def loss_fn(x, labels):
        with loss_parallel():
            return F.cross_entropy(head(x), labels, reduction=reduction)

    jitted = dtcompile.jit(loss_fn, cache="symbolic values")
    for n in (8, 5, 17, 6):
        generator = torch.Generator().manual_seed(n)
        x, labels = torch.randn(n, 12, generator=generator), torch.randint(0, 40, (n,), generator=generator)
        results = []
        for fn in (loss_fn, jitted):
            head.weight.grad = None
            loss = fn(x, labels)
            with loss_parallel():
                loss.backward()
            results.append((loss.detach(), head.weight.grad.full_tensor()))
        assert_same(results[1], results[0], f"length {n}")
    return dtcompile.cache_misses(jitted)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_loss_parallel_cross_entropy_inside_with_gradients_compiles_once(ranks2, reduction):
    """Its backward's ``arange(n)`` (DTensor's own code) ran on real values and fixed the
    length: a compile per length."""
    assert ranks2.run(loss_parallel_inside_with_gradients, reduction) == [1, 1]


_OPERATORS = {
    "x[:, :1] == 0": lambda x: x[:, :1] == 0,
    "x[:, :1] != 0": lambda x: x[:, :1] != 0,
    "x[:, 1:3] == 0": lambda x: x[:, 1:3] == 0,
    "x[:, :1] * 2": lambda x: x[:, :1] * 2,
    "x[:, :2] > x[:, 1:3]": lambda x: x[:, :2] > x[:, 1:3],
    "x[:, 0] + 1": lambda x: x[:, 0] + 1,
}


def operators_on_column_slices():
    """A column slice of a DTensor whose spec DTensor cannot hash with symbolic strides:
    a tensor operator (``==``, ``*``) got DTensor's TypeError as NotImplemented, and Python's
    fallback answered (``x[:, :1] == 0`` was False, ``* 2`` raised an unsupported-operand
    TypeError). Traced again with the sizes as they are, each is eager's."""
    mesh = init_device_mesh("cpu", (2,))
    checked = []
    for name, fn in _OPERATORS.items():
        jitted = dtcompile.jit(fn, cache="symbolic values")
        for rows, placement in ((2, Shard(0)), (4, Shard(0)), (1, Replicate())):
            x = distribute_tensor(torch.arange(rows * 6.0).reshape(rows, 6) % 3, mesh, [placement])
            assert_same(jitted(x), fn(x))
        checked.append(name)
    return checked


def test_tensor_operators_on_column_slices_under_symbolic_values(ranks2):
    for checked in ranks2.run(operators_on_column_slices):
        assert checked == list(_OPERATORS)


def _heads_attention(x):
    q = x.view(x.shape[0], x.shape[1], 4, 6).transpose(1, 2)
    return (q @ q.transpose(-1, -2)).softmax(-1) @ q


def heads_of_a_column_sharded_dtensor():
    """A DTensor sharded on its hidden dim viewed into heads (q/k/v of
    ``ColwiseParallel(use_local_output=False)``), then two matmuls: DTensor cannot propagate
    the flatten of a ``_StridedShard`` whose split factor is the symbolic batch, and every
    size was made static: an entry per length. Now only the batch's dim is."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    jitted = dtcompile.jit(_heads_attention, cache=SYMBOLIC)
    seen = []
    for batch, n in ((2, 16), (2, 7), (2, 5), (3, 9), (2, 9), (3, 11)):
        x = distribute_tensor(data(batch, n, 24, seed=n), mesh, [Shard(2)])
        got, expected = jitted(x), _heads_attention(x)
        assert got.placements == expected.placements
        assert_all_same((got,), (expected,), f"({batch}, {n}, 24)")
        seen.append(counts(jitted)[0])
    return seen


def test_heads_of_a_column_sharded_dtensor_compile_once_per_batch_size(ranks2):
    for seen in ranks2.run(heads_of_a_column_sharded_dtensor):
        assert seen == [1, 1, 1, 2, 2, 2]
