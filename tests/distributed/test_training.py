"""Training on Gloo ranks: compiled forward and backward compared with eager DTensor.

Each rank function builds an eager model and an identical one to compile (same seed),
runs both on the same data and compares outputs, input gradients and parameter gradients
(types, placements, local shapes, and values through ``full_tensor``). Several cases run
per ``pool.run`` to keep the number of round trips (and the runtime) low.
"""

import re

import pytest
import torch
import torch.distributed as dist
from collective_counts import comm_counts, executed_counts, trace_counts
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtcompile
from dtcompile.testing.models import parallel_block, parallel_mlp

DIM, HEADS, HIDDEN, SEQ = 16, 4, 32, 8
KINDS = ("mlp", "block", "block-sp")
BF16 = {"atol": 2e-2, "rtol": 2e-2}


def _meshes(mesh_shape):
    """The mesh and its tensor-parallel part (``mesh["tp"]`` on a dp x tp mesh)."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape) :])
    return mesh, (mesh["tp"] if len(mesh_shape) == 2 else mesh)


def _model(kind, tp):
    if kind == "mlp":
        return parallel_mlp(tp, dim=DIM, hidden=HIDDEN)
    return parallel_block(tp, dim=DIM, n_heads=HEADS, hidden=HIDDEN, sequence_parallel=kind == "block-sp")


def _models(kind, tp):
    """An eager model, an identical one, and the identical one compiled."""
    eager, compiled = _model(kind, tp), _model(kind, tp)
    return eager, compiled, dtcompile.jit(compiled)


def _batch(kind, mesh, tp, step):
    """Each step's input and cotangent: the same on the ranks of a tp group, different
    across dp ranks; with sequence parallelism each rank takes its sequence shard."""
    dp_rank = mesh["dp"].get_local_rank() if mesh.ndim == 2 else 0
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    x, cotangent = (torch.randn(2, SEQ, DIM, generator=generator) for _ in range(2))
    if kind == "block-sp":
        x, cotangent = (t.chunk(tp.size(), dim=1)[tp.get_local_rank()].contiguous() for t in (x, cotangent))
    return x, cotangent


def _waited(t):
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def assert_same(got, expected, **tolerance):
    """The same type (DTensor, or plain tensor where eager may give an unwaited
    AsyncCollectiveTensor), placements, global and local shapes, and values."""
    assert (got is None) == (expected is None), (got, expected)
    if expected is None:
        return
    if isinstance(expected, DTensor):
        assert type(got) is DTensor, type(got)
        assert got.placements == expected.placements, (got.placements, expected.placements)
        assert got.device_mesh == expected.device_mesh
        assert got.shape == expected.shape
        assert got._local_tensor.shape == expected._local_tensor.shape
        torch.testing.assert_close(got.full_tensor(), expected.full_tensor(), **tolerance)
    else:
        assert type(got) is torch.Tensor, type(got)
        torch.testing.assert_close(got, _waited(expected), **tolerance)


def assert_same_grads(compiled_model, eager_model, **tolerance):
    got, expected = dict(compiled_model.named_parameters()), dict(eager_model.named_parameters())
    assert list(got) == list(expected)
    for name in expected:
        try:
            assert_same(got[name].grad, expected[name].grad, **tolerance)
        except AssertionError as error:
            raise AssertionError(f"gradient of {name}: {error}") from error


def assert_same_parameters(compiled_model, eager_model, **tolerance):
    for (name, got), (_, expected) in zip(compiled_model.named_parameters(), eager_model.named_parameters()):
        try:
            assert_same(got.detach(), expected.detach(), **tolerance)
        except AssertionError as error:
            raise AssertionError(f"parameter {name}: {error}") from error


def _counts(jitted):
    return dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)


# ---------------------------------------------------------------------------------------
# Forward and backward of tensor-parallel models


def forward_backward(mesh_shape):
    """MLP, Llama block and Llama block with sequence parallelism: two steps each (a miss,
    then a hit with new data); returns each model's (misses, hits)."""
    mesh, tp = _meshes(mesh_shape)
    counts = {}
    for kind in KINDS:
        eager, compiled, jitted = _models(kind, tp)
        for step in range(2):
            x, cotangent = _batch(kind, mesh, tp, step)
            x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
            expected, got = eager(x_eager), jitted(x_compiled)
            assert got.requires_grad and got.grad_fn is not None
            assert_same(got.detach(), expected.detach())
            expected.backward(cotangent)
            got.backward(cotangent)
            assert_same(x_compiled.grad, x_eager.grad)
            assert_same_grads(compiled, eager)
            eager.zero_grad(set_to_none=True)
            compiled.zero_grad(set_to_none=True)
        counts[kind] = _counts(jitted)
    return counts


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2 ranks", "4 ranks", "dp2 x tp2"])
def test_forward_and_backward_match_eager(mesh_shape, ranks2, ranks4):
    pool = ranks2 if mesh_shape == (2,) else ranks4
    for counts in pool.run(forward_backward, mesh_shape):
        assert counts == {kind: (1, 1) for kind in KINDS}


