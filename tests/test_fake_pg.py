"""Per-rank traces for large meshes, in one process with a fake process group.

With the fake process group collectives do nothing, so values are garbage: these tests
check what was recorded (exactly the collectives eager DTensor issues, in eager's order
and on eager's process groups) and the metadata of the outputs (placements, shapes,
strides), never values.
"""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from support import forget_dtensor_caches
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import dtcompile
from dtcompile.capture import capture_call
from dtcompile.core import FutureProxy, InputPath, NoProvenance, TraceError, verify
from dtcompile.core.block_call import with_block_symbols
from dtcompile.executors.collectives import StartCollective, WaitCollective
from dtcompile.testing.models import parallel_block, parallel_mlp
from dtcompile.testing.moe import parallel_moe_block
from dtcompile.transforms import all_reduce_sums

functional = torch.ops._c10d_functional
COLLECTIVES = {
    functional.all_reduce.default,
    functional.all_gather_into_tensor.default,
    functional.reduce_scatter_tensor.default,
    functional.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
}


@pytest.fixture
def fake_world():
    """``fake_world(n, rank)`` starts a fake process group of ``n`` ranks, this process
    being ``rank``; it is destroyed after the test, so that tests are independent."""

    def start(world_size: int, rank: int = 0):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_dtensor_caches()


def _group_name(op, args, kwargs) -> str:
    names = [a.name for a in op._schema.arguments]
    index = names.index("group_name")
    return kwargs["group_name"] if "group_name" in kwargs else args[index]


class CollectiveLog(TorchDispatchMode):
    """Logs eager DTensor's functional collectives, in order, with their process groups.
    Ops on DTensors are left to DTensor (``NotImplemented``), so its local ops, the
    collectives among them, come back here."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func in COLLECTIVES:
            self.calls.append((func._opname, _group_name(func, args, kwargs)))
        return func(*args, **kwargs)


def _wait(value):
    """Eager returns collectives' outputs unwaited (AsyncCollectiveTensor): wait for them."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    if isinstance(local, AsyncCollectiveTensor):
        local.wait()


def run_eager(fn, *args):
    """``fn(*args)`` in eager DTensor; the result, CommDebugMode's counts (by op name) and
    the ordered log of collectives."""
    counter, log = CommDebugMode(), CollectiveLog()
    with torch.no_grad(), counter, log:
        result = fn(*args)
    tree_map(_wait, result)
    counts = Counter({packet._qualified_op_name.split("::")[-1]: n for packet, n in counter.get_comm_counts().items()})
    return result, counts, log.calls


def trace_collectives(trace) -> list[tuple[str, str]]:
    """Its collectives, and those of the repeated blocks it calls, in order."""
    symbols = with_block_symbols(trace.bound_symbols, lowered=trace.title.startswith("execution"))
    return [(b.op._opname, _group_name(b.op, b.args, b.kwargs)) for b in symbols if b.op in COLLECTIVES]


def assert_same_metadata(got, expected):
    """Placements, global and local shapes and strides; values are garbage here."""
    if isinstance(expected, (tuple, list)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for g, e in zip(got, expected):
            assert_same_metadata(g, e)
        return
    assert isinstance(got, DTensor) == isinstance(expected, DTensor)
    assert got.shape == expected.shape and got.stride() == expected.stride() and got.dtype == expected.dtype
    if isinstance(expected, DTensor):
        assert got.placements == expected.placements
        assert got.device_mesh == expected.device_mesh
        got, expected = got._local_tensor, expected._local_tensor
        assert got.shape == expected.shape and got.stride() == expected.stride()
    assert type(got) is torch.Tensor


def assert_provenance(trace):
    """Inputs come from the call (a DTensor's through ``._local_tensor``); everything else
    is marked as made by its op."""
    for proxy in trace.inputs:
        assert isinstance(proxy.provenance, InputPath), proxy
        assert proxy.provenance.root in ("args", "params", "buffers")
    for bsym in trace.bound_symbols:
        for proxy in bsym.output_proxies():
            if bsym.op is None:  # a replayed block's call: made by it, or by the op inside it
                assert isinstance(proxy.provenance, NoProvenance), proxy
                continue
            assert proxy.provenance == NoProvenance(str(bsym.op)), proxy


def check_against_eager(fn, *args):
    """Compile ``fn``, call it once and compare its traces and outputs with eager's;
    returns the collectives the program runs, by op name."""
    expected, eager_counts, eager_calls = run_eager(fn, *args)
    jitted = dtcompile.jit(fn)
    with torch.no_grad():
        got = jitted(*args)
    assert_same_metadata(got, expected)
    traces = dtcompile.last_traces(jitted)
    assert_provenance(traces[0])
    dce_trace = next(t for t in traces if "dead-code" in t.title)
    for trace in (traces[0], dce_trace, traces[-1]):  # as recorded, after the passes, what runs
        calls = trace_collectives(trace)
        assert Counter(op for op, _ in calls) == eager_counts, trace
        assert calls == eager_calls, trace
    return eager_counts


def _mesh(shape):
    """A 1-D mesh, or the "tp" dim of a 2-D ("dp", "tp") mesh."""
    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))["tp"]


