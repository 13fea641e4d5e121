"""A call under the caller's autocast whose code changes autocast inside (Hugging Face's
rotary embedding computes in float32 under ``autocast(enabled=False)``): the program has
the casts autocast made while tracing, and must not be cast again when it runs. A
training call's backward is eager's whether ``.backward()`` runs outside autocast (as
torch recommends) or inside it."""

import copy

import pytest
import torch
import torch.utils.checkpoint

import dtcompile
from dtcompile.testing.compare import assert_same

CACHES = ["constant values", "symbolic values"]


def _float32_inside(x, w):
    with torch.autocast("cpu", enabled=False):  # "force float32"
        return x.float() @ w


def _float16_inside(x, w):
    with torch.autocast("cpu", dtype=torch.float16):
        return x @ w


def _mixed(x, w):
    y = torch.relu(x @ w)  # cast by the caller's autocast
    with torch.autocast("cpu", enabled=False):
        z = y.float().softmax(-1) @ w.t()
    return z.sum(-1, keepdim=True) * (y @ w)


def _run(fn, x, w, backward_inside: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(x, w)
        if backward_inside and out.requires_grad:
            out.float().sum().backward()
    if not backward_inside and out.requires_grad:
        out.float().sum().backward()
    return out


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("fn", [_float32_inside, _float16_inside, _mixed])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward outside", "backward inside"])
def test_autocast_changed_inside_the_call(cache, fn, grad, backward_inside):
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    jitted = dtcompile.jit(fn, cache=cache)
    for _ in range(2):  # compiled, then cached
        x_eager, x_compiled = (x.clone().requires_grad_(grad) for _ in range(2))
        expected = _run(fn, x_eager, w, backward_inside)
        if grad and backward_inside:  # eager's backward casts the region's gradients, the compiled one cannot
            with pytest.raises(RuntimeError, match="backward of a compiled call runs under autocast"):
                _run(jitted, x_compiled, w, backward_inside)
            return
        got = _run(jitted, x_compiled, w, backward_inside)
        assert got.dtype == expected.dtype
        assert_same(got.detach(), expected.detach())
        if grad:
            assert_same(x_compiled.grad, x_eager.grad)


class _Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.utils.checkpoint.checkpoint(lambda h: torch.relu(self.a(h)), x, use_reentrant=False))


def _sequential():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward outside", "backward inside"])
@pytest.mark.parametrize("make", [_sequential, _Checkpointed], ids=["sequential", "checkpointed"])
def test_a_module_trained_under_autocast(cache, backward_inside, make):
    """(A checkpoint's recompute enters autocast itself: torch's code, in the backward.)"""
    torch.manual_seed(0)
    model = make()
    compiled_model = copy.deepcopy(model)
    jitted = dtcompile.jit(compiled_model, cache=cache)
    x = torch.randn(5, 8)
    for _ in range(2):
        expected = _run(lambda x, _: model(x), x, None, backward_inside)
        got = _run(lambda x, _: jitted(x), x, None, backward_inside)
        assert_same(got.detach(), expected.detach())
        for (name, p), q in zip(model.named_parameters(), compiled_model.parameters()):
            assert_same(q.grad, p.grad, name)


@pytest.mark.parametrize("cache", CACHES)
def test_a_backward_under_autocast_after_a_call_outside_it_is_refused(cache):
    """Eager's backward would run the forward's float32 matmuls' gradients in bfloat16."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    jitted, x = dtcompile.jit(model, cache=cache), torch.randn(3, 8)
    loss = jitted(x).pow(2).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="backward of a compiled call runs under autocast"):
            loss.backward()
    jitted(x).pow(2).sum().backward()  # outside: eager's


class _HookedMatmul(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.p = torch.nn.Linear(8, 8), torch.randn(8, 8)

    def forward(self, x):
        h = self.a(x)
        h.register_hook(lambda g: (g.float() @ self.p).to(g.dtype))  # eager's runs under the backward's autocast
        return h.relu().sum(-1)


@pytest.mark.parametrize("cache", CACHES)
def test_a_hook_in_a_backward_under_autocast_is_refused_and_outside_is_eagers(cache):
    torch.manual_seed(0)
    model, x = _HookedMatmul(), torch.randn(4, 8)
    jitted = dtcompile.jit(model, cache=cache)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = jitted(x).float().sum()
        with pytest.raises(RuntimeError, match="runs code of yours"):
            loss.backward()
    expected = _run(lambda x, _: model(x), x, None, False)
    model.zero_grad()
    got = _run(lambda x, _: jitted(x), x, None, False)
    assert_same(got.detach(), expected.detach())
