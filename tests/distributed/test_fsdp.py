"""FSDP2 (``fully_shard``) compiled, against eager FSDP2 on the same mesh.

Each case builds two identical models (same seed), applies the same ``fully_shard`` calls
to both (per submodule, then the root), compiles one and trains both with AdamW on the
same batches (different on each dp rank): the losses, the gradients (DTensors sharded as
FSDP2 shards them, compared by placements, local shape and values) and the parameters
after each step are eager's; then two evaluation calls under ``no_grad``. A 1-D dp mesh of
2 Gloo ranks, and a dp x tp mesh of 2x2 with TP inside each block.
"""

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

import dtcompile
from dtcompile.capture.fsdp import UnsupportedFSDPError
from dtcompile.testing.compare import assert_same
from dtcompile.testing.models import MLP, LlamaModel, parallel_llama

VOCAB, DIM, HEADS, HIDDEN, SEQ = 64, 16, 4, 32, 8
BF16 = {"atol": 2e-2, "rtol": 2e-2}
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mesh(mesh_shape):
    if len(mesh_shape) == 1:
        return init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp",)), None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def _model(kind, dp, tp, **fsdp):
    """The model, ``fully_shard`` on each block (the MLP: each linear) and on the root."""
    if kind == "mlp":
        torch.manual_seed(0)
        model = MLP(DIM, HIDDEN)
        blocks = [model.up, model.down]
    elif tp is None:
        torch.manual_seed(0)
        model = LlamaModel(VOCAB, DIM, layers=2, n_heads=HEADS, hidden=HIDDEN)
        blocks = list(model.layers)
    else:
        model = parallel_llama(tp, vocab=VOCAB, dim=DIM, layers=2, n_heads=HEADS, hidden=HIDDEN)
        blocks = list(model.layers)
    for block in blocks:
        fully_shard(block, mesh=dp, **fsdp)
    return fully_shard(model, mesh=dp, **fsdp)


def _batch(kind, dp, step):
    generator = torch.Generator().manual_seed(100 * step + dp.get_local_rank())
    if kind == "mlp":
        return torch.randn(4, SEQ, DIM, generator=generator)
    return torch.randint(0, VOCAB, (2, SEQ), generator=generator)


def _loss(out):
    out = out.full_tensor() if isinstance(out, DTensor) else out
    return out.float().pow(2).mean()


def _assert_grads(compiled, eager, **tolerance):
    for (name, got), (_, expected) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        assert type(got.grad) is DTensor, (name, type(got.grad))
        assert_same(got.grad, expected.grad, f"gradient of {name}", **tolerance)


def _assert_parameters(compiled, eager, **tolerance):
    for (name, got), (_, expected) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        assert_same(got.detach(), expected.detach(), f"parameter {name}", **tolerance)


def train_and_evaluate(mesh_shape, kind, mixed_precision=False, steps=3, **fsdp):
    """AdamW steps, then two ``no_grad`` calls; returns (misses, hits) after training and
    after evaluation, and the collectives of the last training entry's programs."""
    dp, tp = _mesh(mesh_shape)
    if mixed_precision:
        fsdp["mp_policy"] = MP
    tolerance = BF16 if mixed_precision else {}
    eager, compiled = _model(kind, dp, tp, **fsdp), _model(kind, dp, tp, **fsdp)
    jitted = dtcompile.jit(compiled)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (eager, compiled)]
    for step in range(steps):
        x = _batch(kind, dp, step)
        losses = []
        for model, optimizer in zip((eager, jitted), optimizers):
            optimizer.zero_grad()
            loss = _loss(model(x))
            loss.backward()
            losses.append(loss.detach())
        assert_same(losses[1], losses[0], f"loss of step {step}", **tolerance)
        _assert_grads(compiled, eager, **tolerance)
        for optimizer in optimizers:
            optimizer.step()
        _assert_parameters(compiled, eager, **tolerance)
    trained = (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted))
    traces = dtcompile.last_traces(jitted)
    programs = "\n".join(str(t) for t in traces if t.title.startswith("execution"))
    with torch.no_grad():
        for step in range(2):
            x = _batch(kind, dp, steps + step)
            assert_same(jitted(x), eager(x), f"evaluation call {step}", **tolerance)
    return trained, (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)), programs


def _gathers(programs: str) -> tuple[int, int]:
    """How many all-gathers the forward and the backward execution traces run."""
    forward, backward = programs.split("def backward")
    return forward.count("all_gather_single("), backward.count("all_gather_single(")