MESH_SHAPES = [(8,), (64,), (8, 8)]


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
def test_tp_mlp(fake_world, mesh_shape):
    fake_world(torch.Size(mesh_shape).numel())
    model = parallel_mlp(_mesh(mesh_shape), dim=64, hidden=128)
    counts = check_against_eager(model, torch.randn(2, 8, 64))
    assert counts == {"all_reduce": 1}  # ColwiseParallel then RowwiseParallel: one all-reduce


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
def test_llama_block(fake_world, mesh_shape, sequence_parallel):
    fake_world(torch.Size(mesh_shape).numel())
    tp = _mesh(mesh_shape)
    model = parallel_block(tp, dim=128, n_heads=64, hidden=128, sequence_parallel=sequence_parallel)
    seq = 64 // tp.size() if sequence_parallel else 64  # with sequence parallelism: this rank's shard
    counts = check_against_eager(model, torch.randn(2, seq, 128))
    if sequence_parallel:
        assert counts == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    else:
        assert counts == {"all_reduce": 2}


def _matmul_then_reduce(x, w):
    """On a 2-D mesh: a local matmul, a sum that leaves a Partial, and the reductions and
    gathers that make it Replicate on both dims."""
    y = (x @ w).sum(-1)
    return y.redistribute(y.device_mesh, [Replicate(), Replicate()]), x.sum()


def _regather(x, w):
    return x.redistribute(x.device_mesh, [Replicate(), Replicate()]) * 2, torch.softmax(w, dim=1)


@pytest.mark.parametrize("rank", [0, 37])
def test_2d_mesh_redistributions(fake_world, rank):
    fake_world(64, rank)
    mesh = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(16, 32), mesh, [Shard(0), Replicate()])
    w = distribute_tensor(torch.randn(32, 64), mesh, [Replicate(), Shard(1)])
    counts = check_against_eager(_matmul_then_reduce, x, w)
    assert counts["all_reduce"] >= 1 and counts["all_gather_into_tensor"] >= 1
    xs = distribute_tensor(torch.randn(16, 32), mesh, [Shard(0), Shard(1)])
    counts = check_against_eager(_regather, xs, w)
    assert sum(counts.values()) >= 3


@pytest.mark.parametrize("world_size", [8, 64])
def test_1d_mesh_outputs_keep_eager_placements(fake_world, world_size):
    fake_world(world_size)
    mesh = init_device_mesh("cpu", (world_size,))

    def fn(x, w):
        partial = x @ w  # Shard(1) @ Shard(0): Partial(sum)
        return partial, partial.redistribute(mesh, [Shard(0)]), torch.softmax(x, dim=1), (x * 2).t()

    x = distribute_tensor(torch.randn(world_size, 2 * world_size), mesh, [Shard(1)])
    w = distribute_tensor(torch.randn(2 * world_size, 8), mesh, [Shard(0)])
    with torch.no_grad():
        eager = fn(x, w)
    assert eager[0].placements == (Partial(),) and eager[1].placements == (Shard(0),)
    counts = check_against_eager(fn, x, w)
    assert counts["reduce_scatter_tensor"] == 1


