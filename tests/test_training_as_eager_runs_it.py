"""Training steps whose every bit is eager's: a BatchNorm under ``torch.utils.checkpoint``
updates its running statistics as often as eager's (once in the forward, once in the
backward's recompute), dropout draws and scales as eager's CPU kernel does (not as torch's
Python decomposition does), and a parameter changed before the backward gives autograd's
error."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dtcompile
from dtcompile.testing.compare import assert_same

CACHES = ["constant values", "symbolic values"]


class _CheckpointedNorm(nn.Module):
    def __init__(self, dropout: bool):
        super().__init__()
        self.a, self.bn, self.dropout = nn.Linear(8, 16), nn.BatchNorm1d(16), dropout

    def body(self, h):
        h = self.bn(h)
        return F.dropout(h, 0.3) if self.dropout else h

    def forward(self, x):
        return checkpoint(self.body, self.a(x), use_reentrant=False, preserve_rng_state=False).pow(2).sum()


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dropout", [False, True])
def test_a_checkpointed_batch_norm_updates_its_statistics_as_eager(cache, dropout):
    torch.manual_seed(0)
    eager = _CheckpointedNorm(dropout)
    model = copy.deepcopy(eager)
    jitted = dtcompile.jit(model, cache=cache)
    for step in range(2):
        x = torch.randn(5, 8)
        torch.manual_seed(10 + step)
        eager(x).backward()
        torch.manual_seed(10 + step)
        jitted(x).backward()
        for (name, e), c in zip(eager.state_dict().items(), model.state_dict().values()):
            assert_same(c, e, name, rtol=0, atol=0)
        for (name, e), c in zip(eager.named_parameters(), model.parameters()):
            assert_same(c.grad, e.grad, name, rtol=0, atol=0)
    assert model.bn.num_batches_tracked.item() == 4


class _CheckpointedState(nn.Module):
    """A checkpointed region updating module state in place: a BatchNorm's statistics, a
    counter under no_grad, an exponential average."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(16))

    def body(self, h):
        with torch.no_grad():
            self.calls += 1
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return torch.tanh(self.bn(h)) * self.ema

    def forward(self, x):
        return self.b(checkpoint(self.body, self.a(x), use_reentrant=False))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("pattern", ["one loss of two calls", "two calls, then two backwards"])
def test_two_calls_of_a_checkpointed_region_updating_state_before_their_backward(cache, pattern):
    # The buffers the recompute updates were saved by the first call and checked for
    # changes: its backward raised autograd's error, where eager's recompute reads them
    # as they are.
    torch.manual_seed(0)
    eager = _CheckpointedState()
    model = copy.deepcopy(eager)
    jitted = dtcompile.jit(model, cache=cache)
    x1, x2 = torch.randn(6, 8), torch.randn(6, 8)
    for fn in (eager, jitted):
        if pattern == "one loss of two calls":
            (fn(x1).pow(2).mean() + fn(x2).pow(2).mean()).backward()
        else:
            first, second = fn(x1).pow(2).mean(), fn(x2).pow(2).mean()
            first.backward()
            second.backward()
    for (name, e), c in zip(eager.state_dict().items(), model.state_dict().values()):
        assert_same(c, e, name, rtol=0, atol=0)
    for (name, e), c in zip(eager.named_parameters(), model.parameters()):
        assert_same(c.grad, e.grad, name, rtol=0, atol=0)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.45])
def test_dropout_draws_and_scales_as_eagers_kernel(cache, dtype, p):
    def f(x):
        return F.dropout(x, p, training=True) * 2

    x = torch.randn(64, 64, dtype=dtype, requires_grad=True)
    cotangent = torch.randn(64, 64, dtype=dtype)
    results = []
    for fn in (f, dtcompile.jit(f, cache=cache)):
        torch.manual_seed(2)
        out = fn(x)
        results.append((out, *torch.autograd.grad(out, x, cotangent), torch.rand(3)))
    for got, expected in zip(results[1], results[0]):
        assert_same(got.detach(), expected.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("cache", CACHES)
def test_sgd_steps_through_dropout_are_eagers_bit_for_bit(cache):
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.45), nn.Linear(64, 4))
    model = copy.deepcopy(eager)
    jitted = dtcompile.jit(model, cache=cache)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, model)]
    for step in range(3):
        x, y = torch.randn(32, 16), torch.randn(32, 4)
        for run, optimizer in zip((eager, jitted), optimizers):
            torch.manual_seed(100 + step)
            F.mse_loss(run(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        for e, c in zip(eager.parameters(), model.parameters()):
            assert_same(c, e, rtol=0, atol=0)


@pytest.mark.parametrize("cache", CACHES)
def test_a_parameter_changed_before_the_backward_is_autograds_error(cache):
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    for run in (model, dtcompile.jit(model, cache=cache)):
        loss = run(torch.randn(3, 4)).pow(2).sum()
        with torch.no_grad():
            model[2].weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def _is_mm(op):
    return op == torch.ops.aten.mm.default


class _HookedReachingTorchOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.flag = nn.Linear(8, 8), False

    def forward(self, x):
        if self.flag:
            _is_mm(None)  # (reaches torch.ops: its namespaces load as ops are used)
        h = self.up(x)
        h.register_hook(lambda g: g * 2)  # (code of the user's in the backward: what it may read is checked)
        return h


@pytest.mark.parametrize("cache", CACHES)
def test_torch_ops_loading_a_namespace_is_no_change_the_backward_sees(cache):
    model = _HookedReachingTorchOps()
    jitted = dtcompile.jit(model, cache=cache)
    for step in range(2):
        loss = jitted(torch.randn(2, 8)).sum()
        getattr(torch.ops, f"dtcompile_test_namespace_{cache[0]}{step}")  # a namespace loaded after the call
        loss.backward()


class _CheckpointedInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.inner = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8))

    def body(self, h):
        return torch.tanh(self.inner(h)) * (2.0 if self.training else 1.0)

    def forward(self, x):
        return checkpoint(self.body, self.a(x), use_reentrant=False).pow(2).mean()