# ---------------------------------------------------------------------------------------
# Optimizer steps, gradient accumulation, frozen parameters


OPTIMIZERS = {
    "AdamW foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
    "AdamW for-loop": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False),
    "SGD foreach": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9, foreach=True),
    "SGD for-loop": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9, foreach=False),
}


def optimizer_steps(kind, steps=5):
    """``steps`` optimizer steps with each optimizer: the compiled model's losses and
    parameters are eager's after every step; returns each optimizer's (misses, hits)."""
    mesh, tp = _meshes((dist.get_world_size(),))
    counts = {}
    for name, make_optimizer in OPTIMIZERS.items():
        eager, compiled, jitted = _models(kind, tp)
        optimizers = make_optimizer(eager.parameters()), make_optimizer(compiled.parameters())
        for step in range(steps):
            x, target = _batch(kind, mesh, tp, step)
            losses = []
            for model, optimizer in zip((eager, jitted), optimizers):
                optimizer.zero_grad()
                loss = (model(x) - target).pow(2).mean()
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
            assert_same(losses[1], losses[0])
            assert_same_parameters(compiled, eager)
        counts[name] = _counts(jitted)
    return counts


# Not the block without sequence parallelism: its norm weights are plain tensors beside
# DTensors, which eager's foreach optimizers reject.
@pytest.mark.parametrize("kind", ["mlp", "block-sp"])
def test_optimizer_steps_match_eager_with_one_compilation(kind, ranks2):
    for counts in ranks2.run(optimizer_steps, kind):
        assert counts == {name: (1, 4) for name in OPTIMIZERS}


def accumulation_and_frozen_parameters():
    mesh, tp = _meshes((2,))
    eager, compiled, jitted = _models("block", tp)
    # Gradient accumulation: three backward calls, then one step.
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    for step in range(3):
        x, cotangent = _batch("block", mesh, tp, step)
        eager(x).backward(cotangent / 3)
        jitted(x).backward(cotangent / 3)
        assert_same_grads(compiled, eager)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_same_parameters(compiled, eager)
    accumulated = _counts(jitted)

    # Frozen parameters get no gradient, as in eager; requires_grad is guarded.
    frozen = ("attn.q.weight", "attn_norm.weight", "mlp.down.weight")
    for model in (eager, compiled):
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)
    x, cotangent = _batch("block", mesh, tp, 3)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager(x_eager).backward(cotangent)
    jitted(x_compiled).backward(cotangent)
    assert all(compiled.get_parameter(name).grad is None for name in frozen)
    assert_same_grads(compiled, eager)
    assert_same(x_compiled.grad, x_eager.grad)
    with_frozen = _counts(jitted)

    # Everything frozen and an input without grad: no backward at all, as in eager.
    for model in (eager, compiled):
        model.requires_grad_(False)
    expected, got = eager(x), jitted(x)
    assert not got.requires_grad and not expected.requires_grad
    assert_same(got, expected)
    all_frozen = _counts(jitted)

    # Unfrozen again: the first entry, and its gradients are right.
    for model in (eager, compiled):
        model.requires_grad_(True)
        model.zero_grad(set_to_none=True)
    eager(x).backward(cotangent)
    jitted(x).backward(cotangent)
    assert_same_grads(compiled, eager)
    return accumulated, with_frozen, all_frozen, _counts(jitted)