def _reduce_twice(x, w):
    y = x @ w  # Partial
    return y.redistribute(y.device_mesh, [Replicate()]) + y.redistribute(y.device_mesh, [Replicate()])


def test_a_collective_repeated_on_the_same_value_and_summed_runs_once(fake_world, monkeypatch):
    monkeypatch.setattr(all_reduce_sums, "ENABLED", True)  # (asked for: the sums round otherwise than eager's)
    fake_world(8)
    mesh = init_device_mesh("cpu", (8,))
    x = distribute_tensor(torch.randn(4, 16), mesh, [Shard(1)])
    w = distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)])
    expected, counts, _ = run_eager(_reduce_twice, x, w)
    assert counts == {"all_reduce": 2}
    jitted = dtcompile.jit(_reduce_twice)
    with torch.no_grad():
        got = jitted(x, w)
    assert_same_metadata(got, expected)
    traces = {str(t).splitlines()[0]: t for t in dtcompile.last_traces(jitted)}
    recorded, after_cse = (
        traces["# computation, as recorded below DTensor"],
        traces["# computation, after common-subexpression elimination"],
    )
    assert [op for op, _ in trace_collectives(recorded)] == ["all_reduce", "all_reduce"]
    # CSE never merges collectives (a merge on some ranks only would make their programs
    # differ); the sum of the two all-reduces is one all-reduce of the sum.
    assert [op for op, _ in trace_collectives(after_cse)] == ["all_reduce", "all_reduce"]
    combined = traces["# computation, after combining summed all-reduces"]
    assert [op for op, _ in trace_collectives(combined)] == ["all_reduce"]
    assert [op for op, _ in trace_collectives(dtcompile.last_traces(jitted)[-2])] == ["all_reduce"]


def _names(trace) -> list[str]:
    return [b.symbol.name.split(".")[1] for b in trace.bound_symbols]


def test_collectives_start_early_and_are_waited_late(fake_world):
    fake_world(8)
    group = dist.group.WORLD.group_name

    def fn(x, y):
        b = x * 2
        a = y.exp()  # independent of the collective: the all_reduce starts before it
        reduced = functional.wait_tensor(functional.all_reduce(b, "sum", group))
        c = y.sin()  # runs while the data is on the wire: the wait moves after it
        y.add_(1)  # a write: nothing crosses it
        return reduced + a + c

    from dtcompile.transforms import schedule_collectives

    x, y = torch.randn(4), torch.randn(4)
    trace = capture_call(fn, (x, y), {}).trace
    assert _names(trace) == ["mul", "exp", "all_reduce", "wait_tensor", "sin", "add_", "add", "add"]
    scheduled = schedule_collectives(trace)
    verify(scheduled)
    assert _names(scheduled) == ["mul", "all_reduce", "exp", "sin", "wait_tensor", "add_", "add", "add"]
    with torch.no_grad():
        dtcompile.jit(fn)(x, y)  # runs (the fake group's values are garbage)


