"""Training calls whose gradients must be eager's exactly, in which inputs get none too.

Each test runs the same code eagerly and compiled and compares: which tensors get a
``.grad`` (None where eager's autograd leaves it None, not zeros), the gradients' values,
what an optimizer then does, the random state after the backward; or it checks that a
case the compiled program cannot reproduce is refused while compiling or calling.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dtcompile

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))
from harness import RankPool  # noqa: E402


def _grads(module: nn.Module) -> dict:
    return {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}


def _assert_same_grads(got: dict, expected: dict):
    assert got.keys() == expected.keys()
    for name in expected:
        assert (got[name] is None) == (expected[name] is None), (name, got[name], expected[name])
        if expected[name] is not None:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------
# Backward through only some outputs: inputs only the others reach get no gradient


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head_a = nn.Linear(4, 2)
        self.head_b = nn.Linear(4, 2)

    def forward(self, x):
        h = self.body(x).relu()
        return self.head_a(h), self.head_b(h)


@torch.enable_grad()
@pytest.mark.parametrize("used", ["a", "b", "both"])
def test_a_head_the_loss_does_not_use_gets_no_grad_and_adamw_leaves_it(used):
    torch.manual_seed(0)
    eager = TwoHeads()
    compiled = copy.deepcopy(eager)
    jitted = dtcompile.jit(compiled)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (eager, compiled)]
    for step in range(3):  # a miss, then hits
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for fn in (eager, jitted):
            a, b = fn(x)
            loss = {"a": a.sum(), "b": b.pow(2).sum(), "both": a.sum() + b.pow(2).sum()}[used]
            loss.backward()
        _assert_same_grads(_grads(compiled), _grads(eager))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        for p, q in zip(compiled.parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    if used == "a":
        assert compiled.head_b.weight.grad is None and compiled.head_b.bias.grad is None
    assert dtcompile.cache_misses(jitted) == 1


class _Offset(torch.autograd.Function):
    """A Function whose backward tells a missing gradient (None) from zeros."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return torch.full((2, 4), 100.0) if g is None else g + 1


def _offset_by_hook(h):
    h.register_hook(lambda g: g + 1)
    return h


def _scaled_by_hook(h):
    h.register_hook(lambda g: g * 3)
    return h


# How the second head's path runs code of the user's in the backward.
_BACKWARD_CODE = {
    "a tensor hook": lambda h: _offset_by_hook(h * 3),
    "a Function": lambda h: _Offset.apply(h),
    "a linear tensor hook": lambda h: _scaled_by_hook(h * 3),
}


def _heads_with_code(kind: str):
    def fn(x, w):
        h = x * w
        return (h * 2).sum(), _BACKWARD_CODE[kind](h).sum()

    return fn


@torch.enable_grad()
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("kind", list(_BACKWARD_CODE))
def test_code_of_the_user_s_on_the_path_of_an_unused_output_is_refused(kind, cache):
    """Eager's autograd runs a hook or a Function's backward only where a gradient arrives;
    the compiled backward ran it on zeros (``g + 1`` added to the shared input's gradient, a
    Function branching on ``g is None`` took the other branch). Refused when it would run
    so; with every output used, eager's gradients."""
    fn = _heads_with_code(kind)
    jitted = dtcompile.jit(fn, cache=cache)
    x = torch.ones(2, 4)
    for _ in range(2):  # a miss, then a hit
        w, v = torch.ones(4, requires_grad=True), torch.ones(4, requires_grad=True)
        a, b = fn(x, v)
        (a + b).backward()
        got_a, got_b = jitted(x, w)
        (got_a + got_b).backward()
        torch.testing.assert_close(w.grad, v.grad, rtol=0, atol=0)
        w = torch.ones(4, requires_grad=True)
        got_a, _ = jitted(x, w)
        with pytest.raises(RuntimeError, match=r"code of yours .* outputs \[1\], which got none"):
            got_a.backward()


class _TwoOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.linear(x)
        return h.tanh(), h.sigmoid()