def test_gradient_accumulation_and_frozen_parameters(ranks2):
    for counts in ranks2.run(accumulation_and_frozen_parameters):
        assert counts == ((1, 2), (2, 2), (3, 2), (3, 3))


def checkpoint_around_the_compiled_block():
    """torchtitan's order: a non-reentrant checkpoint around a compiled TP block whose norm
    takes the call's input (its recompute ran on the real inputs while the backward was
    traced: autograd's "backward through the graph a second time")."""
    from torch.utils.checkpoint import checkpoint

    mesh, tp = _meshes((2,))
    eager, compiled, jitted = _models("block", tp)
    for step in range(3):
        x, cotangent = _batch("block", mesh, tp, step)
        x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
        checkpoint(eager, x_eager, use_reentrant=False).backward(cotangent)
        checkpoint(jitted, x_compiled, use_reentrant=False).backward(cotangent)
        assert_same(x_compiled.grad, x_eager.grad)
        assert_same_grads(compiled, eager)
    return dtcompile.cache_misses(jitted)


def test_a_checkpoint_around_the_compiled_block_gives_eagers_gradients(ranks2):
    assert ranks2.run(checkpoint_around_the_compiled_block) == [1, 1]


# ---------------------------------------------------------------------------------------
# Cotangents with other placements than traced; autograd.grad with respect to inputs


def _tanh_of_matmul(x, w):
    return torch.tanh(x @ w)


LOSSES = {
    # Redistributing or gathering the output sends back a Shard(0) cotangent...
    "redistribute": lambda out, mesh: out.redistribute(mesh, [Replicate()]).pow(2).sum(),
    "full_tensor": lambda out, mesh: out.full_tensor().pow(2).sum(),
    # ... reducing it sends back a Replicate one (sum's backward expands a Replicate scalar).
    "sum": lambda out, mesh: out.sum().full_tensor(),
    "mean": lambda out, mesh: (out * 3).mean().full_tensor(),
}


def _recorder(arrived: dict, name: str):
    """A tensor hook that notes the placements of the gradient that reaches the tensor."""

    def hook(grad):
        arrived[name] = grad.placements

    return hook


def cotangent_placements():
    """Outputs and gradients of DTensor inputs for losses whose cotangent comes back with
    the traced placements or others; returns the placements of the cotangent each loss
    sent to the compiled output, and (misses, hits)."""
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()])
    jitted = dtcompile.jit(_tanh_of_matmul)
    arrived = {}
    for name, loss in LOSSES.items():
        grads = []
        for fn in (_tanh_of_matmul, jitted):
            xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
            out = fn(xs, ws)
            assert out.placements == (Shard(0),)
            if fn is jitted:
                out.register_hook(_recorder(arrived, name))
            loss(out, mesh).backward()
            grads.append((out.detach(), xs.grad, ws.grad))
        for got, expected in zip(grads[1], grads[0]):
            assert_same(got, expected)

    # A Partial output: eager's backward of its reduction sends back a Replicate cotangent.
    def partial_matmul(x, w):
        return x @ w

    x1 = distribute_tensor(torch.randn(8, 4), mesh, [Shard(1)])
    w0 = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
    jitted_partial = dtcompile.jit(partial_matmul)
    grads = []
    for fn in (partial_matmul, jitted_partial):
        xs, ws = x1.detach().requires_grad_(), w0.detach().requires_grad_()
        out = fn(xs, ws)
        assert out.placements == (Partial(),)
        if fn is jitted_partial:
            out.register_hook(_recorder(arrived, "partial"))
        out.redistribute(mesh, [Replicate()]).pow(2).sum().full_tensor().backward()
        grads.append((out.detach(), xs.grad, ws.grad))
    for got, expected in zip(grads[1], grads[0]):
        assert_same(got, expected)
    return arrived, _counts(jitted), _counts(jitted_partial)