class MirroredAllToAll(TorchDispatchMode):
    """The fake process group's all_to_all writes nothing into its output. This fills it
    as if every rank sent this rank what this rank sends it: integers (an MoE layer's token
    counts) come back as they went, floats (the tokens) as zeros. The data eager and the
    program read from it are then defined and consistent (as many tokens come back as
    went out)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func._opname in ("all_to_all_single", "alltoall_base_"):
            # The functional op (eager) takes (input, ...) and returns the output; c10d's
            # (the compiled program's) takes (output, input, ...).
            output, source = (out, args[0]) if func._opname == "all_to_all_single" else args[:2]
            output.copy_(source) if not source.is_floating_point() else output.zero_()
        return out


def test_moe_on_an_8x8_mesh_holds_eagers_collectives(fake_world):
    """Expert parallelism over 8 ranks, tensor parallelism over 8: counts exchanged, tokens
    dispatched and combined over ep (all_to_all_single), attention's all_reduce over tp;
    the program holds exactly eager's collectives on eager's groups, with split sizes
    read from data at run time."""
    fake_world(64, rank=9)
    mesh = init_device_mesh("cpu", (8, 8), mesh_dim_names=("ep", "tp"))
    model = parallel_moe_block(mesh, dim=64, heads=8, hidden=32, experts=16, top_k=2)
    x = torch.randn(2, 4, 64)
    log = CollectiveLog()
    with torch.no_grad(), log, MirroredAllToAll():
        model(x)
    ep, tp = mesh["ep"].get_group().group_name, mesh["tp"].get_group().group_name
    assert [group for _, group in log.calls] == [tp, ep, ep, ep]
    jitted = dtcompile.jit(model)
    with torch.no_grad(), MirroredAllToAll():
        got = jitted(x)
    assert got.shape == x.shape and got.stride() == x.stride()
    traces = dtcompile.last_traces(jitted)
    for trace in (traces[0], traces[-1]):
        assert trace_collectives(trace) == log.calls, trace
    splits = [b.args[1:3] for b in traces[-1].bound_symbols if b.op is not None and "all_to_all" in b.op._opname]
    assert all(isinstance(n, dtcompile.core.NumberProxy) for s in splits[1:] for n in s[0] + s[1])


def test_work_handles_are_values_of_the_execution_trace(fake_world):
    """A started collective's work handle is a value of the execution trace: the start
    defines it, the wait reads it, and ``verify`` checks that order."""
    fake_world(8)
    group = dist.group.WORLD.group_name

    def fn(x):
        gathered = functional.wait_tensor(functional.all_gather_into_tensor(x * 2, 8, group))
        return functional.wait_tensor(functional.all_reduce(gathered + 1, "sum", group))

    jitted = dtcompile.jit(fn)
    with torch.no_grad():
        jitted(torch.randn(4, 3))
    execution = dtcompile.last_traces(jitted)[-1]
    verify(execution)
    starts = [i for i, b in enumerate(execution.bound_symbols) if isinstance(b.symbol, StartCollective)]
    waits = [i for i, b in enumerate(execution.bound_symbols) if isinstance(b.symbol, WaitCollective)]
    assert len(starts) == len(waits) == 2
    for start, wait in zip(starts, waits):
        tensor, work = execution.bound_symbols[start].output
        assert isinstance(work, FutureProxy) and work.label == f"{tensor.label}_work"
        assert work.provenance == NoProvenance(str(execution.bound_symbols[start].op))
        assert execution.bound_symbols[wait].args == (work, tensor)
        assert f"{work.label}.wait()" in execution.bound_symbols[wait].lines()
    symbols = execution.bound_symbols
    start, wait = starts[0], waits[0]
    work = symbols[start].output[1].label
    wait_first = symbols[:start] + [symbols[wait]] + symbols[start:wait] + symbols[wait + 1 :]
    with pytest.raises(TraceError, match=f"uses {work} before it is defined"):
        verify(execution.derive("the wait before its start", wait_first))
    with pytest.raises(TraceError, match=f"uses {work} before it is defined"):
        verify(execution.derive("no start", symbols[:start] + symbols[start + 1 :]))


class _TiesShardedWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        self.b.weight = self.a.weight  # a DTensor Parameter moved to another module
        return self.b(x)


def test_a_sharded_parameter_assigned_in_the_forward_is_the_parameter_itself(fake_world):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(_TiesShardedWeights(), mesh, {"a": ColwiseParallel(), "b": ColwiseParallel()})
    jitted = dtcompile.jit(model)
    with torch.no_grad():
        for _ in range(2):
            out = jitted(torch.randn(2, 8))
            assert model.b.weight is model.a.weight  # tied as eager ties them, not a copy
            assert type(out) is torch.Tensor and out.shape == (2, 4)  # the local shard, as eager returns it


class _WritesHeldDTensors(torch.nn.Module):
    def __init__(self, mesh, closed_over):
        super().__init__()
        self.closed_over = [closed_over]  # a list: not a module attribute, so closed over when read
        self.register_buffer("total", distribute_tensor(torch.zeros(4), mesh, [Replicate()]))

    def forward(self, x, into_buffer: bool):
        (self.total if into_buffer else self.closed_over[0]).add_(x.sum(0))
        return x * 2


@pytest.mark.parametrize("into_buffer", [True, False], ids=["buffer", "closed over"])
def test_a_held_dtensor_given_the_call_s_graph_is_refused(fake_world, into_buffer):
    """An in-place write of a DTensor that requires grad into a DTensor the call holds gives
    it the call's graph in eager; the compiled call would not (``test_requires_grad.py``
    for plain tensors): refused, the DTensor left as it was."""
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    closed_over = distribute_tensor(torch.zeros(4), mesh, [Replicate()])
    model = _WritesHeldDTensors(mesh, closed_over)
    x = distribute_tensor(torch.ones(2, 4), mesh, [Replicate()]).requires_grad_()
    where = r"buffers\['total'\]" if into_buffer else r"a DTensor of shape \(4,\) it closes over"
    with pytest.raises(dtcompile.TracingError, match=f"changes whether {where}"):
        dtcompile.jit(model)(x, into_buffer)
    assert not model.total.requires_grad and not closed_over.requires_grad


def _squeezes(x):
    x.squeeze_(0)  # DTensor re-indexes Shard(1) as Shard(0) on the caller's object
    return x * 2


@pytest.mark.parametrize("closed_over", [False, True], ids=["argument", "closed over"])
def test_a_dtensor_respecced_in_place_is_refused(fake_world, closed_over):
    """An in-place op that changes a DTensor's spec (``squeeze_`` of a dim before its
    ``Shard``) changes the caller's DTensor in eager; the program changes only its local
    tensor: refused, the DTensor left as it was."""
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.arange(8.0).reshape(1, 8), mesh, [Shard(1)])
    fn = (lambda: _squeezes(x)) if closed_over else _squeezes
    where = "a tensor the call closes over" if closed_over else r"args\[0\]"
    with pytest.raises(dtcompile.TracingError, match=f"changes the sizes or strides of {where}"):
        dtcompile.jit(fn)(*(() if closed_over else (x,)))
    assert x.shape == (1, 8) and x.placements == (Shard(1),) and x._local_tensor.shape == (1, 4)


class _ReturnsAViewOfItsDTensorWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin.weight.t()


def test_a_view_of_a_dtensor_parameter_returned_under_no_grad_is_refused(fake_world):
    """Eager's view of a DTensor parameter under no_grad requires grad; the epilogue would
    rebuild a DTensor that does not: refused, saying so."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(_ReturnsAViewOfItsDTensorWeight(), mesh, {"lin": ColwiseParallel()})
    with torch.no_grad():
        assert model(torch.ones(2, 4)).requires_grad  # eager's
        with pytest.raises(dtcompile.TracingError, match="returns a view of a DTensor of its own that requires grad"):
            dtcompile.jit(model)(torch.ones(2, 4))


