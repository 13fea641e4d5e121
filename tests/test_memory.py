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