class _ReturnsBoth(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.two, self.out = _TwoOutputs(), torch.nn.Linear(3, 1)

    def forward(self, x):
        a, b = self.two(x)
        return self.out(a), b


def _scaled_where_none(module, grad_input, grad_output):
    if grad_output[1] is None:
        return (grad_input[0] * 10,)
    return None


def _pre_scaled_where_none(module, grad_output):
    return (grad_output[0] * 10, grad_output[1]) if grad_output[1] is None else None


_MODULE_HOOKS = {
    "full backward hook on a submodule": lambda m: m.two.register_full_backward_hook(_scaled_where_none),
    "backward pre-hook on a submodule": lambda m: m.two.register_full_backward_pre_hook(_pre_scaled_where_none),
}


@torch.enable_grad()
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("hook", list(_MODULE_HOOKS))
def test_a_module_backward_hook_given_none_by_eager_is_refused(hook, cache):
    """A module's output the loss does not use: eager's full backward hook (or pre-hook) gets
    None for its gradient, the compiled backward, traced with every cotangent, gave it
    zeros, and a hook branching on None took the other branch (x's gradient 10x off). With
    both outputs used, eager's gradients."""
    torch.manual_seed(0)
    model = _ReturnsBoth()
    _MODULE_HOOKS[hook](model)
    jitted = dtcompile.jit(copy.deepcopy(model), cache=cache)
    for _ in range(2):
        grads = []
        for called in (model, jitted):
            x = torch.ones(5, 4, requires_grad=True)
            y, b = called(x)
            (y.sum() + b.sum()).backward()
            grads.append([x.grad, *(p.grad for p in called.parameters())])
            called.zero_grad(set_to_none=True)
        for eager, compiled in zip(*grads):
            torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
        y, _ = jitted(torch.ones(5, 4, requires_grad=True))
        with pytest.raises(RuntimeError, match="pass a module's backward hook None"):
            y.sum().backward()


@torch.enable_grad()
def test_code_of_the_user_s_on_a_path_some_gradient_reaches_runs_as_in_eager():
    """A hook on a value both outputs read runs, in eager, on the gradient that arrives."""

    def fn(x, w):
        h = _offset_by_hook(x * w)
        return (h * 2).sum(), (h * 3).sum()

    jitted = dtcompile.jit(fn)
    for used in (0, 1):
        w, v = torch.ones(4, requires_grad=True), torch.ones(4, requires_grad=True)
        fn(torch.ones(2, 4), v)[used].backward()
        jitted(torch.ones(2, 4), w)[used].backward()
        torch.testing.assert_close(w.grad, v.grad, rtol=0, atol=0)


def _two_products(x, w1, w2):
    return x * w1, x * w2


@torch.enable_grad()
def test_autograd_grad_of_an_input_only_an_unused_output_reaches_is_none_or_raises():
    jitted = dtcompile.jit(_two_products)
    for fn in (_two_products, jitted):
        x, w1, w2 = (torch.randn(3, requires_grad=True) for _ in range(3))
        a, _ = fn(x, w1, w2)
        assert torch.autograd.grad(a.sum(), [w2], allow_unused=True, retain_graph=True) == (None,)
        with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
            torch.autograd.grad(a.sum(), [w2], retain_graph=True)
        gx, gw1, gw2 = torch.autograd.grad(a.sum(), [x, w1, w2], allow_unused=True)
        assert gw2 is None
        torch.testing.assert_close(gx, w1.detach(), rtol=0, atol=0)
        torch.testing.assert_close(gw1, x.detach(), rtol=0, atol=0)


@torch.enable_grad()
def test_an_input_returned_as_it_is_gets_only_its_own_cotangent():
    def f(x, w):
        return x, (x * w).sum()

    jitted = dtcompile.jit(f)
    for fn in (f, jitted):
        x, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        out, loss = fn(x, w)
        (out * 2).sum().backward()  # only the returned input: w gets nothing
        assert w.grad is None
        torch.testing.assert_close(x.grad, torch.full((3,), 2.0), rtol=0, atol=0)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("changed", [False, True])
def test_an_input_needing_no_grad_returned_as_it_is_is_the_callers_own(cache, changed):
    """Beside an input that needs a gradient, a plain tensor returned as it came (changed in
    place or not) is the caller's object, as in eager; it was a view of it."""

    def f(w, buf):
        if changed:
            buf.add_(1)
        return w * 2, buf, buf

    jitted = dtcompile.jit(f, cache=cache)
    for i in range(3):
        w, buf = torch.arange(3.0, requires_grad=True), torch.full((3,), float(i))
        out, first, second = jitted(w, buf)
        assert first is buf and second is buf
        torch.testing.assert_close(buf, torch.full((3,), i + float(changed)), rtol=0, atol=0)
        out.sum().backward()
        torch.testing.assert_close(w.grad, torch.full((3,), 2.0), rtol=0, atol=0)


def _saved_output_changed(w, buf):
    y = w.sigmoid()
    z = y * 2
    y.mul_(3)  # sigmoid saved its output
    return w * 5, z


def _saved_input_changed(w, buf):
    y = w * buf
    buf.add_(1)  # the product saved buf
    return w * 5, y


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("fn", [_saved_output_changed, _saved_input_changed])
def test_a_value_autograd_saved_changed_in_place_is_refused_clearly(cache, fn):
    """Eager runs the call, and raises autograd's error only at a backward that reaches the
    op; a compiled call differentiates every output while compiling. Refused, saying so
    (it raised autograd's error from inside dtcompile at the call)."""
    w = torch.arange(3.0, requires_grad=True)
    out, _ = fn(w, torch.ones(3))
    out.sum().backward()  # eager: fine through the other output
    with pytest.raises(dtcompile.TracingError, match="changes in place a value autograd saved"):
        dtcompile.jit(fn, cache=cache)(torch.arange(3.0, requires_grad=True), torch.ones(3))


# ---------------------------------------------------------------------------------------
# torch.utils.checkpoint around random ops


def _checkpointed_dropout(preserve):
    def f(x):
        return checkpoint(lambda a: F.dropout(a, 0.5, True), x, use_reentrant=False, preserve_rng_state=preserve).sum()

    return f


@torch.enable_grad()
def test_checkpoint_restoring_the_random_state_around_dropout_is_refused():
    jitted = dtcompile.jit(_checkpointed_dropout(True))
    state = torch.get_rng_state()
    with pytest.raises(dtcompile.TracingError, match=r"checkpoint.*random op \(aten\.bernoulli"):
        jitted(torch.ones(8, requires_grad=True))
    assert torch.equal(torch.get_rng_state(), state)


@torch.enable_grad()
def test_checkpoint_without_restoring_the_random_state_matches_eager():
    f = _checkpointed_dropout(False)
    results = []
    for fn in (f, dtcompile.jit(f)):
        torch.manual_seed(3)
        x = torch.ones(8, requires_grad=True)
        y = fn(x)
        y.backward()
        results.append((y.detach(), x.grad, torch.rand(4)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _checkpointed_attention(dropout_p: float):
    def attention(q):
        return F.scaled_dot_product_attention(q, q * 2, q.tanh(), dropout_p=dropout_p, is_causal=True)

    return lambda q: checkpoint(attention, q, use_reentrant=False).pow(2).sum()


@torch.enable_grad()
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_checkpointed_attention_without_dropout_matches_eager(cache):
    """Attention is a seeded op whatever its ``dropout_p``: checkpointed, it was refused
    as a random op recomputed, though with ``dropout_p=0`` it draws nothing."""
    f = _checkpointed_attention(0.0)
    results = []
    for fn in (f, dtcompile.jit(f, cache=cache)):
        torch.manual_seed(0)
        q = torch.randn(2, 4, 6, 8, requires_grad=True)
        y = fn(q)
        y.backward()
        results.append((y.detach(), q.grad))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected)
    with pytest.raises(dtcompile.TracingError, match=r"checkpoint.*random op"):
        dtcompile.jit(_checkpointed_attention(0.5))(torch.randn(2, 4, 6, 8, requires_grad=True))


@torch.enable_grad()
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_reentrant_checkpoint_is_refused_clearly_and_leaves_the_module_as_it_was(cache):
    """``use_reentrant=True``: its backward runs only under ``.backward()`` without
    ``inputs``, and a compiled call traces its backward with ``autograd.grad``: refused,
    saying what to pass instead (torch's own error named what the user never called)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def f(x):
        return checkpoint(model, x, use_reentrant=True).pow(2).sum()

    x = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(dtcompile.TracingError, match="use_reentrant=True.*Pass use_reentrant=False"):
        dtcompile.jit(f, cache=cache)(x)
    assert all(type(p) is nn.Parameter and p.is_leaf and p.grad is None for p in model.parameters())
    f(x).backward()  # eager still trains
    assert x.grad is not None and all(p.grad is not None for p in model.parameters())


@torch.enable_grad()
def test_checkpoint_of_deterministic_code_matches_eager():
    w = torch.randn(8, 8)

    def f(x):
        return checkpoint(lambda a: (a @ w).tanh(), x, use_reentrant=False).sum()

    results = []
    for fn in (f, dtcompile.jit(f)):
        torch.manual_seed(3)
        x = torch.randn(4, 8, requires_grad=True)
        fn(x).backward()
        results.append((x.grad, torch.rand(4)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------------------------------
# torch.autograd.grad inside the call


def _gradient_and_value(retain):
    def f(x, w):
        y = (x @ w).tanh().sum()
        (g,) = torch.autograd.grad(y, w, retain_graph=retain)
        return g, y

    return f


@torch.enable_grad()
def test_returning_a_value_whose_graph_the_call_freed_is_a_clear_error():
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    with pytest.raises(dtcompile.TracingError, match="retain_graph=True"):
        dtcompile.jit(_gradient_and_value(False))(x, w)
    assert x.grad is None and w.grad is None


@torch.enable_grad()
def test_autograd_grad_inside_with_the_graph_retained_matches_eager():
    f = _gradient_and_value(True)
    results = []
    for fn in (f, dtcompile.jit(f)):
        torch.manual_seed(0)
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
        g, y = fn(x, w)
        assert y.requires_grad and not g.requires_grad
        y.backward()
        results.append((g, y.detach(), x.grad, w.grad))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------------------------------
# saved_tensors_hooks around the call


def _tanh_and_exp(x, w):
    h = x @ w
    return h.tanh(), h.exp()


def _doubled(t):
    return t * 2  # a saved value that comes back changed (a scaled, quantised activation)


def _hooked_step(fn, hooks, pack=_doubled):
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    if hooks:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            a, b = fn(x, w)
    else:
        a, b = fn(x, w)
    (a.sum() + b.sum()).backward()
    return x.grad, w.grad


@torch.enable_grad()
def test_hooks_around_the_compiling_call_apply_once_as_in_eager():
    # What the hooks do to each saved tensor is traced into the programs: the compiled step
    # saves its own values without applying them a second time (doubled twice before).
    expected = _hooked_step(_tanh_and_exp, True)
    jitted = dtcompile.jit(_tanh_and_exp)
    for _ in range(2):  # a miss, then a hit
        for g, e in zip(_hooked_step(jitted, True), expected):
            torch.testing.assert_close(g, e)
    assert dtcompile.cache_misses(jitted) == 1


@torch.enable_grad()
def test_an_entry_traced_under_other_hooks_than_the_call_is_not_used():
    # The hooks are guarded: a call under others (or none) compiles its own entry.
    for first in (True, False):
        jitted = dtcompile.jit(_tanh_and_exp)
        for hooks in (first, not first, first):
            for g, e in zip(_hooked_step(jitted, hooks), _hooked_step(_tanh_and_exp, hooks)):
                torch.testing.assert_close(g, e)
        assert dtcompile.cache_misses(jitted) == 2
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


@torch.enable_grad()
def test_a_hook_with_a_side_effect_is_refused_and_put_back():
    counts = []

    def counting(t):
        counts.append(1)  # would count while compiling only
        return t

    with pytest.raises(dtcompile.TracingError, match="saved tensors hook"):
        _hooked_step(dtcompile.jit(_tanh_and_exp), True, counting)
    assert counts == []


@torch.enable_grad()
def test_save_on_cpu_entered_at_each_step_is_one_entry_with_eager_gradients():
    def f(x, w):
        return (x @ w).tanh().exp().sum()

    jitted = dtcompile.jit(f)
    for _ in range(3):
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
        grads = []
        for fn in (f, jitted):
            with torch.autograd.graph.save_on_cpu():
                loss = fn(x, w)
            loss.backward()
            grads.append((x.grad, w.grad))
            x.grad = w.grad = None
        for got, expected in zip(*grads):
            torch.testing.assert_close(got, expected)
    assert dtcompile.cache_misses(jitted) == 1


# ---------------------------------------------------------------------------------------
# Tensor parallelism on two Gloo ranks: a head the loss does not use


def _tp_two_heads():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {"body": ColwiseParallel(), "head_a": RowwiseParallel(), "head_b": RowwiseParallel()}

    class Heads(TwoHeads):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 8)
            self.head_a = nn.Linear(8, 2)
            self.head_b = nn.Linear(8, 2)

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(parallelize_module(Heads(), mesh, plan))
    eager, compiled = models
    jitted = dtcompile.jit(compiled)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in models]
    with torch.enable_grad():
        for step in range(2):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            for fn in (eager, jitted):
                a, _ = fn(x)
                a.sum().backward()
            for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
                assert (p.grad is None) == (q.grad is None), name
                if q.grad is not None:
                    assert isinstance(p.grad, DTensor) and p.grad.placements == q.grad.placements
                    torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor())
            for opt in opts:
                opt.step()
                opt.zero_grad()
            for p, q in zip(compiled.parameters(), eager.parameters()):
                torch.testing.assert_close(p.full_tensor(), q.full_tensor())
    return compiled.head_b.weight.grad is None, dtcompile.cache_misses(jitted)


def test_tensor_parallel_head_the_loss_does_not_use_gets_no_grad():
    pool = RankPool(2)
    try:
        assert pool.run(_tp_two_heads) == [(True, 1), (True, 1)]
    finally:
        pool.close()


@torch.enable_grad()
def test_an_output_and_a_value_its_backward_reads_stay_apart():
    # CSE merged the returned ``relu`` with the one the loss recomputes (saved for the
    # backward): zeroing the output's data after the call zeroed the gradient.
    def f(x, w):
        out = (x @ w).relu()
        return out, ((x @ w).relu() * 3).sum()

    grads = []
    for fn in (f, dtcompile.jit(f)):
        torch.manual_seed(0)
        x, w = torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)
        out, loss = fn(x, w)
        out.data.zero_()
        loss.backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0])


def _saves_x_then_writes_x2(w, x, x2):
    y = (w * x).sum()  # autograd saves x for w's gradient
    x2.add_(1)
    return y


_SHARING = {
    "x and a view of it": lambda: (lambda z: (z, z.view(3)))(torch.ones(3)),
    "two slices of one base": lambda: (lambda z: (z[:3], z[3:]))(torch.ones(6)),
    "x and x.detach()": lambda: (lambda z: (z, z.detach()))(torch.ones(3)),
}


@torch.enable_grad()
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("traced_first", ["apart", "sharing"])
@pytest.mark.parametrize("sharing", list(_SHARING))
def test_a_saved_input_written_through_another_that_shares_its_memory(sharing, traced_first, cache):
    """Eager's backward raises (the inputs share a version counter); the compiled step gave
    gradients of the changed value: traced apart and then called sharing memory, and traced
    sharing it."""
    jitted = dtcompile.jit(_saves_x_then_writes_x2, cache=cache)
    if traced_first == "apart":
        w = torch.ones(3, requires_grad=True)
        jitted(w, torch.ones(3), torch.ones(3)).backward()
        assert torch.equal(w.grad, torch.ones(3))
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _saves_x_then_writes_x2(w, *_SHARING[sharing]()).backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        jitted(w, *_SHARING[sharing]()).backward()


# ---------------------------------------------------------------------------------------
# Python values the user's backward code reads, changed between the call and backward()

GRAD_STATE = {"scale": 1.0}


class _ScaledByOwner(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g * ctx.owner.grad_scale, None


class _ScaledByGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g * GRAD_STATE["scale"]


class _BackwardReader(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.grad_scale = kind, 1.0
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.up(x)
        if self.kind == "module attribute":
            h = _ScaledByOwner.apply(h, self)
        elif self.kind == "global dict":
            h = _ScaledByGlobal.apply(h)
        else:
            h = h * 1.0
            h.register_hook(lambda g: g * GRAD_STATE["scale"])
        return self.down(h.relu())


def _set_scale(model, kind: str, value: float):
    if kind == "module attribute":
        model[1].grad_scale = value
    else:
        GRAD_STATE["scale"] = value


@torch.enable_grad()
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("kind", ["module attribute", "global dict", "tensor hook"])
def test_a_value_the_user_s_backward_reads_changed_after_the_call_is_refused(kind, cache):
    """Eager's backward reads the new value; the compiled backward held the traced one,
    and gave other gradients with no error."""
    torch.manual_seed(0)
    eager = nn.Sequential(*(_BackwardReader(kind) for _ in range(3)))
    model = copy.deepcopy(eager)
    jitted = dtcompile.jit(model, cache=cache)
    x = torch.randn(2, 4)
    try:
        for _ in range(2):  # unchanged: eager's gradients
            eager(x).pow(2).sum().backward()
            jitted(x).pow(2).sum().backward()
            _assert_same_grads(_grads(model), _grads(eager))
        out = jitted(x)
        _set_scale(model, kind, 3.0)
        with pytest.raises(RuntimeError, match="changed after the call"):
            out.pow(2).sum().backward()
        assert dtcompile.cache_misses(jitted) == 1
    finally:
        GRAD_STATE["scale"] = 1.0


@torch.enable_grad()
def test_detect_anomaly_checking_nan_is_refused_and_without_the_check_runs():
    """Anomaly mode's NaN check reads every gradient's data: it was refused as Python
    control flow on a number read from data, which the user's code had none of."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model = copy.deepcopy(eager)
    x = torch.randn(3, 8)
    with torch.autograd.detect_anomaly(), pytest.raises(dtcompile.TracingError, match="detect_anomaly"):
        dtcompile.jit(model)(x)
    with pytest.warns(UserWarning), torch.autograd.detect_anomaly(check_nan=False):
        dtcompile.jit(model)(x).pow(2).sum().backward()
        eager(x).pow(2).sum().backward()
    _assert_same_grads(_grads(model), _grads(eager))


# ---------------------------------------------------------------------------------------
# Outputs that view the program's own intermediates, changed in place by the caller

_VIEWS_OF_INTERMEDIATES = {
    "transpose": lambda x: (x * 2).t(),
    "slice": lambda x: (x * 2)[1:],
    "copying reshape": lambda x: x.t().reshape(-1),
    "two views": lambda x: ((x * 2)[1:], (x * 3)[:1]),
}


def _changed_in_place_then_backward(fn, x):
    out = fn(x)
    outs = out if isinstance(out, tuple) else (out,)
    outs[-1].mul_(3)
    sum(t.sum() for t in outs).backward()
    return x.grad


@torch.enable_grad()
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("name", list(_VIEWS_OF_INTERMEDIATES))
def test_a_returned_view_of_an_intermediate_changed_in_place(name, cache):
    """Eager's output views an intermediate, and may be changed in place before backward;
    the compiled step's was a view made inside a custom Function, which autograd refuses."""
    fn = _VIEWS_OF_INTERMEDIATES[name]
    x = torch.randn(3, 4)
    expected = _changed_in_place_then_backward(fn, x.clone().requires_grad_())
    got = _changed_in_place_then_backward(dtcompile.jit(fn, cache=cache), x.clone().requires_grad_())
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@torch.enable_grad()
def test_a_returned_view_of_a_value_the_backward_reads_changed_in_place_raises_as_in_eager():
    """Eager raises at the backward (the saved value was changed); the compiled step keeps
    the view its backward's saved value shares, and autograd refuses the change then."""
    fn = lambda x: x.exp().t()  # noqa: E731 (exp's backward reads its output)
    for f in (fn, dtcompile.jit(fn)):
        with pytest.raises(RuntimeError, match="inplace"):
            _changed_in_place_then_backward(f, torch.randn(3, 4, requires_grad=True))