def _adds_a_plain_tensor(x, d):
    return x + d  # a plain tensor of several elements beside a DTensor: eager raises


def test_a_plain_tensor_beside_a_dtensor_raises_eager_s_error_under_symbolic_values(fake_world):
    """DTensor asks a plain tensor beside a DTensor for its element count; a symbolic one
    made torch raise "Cannot call numel() on tensor with symbolic sizes". Now eager's
    error, under both cache options."""
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    x, d = torch.randn(4, 4), distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    message = "got mixed torch.Tensor and DTensor"
    with pytest.raises(RuntimeError, match=message):
        _adds_a_plain_tensor(x, d)
    for cache in ("constant values", "symbolic values"):
        with pytest.raises(RuntimeError, match=message):
            dtcompile.jit(_adds_a_plain_tensor, cache=cache)(x, d)


@pytest.mark.parametrize(
    "index", [lambda x: x[:, 3], lambda x: x[:, 1:3], lambda x: x[:, None], lambda x: x[:, -1]], ids=range(4)
)
def test_a_full_slice_of_a_sharded_dim_keeps_eagers_placements_under_symbolic_values(fake_world, index):
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    jitted = dtcompile.jit(index, cache="symbolic values")
    for rows in (6, 8):  # evenly sharded: symbolic sizes (where ``x[:]``'s end was not known to cover them)
        x = distribute_tensor(torch.randn(rows, 4), mesh, [Shard(0)])
        expected, got = index(x), jitted(x)
        assert got.placements == expected.placements
        assert got.to_local().shape == expected.to_local().shape
    assert dtcompile.cache_misses(jitted) == 1