# kind, options, and the all-gathers the backward runs again: one per FSDP group (each
# block) that reshards after forward (every block but the root, unless
# reshard_after_forward=False) and whose parameters the backward needs, which the forward
# then does not keep for the backward. The MLP's first weight is not needed: its input
# needs no gradient.
CASES_1D = {
    "mlp": ("mlp", {}, 1),
    "llama": ("llama", {}, 2),
    "llama, reshard_after_forward=False": ("llama", {"reshard_after_forward": False}, 0),
    "llama, bf16 params, fp32 reduce": ("llama", {"mixed_precision": True}, 2),
}


@pytest.mark.parametrize("case", list(CASES_1D))
def test_fsdp_training_on_a_dp_mesh_matches_eager(case, ranks2):
    kind, options, regathered = CASES_1D[case]
    for trained, evaluated, programs in ranks2.run(train_and_evaluate, (2,), kind, **options):
        assert trained == (1, 2) and evaluated == (2, 3)
        # The parameters' all-gathers and the gradients' reduce-scatters are collectives of
        # the per-rank programs (the forward's, the backward's): one per FSDP group, as
        # FSDP2 buckets them (the MLP: each linear; the Llama model: each block, and the
        # root's embedding, norm and head).
        groups = 2 if kind == "mlp" else 3
        assert _gathers(programs) == (groups, regathered)
        assert len(re.findall(r"dist\.reduce_scatter_(?:single|tensor)\(", programs.split("def backward")[1])) == groups


CASES_2D = {
    "llama": {},
    "llama, bf16 params, fp32 reduce": {"mixed_precision": True},
}


@pytest.mark.parametrize("case", list(CASES_2D))
def test_fsdp_with_tp_on_a_2x2_mesh_matches_eager(case, ranks4):
    for trained, evaluated, programs in ranks4.run(train_and_evaluate, (2, 2), "llama", **CASES_2D[case]):
        assert trained == (1, 2) and evaluated == (2, 3)
        # One all-gather per FSDP group (root, two blocks) and TP's of the head's logits in
        # the forward, the blocks' again in backward; one reduce-scatter per group.
        assert _gathers(programs) == (4, 2)
        assert len(re.findall(r"dist\.reduce_scatter_(?:single|tensor)\(", programs.split("def backward")[1])) == 3


def accumulation_without_gradient_sync(micro_batches=3):
    """Gradient accumulation as FSDP2 users write it: ``set_requires_gradient_sync(False)``
    for all micro-batches but the last; the gradients after the last one and the
    parameters after the step are eager's."""
    dp, tp = _mesh((2,))
    eager, compiled = _model("llama", dp, tp), _model("llama", dp, tp)
    jitted = dtcompile.jit(compiled)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    for step in range(2):
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            x = _batch("llama", dp, 10 * step + micro)
            for model, called in ((eager, eager), (compiled, jitted)):
                model.set_requires_gradient_sync(last)
                (_loss(called(x)) / micro_batches).backward()
        _assert_grads(compiled, eager)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        _assert_parameters(compiled, eager)
    return dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)


def test_gradient_accumulation_without_gradient_sync(ranks2):
    for counts in ranks2.run(accumulation_without_gradient_sync):
        assert counts == (1, 5)


