"""Single process: compiled programs keep no more memory alive than eager does. Each
value is freed after its last use (the execution trace's ``del`` lines), and a backward
frees the saved values as it goes (``jit/training.py``). Peaks come from torch's
allocation events (``dtcompile.testing.memory``)."""

import torch

import dtcompile
from dtcompile.testing.memory import peak_bytes

MB = 2**20


def chain(x):
    for _ in range(8):
        x = torch.sin(x) * 2
    return x


def test_an_inference_program_frees_its_intermediates():
    x = torch.randn(256, 1024)  # 1 MiB
    jitted = dtcompile.jit(chain)
    jitted(x)
    eager, compiled = peak_bytes(lambda: chain(x)), peak_bytes(lambda: jitted(x))
    assert compiled <= eager, (compiled / MB, eager / MB)  # 16 MiB if nothing were freed
    assert "del " in str(dtcompile.last_traces(jitted)[-1])


class Stack(torch.nn.Module):
    def __init__(self, width=512, depth=6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) * 2
        return x


def _step(model, x):
    model(x).square().sum().backward()
    model.zero_grad(set_to_none=True)


def test_a_training_step_peaks_no_higher_than_eager():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(256, 512)
    jitted = dtcompile.jit(model)
    for _ in range(2):
        _step(model, x)
        _step(jitted, x)
    eager, compiled = peak_bytes(lambda: _step(model, x)), peak_bytes(lambda: _step(jitted, x))
    # Within a few small allocations (the step's activations are 1.5 MiB; the program's own
    # bookkeeping is a few KiB); 2x eager's if the backward held its saved values to the end.
    assert compiled <= eager + 64 * 1024, (compiled / MB, eager / MB)


def test_a_retained_graph_keeps_the_saved_values_for_a_second_backward():
    torch.manual_seed(0)
    model, x = Stack(depth=2), torch.randn(8, 512)
    jitted = dtcompile.jit(model)
    out = jitted(x).sum()
    out.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    out.backward()  # the saved values were kept: the gradients double
    for p, g in zip(model.parameters(), first):
        torch.testing.assert_close(p.grad, 2 * g)


class WithCache(torch.nn.Module):
    """Returns, beside its output, per-layer values a loss does not use (a KV cache)."""

    def __init__(self, width=512, depth=6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        cache = []
        for layer in self.layers:
            x = layer(x)
            cache.append(x * 3)  # 0.5 MiB each, needs a gradient
            x = torch.tanh(x)
        return x, cache


def _cached_step(model, x, use=()):
    out, cache = model(x)
    (out.square().sum() + sum(cache[i].sum() for i in use)).backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_outputs_the_loss_does_not_use_get_no_zero_gradients_held_through_the_backward():
    torch.manual_seed(0)
    model, x = WithCache(), torch.randn(256, 512)
    jitted = dtcompile.jit(model)
    for use in ((), (0,), (1, 5)):  # none of the cache, some of it: the gradients are eager's
        for got, expected in zip(_cached_step(jitted, x, use), _cached_step(model, x, use), strict=True):
            torch.testing.assert_close(got, expected)
    assert dtcompile.cache_misses(jitted) == 1
    eager, compiled = peak_bytes(lambda: _cached_step(model, x)), peak_bytes(lambda: _cached_step(jitted, x))
    # The program makes each unused output's zero gradient where it first reads it, and
    # frees it after its last use: one of them (0.5 MiB) is alive at a time, where eager
    # computes nothing for them. Autograd's zeros for all six, made before the backward,
    # were 3 MiB more.
    assert compiled <= eager + MB // 2 + 64 * 1024, (compiled / MB, eager / MB)
    assert "= made(" in str(dtcompile.last_traces(jitted)[-1])