def test_an_assertion_of_dtensor_about_symbolic_sizes_traces_the_sizes_as_they_are(fake_world):
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    got = dtcompile.jit(lambda x: x.argmax(), cache="symbolic values")(x)  # its shard offsets must be ints
    assert got.placements == x.argmax().placements and got.shape == x.argmax().shape


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_dtensor_returned_twice_is_one_object(fake_world, cache, grad):
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)]).requires_grad_(grad)

    def twice(x):
        y = x * 2
        return y, y, {"y": y}

    a, b, c = dtcompile.jit(twice, cache=cache)(x)
    assert a is b and a is c["y"]
    assert a.placements == (Shard(0),) and a.requires_grad is grad


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_clipping_the_gradients_of_dtensor_arguments_is_refused(fake_world, cache):
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    p = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]).requires_grad_()
    p.grad = p.detach() * 3
    with torch.no_grad(), pytest.raises(dtcompile.TracingError, match=r"reads \.grad"):
        dtcompile.jit(lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0), cache=cache)([p])


@pytest.mark.parametrize(
    "fn",
    [lambda a: f"{a}", lambda a: f"{a}", lambda a: (setattr(a._local_tensor, "tag", 1), a * 2)[1]],
    ids=["f-string", "str.format", "attribute of the local tensor"],
)
def test_a_dtensor_formatted_or_its_local_tensor_given_an_attribute_is_refused(fake_world, fn):
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    with pytest.raises(dtcompile.TracingError, match="into text|attribute 'tag'"):
        dtcompile.jit(fn)(x)
    assert vars(x._local_tensor) == {}


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_a_dtensors_local_tensor_passed_too_is_guarded_by_identity(fake_world, cache):
    """Traced with a tensor apart from a DTensor argument's local tensor, then called with
    that local tensor: code asking ``y is dt._local_tensor`` gets eager's answer."""
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))

    def f(dt, y):
        return dt.to_local() + y + (100 if y is dt._local_tensor else 1)

    jitted = dtcompile.jit(f, cache=cache)
    dt = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    with torch.no_grad():
        for y in (torch.ones(4), dt._local_tensor, torch.ones(4)):
            torch.testing.assert_close(jitted(dt, y), f(dt, y), rtol=0, atol=0)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_a_tensor_parallel_model_under_inference_mode_compiles_once_for_every_length(fake_world, cache):
    """Under ``inference_mode`` DTensor's sharding propagation computes on meta tensors
    outside its fake mode: those ops are not the program's (they were once recorded, their
    meta tensors captured as inputs sized by the first call, and a symbolic program
    compiled again for every length; the prologue's autocast check then raised on them).
    (A fake process group's collectives compute nothing: metadata is compared, as above.
    Torch 2.10's DTensor refuses a symbolic size in this block's reshape under
    inference_mode: the call is traced with its sizes, once per length.)"""
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    model = parallel_block(mesh, dim=32, n_heads=4, hidden=64)
    jitted = dtcompile.jit(model, cache=cache)
    for length in (6, 9, 4):
        x = torch.randn(2, length, 32)
        with torch.inference_mode():
            got = jitted(x)
        with torch.no_grad():
            expected = model(x)
        assert_same_metadata(got, expected)
    symbolic = cache == "symbolic values" and torch.__version__ >= "2.13"
    assert dtcompile.cache_misses(jitted) == (1 if symbolic else 3)
    assert not any("captured" in str(p.provenance) for p in dtcompile.last_traces(jitted)[0].inputs)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("fn", [torch.sgn, torch.copysign], ids=["sgn", "copysign"])