_MODULE_CHANGES = {
    "eval()": lambda m: m.eval(),
    "a parameter rebound": lambda m: setattr(m.inner[0], "weight", nn.Parameter(torch.ones(8, 8))),
    "a submodule replaced": lambda m: m.inner.__setitem__(0, nn.Linear(8, 8)),
    "a forward hook added": lambda m: m.inner[0].register_forward_hook(lambda mod, i, o: o * 2),
    "a parameter frozen": lambda m: m.inner[0].weight.requires_grad_(False),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("change", _MODULE_CHANGES)
def test_module_state_a_recompute_reads_changed_before_the_backward_is_a_clear_error(change, cache):
    # Eager's recompute reads the module as it is at the backward; the compiled backward
    # replayed the traced one, silently.
    torch.manual_seed(0)
    model = _CheckpointedInner()
    jitted = dtcompile.jit(model, cache=cache)
    jitted(torch.randn(4, 8)).backward()  # (unchanged: runs)
    loss = jitted(torch.randn(4, 8))
    _MODULE_CHANGES[change](model)
    with pytest.raises(RuntimeError, match="the module inner.* its training flag or tables|the module .*training flag"):
        loss.backward()


class _CheckpointedThenHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.block, self.head, self.spare = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.head(checkpoint(self.block, torch.tanh(self.a(x)), use_reentrant=False)).pow(2).mean()


@pytest.mark.parametrize("cache", CACHES)
def test_modules_the_recompute_does_not_call_may_change_before_the_backward(cache):
    # Only the modules the backward's recompute calls are read by it: a change elsewhere
    # (the head, a module not used) runs as eager's backward does.
    torch.manual_seed(0)
    eager = _CheckpointedThenHead()
    model = copy.deepcopy(eager)
    jitted = dtcompile.jit(model, cache=cache)
    x = torch.randn(4, 8)
    for fn, m in ((eager, eager), (jitted, model)):
        loss = fn(x)
        m.head.eval()
        m.spare.weight = nn.Parameter(torch.zeros(2, 2))
        m.head.register_forward_hook(lambda mod, i, o: o)
        loss.backward()
    for (name, e), c in zip(eager.named_parameters(), model.parameters()):
        assert_same(c.grad, e.grad, name, rtol=0, atol=0)


class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).t()


class _Unrolled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.Linear(6, 6)
        torch.nn.utils.parametrize.register_parametrization(self.cell, "weight", _Symmetric())

    def forward(self, x):
        for _ in range(4):  # (the parametrized weight read four times)
            x = torch.tanh(self.cell(x))
        return x.pow(2).sum()


@pytest.mark.parametrize("cache", CACHES)
def test_a_parametrization_read_several_times_in_a_cached_region_is_computed_once_as_eager(cache):
    # Computed at each read, its gradient summed otherwise than eager's (one computation,
    # its cotangents summed first): last bits apart.
    from torch.nn.utils import parametrize

    eager, model = _Unrolled(), _Unrolled()
    jitted = dtcompile.jit(model, cache=cache)
    x = torch.randn(3, 6)
    with parametrize.cached():
        eager(x).backward()
    with parametrize.cached():
        jitted(x).backward()
    for (name, e), c in zip(eager.named_parameters(), model.parameters()):
        assert_same(c.grad, e.grad, name, rtol=0, atol=0)
    with parametrize.cached():
        assert type(model.cell.weight) is torch.Tensor  # (computed by eager code in the region, before the call)
        assert_same(jitted(x), eager(x), rtol=0, atol=0)


class _AverageSavedOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
        self.register_buffer("ema", torch.zeros(8))

    def update(self, h):
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return torch.tanh(h)

    def forward(self, x):
        h = checkpoint(self.update, self.a(x), use_reentrant=False)
        return self.b(h * self.ema).pow(2).mean()  # (the product saves the average)


@pytest.mark.parametrize("cache", CACHES)
def test_a_buffer_a_recompute_writes_and_an_op_outside_saves_is_checked_as_eager(cache):
    # Read as it was at the backward (as the recompute reads it), a change in between went
    # unseen where eager's product, which saved it, raises.
    torch.manual_seed(0)
    model = _AverageSavedOutside()
    jitted = dtcompile.jit(model, cache=cache)
    jitted(torch.randn(4, 8)).backward()  # (unchanged: runs)
    loss = jitted(torch.randn(4, 8))
    model.ema.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