def test_cotangents_with_other_placements_than_traced(ranks2):
    for arrived, counts, partial_counts in ranks2.run(cotangent_placements):
        assert counts == (1, len(LOSSES) - 1) and partial_counts == (1, 0)
        # The cases that exercise redistributing the cotangent really do.
        assert arrived["sum"] == arrived["mean"] == (Replicate(),)
        assert arrived["partial"] == (Replicate(),)


def grad_with_respect_to_inputs():
    mesh, tp = _meshes((2,))
    # A module's plain-tensor input: autograd.grad gives it, and no parameter gets .grad.
    eager, compiled, jitted = _models("block-sp", tp)
    x, cotangent = _batch("block-sp", mesh, tp, 0)
    grads = []
    for model in (eager, jitted):
        xs = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(model(xs), xs, cotangent)
        grads.append(grad)
    assert_same(grads[1], grads[0])
    assert all(p.grad is None for m in (eager, compiled) for p in m.parameters())
    # Parameters and input together, in one call.
    params = {name: list(m.parameters()) for name, m in (("eager", eager), ("compiled", compiled))}
    xs = [x.clone().requires_grad_() for _ in range(2)]
    expected = torch.autograd.grad(eager(xs[0]), [xs[0], *params["eager"]], cotangent)
    got = torch.autograd.grad(jitted(xs[1]), [xs[1], *params["compiled"]], cotangent)
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)

    # DTensor inputs that require grad; gradients for one of them, then for both.
    torch.manual_seed(0)
    a = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()]).requires_grad_()
    jitted_fn = dtcompile.jit(_tanh_of_matmul)
    for wrt in ([0], [1], [0, 1]):
        results = []
        for fn in (_tanh_of_matmul, jitted_fn):
            inputs = (a, b)
            out = fn(*inputs)
            results.append(torch.autograd.grad(out.sum().full_tensor(), [inputs[i] for i in wrt]))
        for g, e in zip(results[1], results[0], strict=True):
            assert_same(g, e)
    assert a.grad is None and b.grad is None
    return _counts(jitted), _counts(jitted_fn)


def test_autograd_grad_with_respect_to_inputs(ranks2):
    for counts in ranks2.run(grad_with_respect_to_inputs):
        assert counts == ((1, 1), (1, 2))


def grad_inside_with_respect_to_closed_over_parameters():
    """A step function closing over a TP model that takes its parameters' gradients with
    torch.autograd.grad inside the call: autograd was given the real DTensors, which the
    traced graph does not hold (an error, or zeros with allow_unused)."""
    mesh, tp = _meshes((2,))
    eager, compiled, _ = _models("mlp", tp)
    x, _ = _batch("mlp", mesh, tp, 0)

    def step_of(model):
        params = list(model.parameters())

        def step(x):
            loss = model(x).sum()
            grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
            return loss.detach(), grads

        return step

    expected = step_of(eager)(x)
    for _ in range(2):
        got = dtcompile.jit(step_of(compiled))(x)
        assert_same(got[0], expected[0])
        for g, e in zip(got[1], expected[1], strict=True):
            assert_same(g, e)
    return True


def test_autograd_grad_inside_with_respect_to_closed_over_parameters(ranks2):
    assert ranks2.run(grad_inside_with_respect_to_closed_over_parameters) == [True, True]


# ---------------------------------------------------------------------------------------
# What the cache guards: grad mode, autocast


def grad_mode_entries():
    mesh, tp = _meshes((2,))
    eager, compiled, jitted = _models("mlp", tp)
    seen = []
    for step, grad_mode in enumerate((False, True, False, True, True, False)):
        x, cotangent = _batch("mlp", mesh, tp, step)
        with torch.set_grad_enabled(grad_mode):
            expected, got = eager(x), jitted(x)
        assert got.requires_grad == expected.requires_grad == grad_mode
        assert_same(got.detach(), expected.detach())
        if grad_mode:
            expected.backward(cotangent)
            got.backward(cotangent)
            assert_same_grads(compiled, eager)
            eager.zero_grad(set_to_none=True)
            compiled.zero_grad(set_to_none=True)
        seen.append(_counts(jitted))
    return seen