def test_a_gradient_torch_makes_as_a_plain_zero_tensor_is_made_at_each_backward(fake_world, fn, cache):
    # Over DTensors, sgn's gradient (and copysign's for its second input) is a plain,
    # memory-less zero tensor of no traced op: the backward trace held it as a constant it
    # could not print (Unprintable). Replicated inputs: nothing is communicated, values hold.
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    values = [torch.randn(4, 3) for _ in range(2 if fn is torch.copysign else 1)]

    def grads(f):
        inputs = [distribute_tensor(v.clone(), mesh, [Replicate()]).requires_grad_() for v in values]
        f(*inputs).sum().backward()
        return [x.grad for x in inputs]

    jitted = dtcompile.jit(fn, cache=cache)
    if fn is torch.sgn and cache == "symbolic values":  # (DTensor's sgn backward asks a symbolic size)
        with pytest.raises(dtcompile.TracingError, match="the backward of the call cannot take symbolic sizes"):
            grads(jitted)
        return
    for _ in range(2):  # (a new tensor at each backward: the first's .grad is not the second's)
        for got, expected in zip(grads(jitted), grads(fn)):
            assert type(got) is type(expected)
            if not isinstance(got, DTensor):  # (eager's is memory-less: a write into it raises)
                assert got._is_zerotensor() == expected._is_zerotensor()
            got, expected = [g.full_tensor() if isinstance(g, DTensor) else g for g in (got, expected)]
            assert torch.equal(got, expected) and got.stride() == expected.stride()


def test_torch_code_asking_a_symbolic_dtensor_for_a_size_is_refused_clearly(fake_world):
    # torch.gradient's C++ code asks a DTensor of symbolic sizes for one: torch's raw "could
    # not look up op for aten::size"; a refusal naming the call now (constant values compile).
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.randn(6), mesh, [Replicate()])
    assert torch.equal(dtcompile.jit(torch.gradient)(x)[0].to_local(), torch.gradient(x)[0].to_local())
    with pytest.raises(dtcompile.TracingError, match="torch.gradient cannot take symbolic sizes"):
        dtcompile.jit(torch.gradient, cache="symbolic values")(x)


@pytest.mark.parametrize(
    "fn", [lambda x: torch.geqrf(x)[0], lambda x: torch.histogram(x, 4)[0]], ids=["geqrf", "histogram"]
)
def test_an_op_dtensor_propagates_on_fakes_without_a_fake_kernel_is_refused_clearly(fake_world, fn):
    # Under symbolic values DTensor's sharding propagation runs the op on fake tensors, which
    # have no kernel for it: its raw "Sharding propagation failed" RuntimeError, where eager
    # runs (geqrf) or raises NotImplementedError (histogram).
    fake_world(2)
    x = distribute_tensor(torch.randn(4, 4), init_device_mesh("cpu", (2,)), [Replicate()])
    with pytest.raises(dtcompile.TracingError, match="cannot take symbolic sizes"):
        dtcompile.jit(fn, cache="symbolic values")(x)


def test_a_checkpoint_around_a_compiled_tp_block_runs_as_eagers(fake_world):
    """A non-reentrant checkpoint around a compiled TP block whose norm takes the call's
    input raised autograd's "backward through the graph a second time" (its recompute ran
    on the real inputs while the backward was traced). The fake group's collectives leave
    their outputs unset, so only what the gradients are is compared (the 2-rank run of the
    same, with values: tests/distributed/test_training.py)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils.checkpoint import checkpoint

    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.RMSNorm(4), torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        block = parallelize_module(block, mesh, {"1": ColwiseParallel(), "2": RowwiseParallel()})
        called = dtcompile.jit(block) if compiled else block
        x = torch.randn(3, 4, requires_grad=True)
        checkpoint(called, x, use_reentrant=False).sum().backward()
        grads.append([x.grad, block[0].weight.grad, block[1].weight.grad.to_local()])
    for got, expected in zip(grads[1], grads[0]):
        assert (got.shape, got.stride(), got.dtype) == (expected.shape, expected.stride(), expected.dtype)
