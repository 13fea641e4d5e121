"""Numbers a layer reads that decide what it records: a tensor's value known while
tracing (``int(t)``, ``t.item()``, ``x.roll(t)``: the number is baked into the program),
NumPy's scalars and complex numbers (``-0.0`` equals ``0.0``), as a later layer's or
block's argument, and as a compiled function's own argument.

Layers checked against a logged one (``verified.py``) and blocks replayed from the
first (``blocks.py``) must tell these apart, as tracing each would; every result must be
eager's, bit for bit.
"""

import enum

import numpy as np
import pytest
import torch
import torch.nn as nn
from test_outlining import CACHES

import dtcompile

READS = {
    "int": lambda t: int(t),
    "item": lambda t: t.item(),
    "tolist": lambda t: t.tolist(),
    "float": lambda t: float(t),
}


class Scaled(nn.Module):
    """A layer scaling by a number read from a tensor it is given; ``layer_idx``, where it
    differs, makes its calls traced as they are, then checked (else it is replayed)."""

    def __init__(self, index: int, read: str):
        super().__init__()
        self.layer_idx, self.read = index, read
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, scale):
        h = x + torch.softmax(self.a(x).relu() @ self.b(x).t(), -1) @ x
        if self.read == "roll":
            return h.roll(scale, 1)  # (the shift read from the tensor's value)
        return h * READS[self.read](scale)


class ScaledModel(nn.Module):
    def __init__(self, read: str, per_layer: bool):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Scaled(i if per_layer else 0, read) for i in range(6))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x, torch.full((), 1 if i < 4 else 2))  # the later layers' differs
        return x


@pytest.mark.parametrize("read", [*READS, "roll"])
@pytest.mark.parametrize("per_layer", [True, False], ids=["checked layers", "replayed blocks"])
@pytest.mark.parametrize("cache", CACHES)
def test_a_number_read_from_a_known_value_is_each_layers(read, per_layer, cache):
    model, x = ScaledModel(read, per_layer), torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
        got = dtcompile.jit(model, cache=cache)(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_known_value_read_by_replayed_blocks_under_gradients():
    model, x = ScaledModel("item", False), torch.randn(2, 4, requires_grad=True)
    expected = model(x)
    expected.sum().backward()
    expected_grads = [x.grad, *(p.grad for p in model.parameters())]
    x.grad = None
    model.zero_grad(set_to_none=True)
    got = dtcompile.jit(model)(x)
    got.sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for g, want in zip([x.grad, *(p.grad for p in model.parameters())], expected_grads, strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=0)


class SignedZero(nn.Module):
    """Adds 1 where its zero is negative: ``zero`` is a NumPy scalar or a complex number."""

    def __init__(self, index: int, zero, per_layer: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.zero, self.layer_idx = zero, index if per_layer else 0

    def forward(self, x):
        h = torch.softmax(self.lin(x).relu() @ x.t(), -1) @ x
        scaled = h.abs() * self.zero
        return h + torch.signbit(scaled.real if scaled.is_complex() else scaled).float()


ZEROS = {
    "np.float64": (np.float64(0.0), np.float64(-0.0)),
    "complex": (complex(0.0, 0.0), complex(-0.0, 0.0)),
}


@pytest.mark.parametrize("zeros", ZEROS)
@pytest.mark.parametrize("per_layer", [True, False], ids=["checked layers", "replayed blocks"])
def test_a_negative_zero_a_later_layer_holds_is_its_own(zeros, per_layer):
    positive, negative = ZEROS[zeros]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(SignedZero(i, positive if i < 4 else negative, per_layer) for i in range(7))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model, x = Model(), torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
        got = dtcompile.jit(model)(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class Level(enum.IntEnum):
    LOW = 2
    HIGH = 3


@pytest.mark.parametrize(
    "values",
    [
        (np.float64(0.5), np.float64(0.25)),
        (np.float64(0.0), np.float64(-0.0)),
        (complex(0.0, 1.0), complex(-0.0, 1.0)),
        (Level.LOW, Level.HIGH),
        (Level.LOW, 2),
    ],
    ids=["np.float64", "np.float64 signed zeros", "complex signed zeros", "IntEnum", "IntEnum or int"],
)
@pytest.mark.parametrize("cache", CACHES)
def test_a_number_argument_of_another_type_or_sign_is_guarded(values, cache):
    # A NumPy scalar is a float by type: its guard named ``np``, or refused the call it was compiled for.
    def f(x, s):
        out = x * s
        return torch.view_as_real(out) if out.is_complex() else (out, type(s).__name__)

    jitted = dtcompile.jit(f, cache=cache)
    x = torch.tensor([1.0, -2.0])
    for value in values + values:
        got, expected = jitted(x, value), f(x, value)
        if isinstance(expected, tuple):
            assert got[1] == expected[1]
            got, expected = got[0], expected[0]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert torch.equal(torch.signbit(got), torch.signbit(expected))
    assert dtcompile.cache_misses(jitted) == 2