def refusals():
    """What is not supported says so, naming it, before anything runs."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    messages = []
    # HSDP: a 2-D mesh given to fully_shard (replicate x shard).
    hsdp_mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    hsdp = fully_shard(MLP(DIM, HIDDEN), mesh=hsdp_mesh)
    with pytest.raises(UnsupportedFSDPError, match="HSDPMeshInfo") as error:
        dtcompile.jit(hsdp)(torch.randn(4, DIM))
    messages.append(str(error.value))
    # A function that calls a fully_shard module (jit the module instead).
    torch.manual_seed(0)
    model = fully_shard(MLP(DIM, HIDDEN), mesh=mesh)
    with pytest.raises(dtcompile.TracingError, match="fully_shard"):
        dtcompile.jit(lambda x: model(x).sum())(torch.randn(4, DIM))
    # A managed module unsharded before the call (FSDP2's explicit prefetch): named so.
    torch.manual_seed(0)
    model = _model("mlp", mesh, None)
    model.down.unshard()
    with pytest.raises(dtcompile.TracingError, match="down.weight is not sharded .*unshard\\(\\), an explicit"):
        dtcompile.jit(model)(torch.randn(4, DIM))
    model.down.reshard()
    # A managed parameter replaced after compiling: eager's FSDP2 puts its own back and uses it.
    jitted = dtcompile.jit(model)
    with torch.no_grad():
        jitted(torch.randn(4, DIM))
        model.down.weight = torch.nn.Parameter(model.down.weight.detach() * 0)
        with pytest.raises(dtcompile.TracingError, match="down.weight was replaced by another Parameter"):
            jitted(torch.randn(4, DIM))
    # A module FSDP2 manages the parameters of, replaced after fully_shard (an AttributeError before).
    torch.manual_seed(0)
    model = fully_shard(
        torch.nn.Sequential(fully_shard(MLP(DIM, HIDDEN), mesh=mesh), torch.nn.Linear(DIM, 2)), mesh=mesh
    )
    jitted = dtcompile.jit(model)
    jitted(torch.randn(4, DIM)).sum().backward()
    model[0].down = torch.nn.Linear(HIDDEN, DIM)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(dtcompile.TracingError, match="'0' belongs to a module no"):
            jitted(torch.randn(4, DIM))
    # A method register_fsdp_forward_method wrapped, called in the forward: refused before
    # FSDP2's own pre-forward unshards the stand-ins (a raw error that left the model broken).
    torch.manual_seed(0)
    model = _EncodedHead()
    fully_shard(model.encoder, mesh=mesh)
    register_fsdp_forward_method(model.encoder, "encode")
    model = fully_shard(model, mesh=mesh)
    jitted = dtcompile.jit(model)
    for _ in range(2):
        with pytest.raises(dtcompile.TracingError, match="register_fsdp_forward_method"):
            jitted(torch.randn(4, DIM))
    with torch.no_grad():
        assert model(torch.randn(4, DIM)).shape == (4, 2)  # (eager's FSDP2 state as it was)
    # check="eager": its eager run goes through FSDP2's own hooks (a false mismatch before).
    with pytest.raises(dtcompile.TracingError, match="check='eager' does not run modules fully_shard manages"):
        dtcompile.jit(_model("mlp", mesh, None), check="eager")(torch.randn(4, DIM))
    # Activation checkpointing inside the managed modules: its recompute in the backward.
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(fully_shard(_CheckpointedMLP(), mesh=mesh) for _ in range(2)))
    with pytest.raises(dtcompile.TracingError, match="activation checkpointing's recompute"):
        dtcompile.jit(fully_shard(layers, mesh=mesh))(torch.randn(4, DIM))
    return messages


class _Encodes(MLP):
    def __init__(self):
        super().__init__(DIM, HIDDEN)

    def encode(self, x):
        return torch.tanh(self(x))


class _EncodedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.head = _Encodes(), torch.nn.Linear(DIM, 2)

    def forward(self, x):
        return self.head(self.encoder.encode(x))


class _CheckpointedMLP(MLP):
    def __init__(self):
        super().__init__(DIM, HIDDEN)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


def options_set_after_compiling():
    """FSDP2's setters called after a compiled call are seen: the call compiles again, and
    what dtcompile does not compile is refused (an all-reduce hook changed the gradients
    eager's way while the entry ran without it; not resharding after backward leaves
    eager's unsharded parameters registered, which the program does not)."""
    dp, _ = _mesh((2,))
    refused = []
    for setter in (
        lambda m: m.set_all_reduce_hook(lambda t: t.mul_(2)),
        lambda m: m.set_reshard_after_backward(False),
    ):
        model = _model("mlp", dp, None)
        jitted = dtcompile.jit(model)
        jitted(_batch("mlp", dp, 0)).pow(2).mean().backward()
        for module in (model, model.up, model.down):
            setter(module)
        with pytest.raises(UnsupportedFSDPError, match="not supported") as error:
            jitted(_batch("mlp", dp, 1))
        refused.append(str(error.value).split(" (FSDP2")[0])
    return refused


def test_fsdp_options_set_after_compiling_are_seen(ranks2):
    for refused in ranks2.run(options_set_after_compiling):
        assert refused == ["dtcompile.jit: an all-reduce hook", "dtcompile.jit: set_reshard_after_backward(False)"]


def test_unsupported_fsdp_options_are_refused(ranks2):
    for messages in ranks2.run(refusals):
        assert "not supported" in messages[0]


def tensor_hooks_on_sharded_parameters():
    """A tensor hook on a parameter FSDP2 shards: eager's FSDP2 never calls it (its graph
    holds the unsharded parameter); the compiled step called it (the gradient doubled).
    Refused, registered before compiling or after; a post-accumulate-grad hook runs in both."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    x = torch.ones(2, 4) * (dist.get_rank() + 1)
    found = {}
    for when in ("before", "after"):
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
        jitted = dtcompile.jit(model)
        if when == "after":
            jitted(x).sum().backward()
        handle = model.weight.register_hook(lambda g: g * 2)
        with pytest.raises(dtcompile.TracingError, match="eager's FSDP2 never calls it"):
            jitted(x).sum().backward()
        handle.remove()
        model.zero_grad()
        jitted(x).sum().backward()  # without it, the step runs
    counts = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
        seen = []
        model.weight.register_post_accumulate_grad_hook(lambda p, seen=seen: seen.append(p.grad.to_local().clone()))
        call = dtcompile.jit(model) if compiled else model
        for _ in range(2):
            call(x).sum().backward()
        counts.append(seen)
    found["post-accumulate hooks"] = len(counts[0]) == len(counts[1]) == 2 and all(
        torch.equal(a, b) for a, b in zip(*counts)
    )
    # Without sync, eager's FSDP2 calls it at the synced backward only; a compiled step
    # reduces (and accumulates) each micro-batch: refused.
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
    jitted = dtcompile.jit(model)
    model.set_requires_gradient_sync(False)
    jitted(x).sum().backward()
    model.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(dtcompile.TracingError, match="accumulates without sync"):
        jitted(x).sum().backward()
    model.set_requires_gradient_sync(True)
    jitted(x).sum().backward()
    return found


def test_hooks_on_sharded_parameters_eager_fsdp2_would_not_call_are_refused(ranks2):
    for found in ranks2.run(tensor_hooks_on_sharded_parameters):
        assert found == {"post-accumulate hooks": True}


class _TwoHeads(torch.nn.Module):
    """Two linears in one FSDP2 group (the root's), bucketed into one all-gather: the loss
    uses only the first's output in ``unused_head_trained``."""

    def __init__(self, aux_out: int):
        super().__init__()
        self.main = torch.nn.Linear(4, 4)
        self.aux = torch.nn.Linear(4, aux_out)

    def forward(self, x):
        return self.main(x), self.aux(x)


def unused_head_trained(cache: str, aux_out: int):
    """A parameter of the bucket no output that gets a gradient reaches has no gradient, as
    eager's FSDP2 gives it (a zero gradient before, which AdamW's weight decay then moved)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(fully_shard(_TwoHeads(aux_out), mesh=mesh))
    eager, compiled = models
    calls = {id(eager): eager, id(compiled): dtcompile.jit(compiled, cache=cache)}
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models}
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        for model in models:
            main, _ = calls[id(model)](x)
            main.pow(2).sum().backward()
            optimizers[id(model)].step()
            optimizers[id(model)].zero_grad()
    for (name, e), c in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(e.to_local(), c.to_local()), name
    main, aux = calls[id(compiled)](x)
    (main.sum() if aux_out == 4 else aux.sum()).backward()
    return {name: p.grad is None for name, p in compiled.named_parameters()}


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_a_bucketed_parameter_no_loss_reaches_gets_no_gradient(cache, ranks2):
    for unset in ranks2.run(unused_head_trained, cache, 4):
        assert unset == {"main.weight": False, "main.bias": False, "aux.weight": True, "aux.bias": True}
    for unset in ranks2.run(unused_head_trained, cache, 2):  # (the loss of the last call: aux's)
        assert unset == {"main.weight": True, "main.bias": True, "aux.weight": False, "aux.bias": False}


class _Distilled(torch.nn.Module):
    """A frozen teacher and a trained student in one FSDP2 group, bucketed together."""

    def __init__(self):
        super().__init__()
        self.teacher, self.student = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.teacher.requires_grad_(False)

    def forward(self, x):
        weight = self.teacher.weight
        teacher = self.teacher(x) if not weight.requires_grad else self.teacher(x).detach() * 0
        return teacher, self.student(x)


def frozen_member(cache: str):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = fully_shard(_Distilled(), mesh=mesh)
    torch.manual_seed(0)
    eager = fully_shard(_Distilled(), mesh=mesh)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    teacher, student = dtcompile.jit(model, cache=cache)(x)
    eager_teacher, eager_student = eager(x)
    assert torch.equal(teacher, eager_teacher) and torch.equal(student, eager_student)
    return teacher.requires_grad, student.requires_grad


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_a_frozen_parameter_bucketed_with_trained_ones_needs_no_gradient(cache, ranks2):
    # Seen as requiring grad inside the forward before (a view of the bucket's buffer, which does).
    for flags in ranks2.run(frozen_member, cache):
        assert flags == (False, True)


class _Skipping(torch.nn.Module):
    """Three linears in one bucketed FSDP2 group; ``how`` leaves ``b`` out of the loss's graph."""

    def __init__(self, how: str):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))
        self.how = how

    def forward(self, x):
        if self.how == "branch not taken":
            return self.c(self.a(x))
        if self.how == "read under no_grad":
            with torch.no_grad():
                scale = self.b(x).abs().mean()
            return self.c(self.a(x)) * scale
        return self.c(self.a(x)) * self.b.weight.detach().sum()  # "detached"