def test_grad_mode_is_guarded_and_both_entries_stay(ranks2):
    for seen in ranks2.run(grad_mode_entries):
        assert seen == [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4)]


def autocast_bf16():
    """bf16 activations with fp32 parameters: a few SGD steps under autocast, then a call
    without it (a miss), then autocast again (a hit)."""
    mesh, tp = _meshes((2,))
    seen = []
    for kind in ("mlp", "block"):
        eager, compiled, jitted = _models(kind, tp)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
        for step, autocast in enumerate((True, True, False, True)):
            x, target = _batch(kind, mesh, tp, step)
            results = []
            for model in (eager, jitted):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out = model(x)
                    loss = (out.float() - target).pow(2).mean()
                loss.backward()
                results.append((out.detach(), loss.detach()))
            (expected, expected_loss), (got, got_loss) = results
            # The MLP's output is a linear's: bf16 under autocast. The block's adds the
            # fp32 residual: fp32 either way.
            assert got.dtype == _waited(expected).dtype
            assert (got.dtype == torch.bfloat16) == (autocast and kind == "mlp")
            tolerance = BF16 if autocast else {}
            assert_same(got, expected, **tolerance)
            assert_same(got_loss, expected_loss, **tolerance)
            assert_same_grads(compiled, eager, **tolerance)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            assert all(p.dtype == torch.float32 for p in compiled.parameters())
            assert_same_parameters(compiled, eager, **tolerance)
        seen.append(_counts(jitted))
    return seen


def test_autocast_bf16_matches_eager_and_is_guarded(ranks2):
    for seen in ranks2.run(autocast_bf16):
        assert seen == [(2, 2), (2, 2)]


# ---------------------------------------------------------------------------------------
# Double backward


def double_backward(penalty):
    """A gradient penalty through a compiled block: eager computes it; compiled must raise."""
    mesh, tp = _meshes((2,))
    eager, compiled, jitted = _models("mlp", tp)
    x, _ = _batch("mlp", mesh, tp, 0)

    def gradient_penalty(model):
        xs = x.clone().requires_grad_()
        out = model(xs)
        loss = out.pow(2).sum() if penalty else out.sum()
        (grad,) = torch.autograd.grad(loss, xs, create_graph=True)
        (loss + grad.pow(2).sum()).backward()

    gradient_penalty(eager)
    try:
        gradient_penalty(jitted)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("penalty", [False, True], ids=["cotangent without grad", "cotangent with grad"])
def test_double_backward_is_a_clear_error(penalty, ranks2):
    for message in ranks2.run(double_backward, penalty):
        assert message is not None, "create_graph=True through a compiled step gave a result"
        assert re.search("create_graph|double backward|differentiate twice", message), message


# ---------------------------------------------------------------------------------------
# The printed traces of a training entry


def _saved_inputs(backward) -> list[str]:
    return [p.label for p in backward.inputs if backward.input_notes.get(p.label) == "saved by the forward"]


def _eager_saved_bytes(model, x) -> int:
    """The memory eager autograd keeps alive for the backward beyond the inputs: each
    storage of a tensor it saves (a DTensor's local tensor), once, except the inputs'."""
    saved = []

    def pack(t):
        saved.append(t._local_tensor if isinstance(t, DTensor) else t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    inputs = [x, *(p._local_tensor if isinstance(p, DTensor) else p for p in model.parameters())]
    input_storages = {t.untyped_storage().data_ptr() for t in inputs}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in input_storages)