def skipped_member(cache: str, how: str):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(fully_shard(_Skipping(how), mesh=mesh))
    eager, compiled = models
    step = dtcompile.jit(compiled, cache=cache)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    for i in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * i + dist.get_rank()))
        for call, optimizer in zip((eager, step), optimizers):
            optimizer.zero_grad()
            call(x).pow(2).sum().backward()
            optimizer.step()
    grads = {}
    for (name, e), c in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(e.to_local(), c.to_local()), name
        grads[name] = (e.grad is None, c.grad is None)
    return grads


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("how", ["branch not taken", "read under no_grad", "detached"])
def test_a_bucketed_parameter_outside_the_losss_graph_gets_no_gradient(how, cache, ranks2):
    for grads in ranks2.run(skipped_member, cache, how):
        for name, (eager_none, compiled_none) in grads.items():
            assert eager_none == compiled_none, name


def lengths_of_their_own():
    """Each dp rank's batch of its own length, changing per step (packing, bucketing): under
    constant values a rank meeting a new length compiled alone and waited for the others,
    which ran their cached entries into FSDP2's collectives: a stall of 120 s, then an error
    on one rank and a hang on the other. Its collectives (the parameters' all-gathers and
    reduce-scatters) are those the ranks agreed on, so it needs no meeting."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        fully_shard(model[0], mesh=mesh)
        return fully_shard(model, mesh=mesh)

    eager, compiled = build(), build()
    jitted = dtcompile.jit(compiled)
    for step, lengths in enumerate([[5, 5], [5, 7], [6, 7], [6, 8]]):
        x = torch.randn(2, lengths[rank], 4, generator=torch.Generator().manual_seed(step + 10 * rank))
        expected, got = eager(x).pow(2).mean(), jitted(x).pow(2).mean()
        assert_same(got, expected)
        expected.backward()
        got.backward()
        for a, b in zip(compiled.parameters(), eager.parameters()):
            assert_same(a.grad, b.grad)
        eager.zero_grad()
        compiled.zero_grad()
    return dtcompile.cache_misses(jitted)


def test_ranks_with_batches_of_their_own_lengths_compile_alone(ranks2):
    assert ranks2.run(lengths_of_their_own) == [2, 3]


class _ReadsItsBlock(torch.nn.Module):
    """The root's forward reads a block's weight after the block ran (and the block runs twice)."""

    def __init__(self):
        super().__init__()
        self.block, self.head = torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, 2)

    def forward(self, x):
        h = self.block(self.block(x))
        return self.head(h) / self.block.weight.norm() + self.block.weight.sum()


def reads_an_unsharded_block(grad: bool):
    """With reshard_after_forward=False, eager's FSDP2 leaves the block unsharded until the
    root's forward ends: its weight read there is the full tensor. The compiled call read
    the sharded DTensor (a Partial norm: each rank's own value, silently)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = _ReadsItsBlock()
        fully_shard(model.block, mesh=mesh, reshard_after_forward=False)
        models.append(fully_shard(model, mesh=mesh))
    compiled, eager = models
    jitted = dtcompile.jit(compiled)
    for step in range(2):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step + dist.get_rank()))
        with torch.set_grad_enabled(grad):
            got, expected = jitted(x), eager(x)
        assert type(got) is type(expected) is torch.Tensor
        torch.testing.assert_close(got, expected)
        if grad:
            got.sum().backward()
            expected.sum().backward()
            _assert_grads(compiled, eager)
    return True


@pytest.mark.parametrize("grad", [False, True])
def test_a_block_that_does_not_reshard_is_read_unsharded_after_its_forward(grad, ranks2):
    assert ranks2.run(reads_an_unsharded_block, grad) == [True, True]