def training_traces():
    mesh, tp = _meshes((2,))
    for kind in KINDS:
        eager, compiled, jitted = _models(kind, tp)
        x, cotangent = _batch(kind, mesh, tp, 0)
        x = torch.cat([x] * 8)  # activations big enough for the header's MiB to tell
        cotangent = torch.cat([cotangent] * 8)
        jitted(x.clone().requires_grad_())  # compiles; the counted calls below hit the cache
        x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
        with CommDebugMode() as eager_forward_comms:
            expected = eager(x_eager)
        with CommDebugMode() as compiled_forward_comms:
            got = jitted(x_compiled)
        with CommDebugMode() as eager_comms:
            expected.backward(cotangent)
        with CommDebugMode() as compiled_comms:
            got.backward(cotangent)
        assert_same_grads(compiled, eager)
        assert _counts(jitted) == (1, 1)

        traces = dtcompile.last_traces(jitted)
        executed = [t for t in traces if t.title.startswith("execution trace")]
        assert [t.fn_name for t in executed] == ["forward", "backward"], [t.title for t in traces]
        forward, backward = executed
        recorded_backward = next(t for t in traces if t.fn_name == "backward")
        # The backward DTensor recorded issues eager's collectives; what runs issues
        # those of the backward execution trace, and no others.
        eager_counts = comm_counts(eager_comms)
        assert eager_counts and trace_counts(recorded_backward) == eager_counts, kind
        assert comm_counts(compiled_comms) == executed_counts(backward), kind
        if kind != "block":  # nothing to combine: exactly eager's collectives
            assert trace_counts(backward) == eager_counts, kind
        else:  # summed all-reduces may be combined, nothing else changes
            assert set(trace_counts(backward)) == set(eager_counts), kind
            assert trace_counts(backward) <= eager_counts, kind
        # Likewise the forward: eager forward's collectives, all in the forward program.
        eager_forward = comm_counts(eager_forward_comms)
        assert comm_counts(compiled_forward_comms) == executed_counts(forward), kind
        assert trace_counts(forward) <= eager_forward and set(trace_counts(forward)) == set(eager_forward)

        # The forward's header states the saved set and its size.
        text = str(forward)
        match = re.search(
            r"^# saved for the backward: (\d+) tensors? holding ([\d.]+) MiB beyond the inputs: (.*)$", text, re.M
        )
        assert match, text
        names = match[3].split(", ")
        saved = _saved_inputs(backward)
        assert int(match[1]) == len(names) == len(saved), (kind, names, saved)
        # The forward returns the call's output, then the saved values, which the backward
        # takes first, in the same order and with the same local shapes.
        outputs = torch.utils._pytree.tree_flatten(forward.output)[0]
        assert [p.label for p in outputs[1:]] == names, kind
        assert [p.shape for p in outputs[1:]] == [p.shape for p in backward.inputs[: len(saved)]], kind
        # The size is what eager autograd keeps alive for the same backward.
        eager_bytes = _eager_saved_bytes(eager, x.clone().requires_grad_())
        assert float(match[2]) > 0 and match[2] == f"{eager_bytes / 2**20:.3f}", (kind, match[2], eager_bytes)
        # The header is a comment of a printed program whose code is what runs.
        assert text.splitlines()[0] == f"# {forward.title}"
    return True


def test_training_traces_hold_eager_collectives_and_the_saved_set(ranks2):
    assert ranks2.run(training_traces) == [True, True]


def saved_names():
    """The saved values' names in the forward's header and in the backward's signature."""
    mesh, tp = _meshes((2,))
    _, _, jitted = _models("mlp", tp)
    jitted(_batch("mlp", mesh, tp, 0)[0].requires_grad_())
    forward, backward = (t for t in dtcompile.last_traces(jitted) if t.title.startswith("execution trace"))
    header = next(line for line in str(forward).splitlines() if line.startswith("# saved for the backward:"))
    return header.rsplit(": ", 1)[1].split(", "), _saved_inputs(backward)


def test_saved_values_have_one_name_in_the_forward_and_the_backward(ranks2):
    # A reader matches the header's names with the backward's parameters.
    for names, saved in ranks2.run(saved_names):
        assert names == saved
