"""Repeated blocks that differ in what the equivalence check did not see: state in a
C-level container's subclass, a partial's own attributes, which tensors a block ties,
Python state its parent changes past the block's own globals, the input's leafness, the
saved tensors hooks around one block. Each gave the first block's result for a later
one, with no error; each is now traced on its own. And a generator of a module's own
(``random.Random(seed)``), whose draw would be baked in: refused."""

import array
import collections
import copy
import decimal
import functools
import os
import random
import sys
import types

import numpy
import pytest
import torch
from torch import nn

import dtcompile

CACHES = ["constant values", "symbolic values"]


def _compare(model, x, cache, grad=False, calls=1, between=lambda m: None):
    """The jitted model's outputs (and gradients) against eager's, on a copy."""
    reference = copy.deepcopy(model)
    jitted = dtcompile.jit(model, cache=cache)
    for _ in range(calls):
        with torch.set_grad_enabled(grad):
            inputs = x.clone().requires_grad_(grad)
            expected, got = reference(inputs), jitted(inputs.clone().detach().requires_grad_(grad))
        torch.testing.assert_close(got, expected)
        if grad:
            expected.sum().backward()
            got.sum().backward()
            for (name, a), b in zip(reference.named_parameters(), model.parameters()):
                torch.testing.assert_close(b.grad, a.grad, msg=name)
        between(reference)
        between(model)


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class DequeScale(collections.deque):
    pass


class ArrayScale(array.array):
    pass


class BytesScale(bytearray):
    pass


class DecimalScale(decimal.Decimal):
    pass


class NumpyScale(numpy.ndarray):
    pass


_SCALES = {
    "deque": lambda v: DequeScale([v]),
    "array": lambda v: ArrayScale("d", [v]),
    "bytearray": lambda v: BytesScale([int(v)]),
    "Decimal": lambda v: DecimalScale(v),
    "ndarray": lambda v: numpy.full(1, v).view(NumpyScale),
}


class ScaledLayer(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        scale = self.scale
        value = float(scale) if isinstance(scale, decimal.Decimal) else float(scale[0])
        return self.lin(x) * value


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", list(_SCALES))
def test_blocks_told_apart_by_a_c_container_subclass_they_hold(cache, kind):
    torch.manual_seed(0)
    model = Stack([ScaledLayer(_SCALES[kind](float(i + 1))) for i in range(3)])
    _compare(model, torch.randn(2, 4), cache)


class PartialLayer(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = functools.partial(torch.nn.functional.gelu, approximate="none")
        self.act.k = k

    def forward(self, x):
        return self.act(self.lin(x)) * self.act.k


def _set_k(model):
    for layer in model.layers:
        layer.act.k += 1.0


@pytest.mark.parametrize("cache", CACHES)
def test_a_partials_own_attributes_tell_blocks_and_calls_apart(cache):
    torch.manual_seed(0)
    model = Stack([PartialLayer(float(i + 1)) for i in range(3)])
    _compare(model, torch.randn(2, 4), cache, calls=2, between=_set_k)


class TiedLayer(nn.Module):
    def __init__(self, tied):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        if tied:
            self.b.weight = self.a.weight

    def forward(self, x):
        if self.a.weight is self.b.weight:  # tied: used once
            return self.a(x)
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_blocks_told_apart_by_which_tensors_they_tie(cache, grad):
    torch.manual_seed(0)
    _compare(Stack([TiedLayer(False), TiedLayer(True), TiedLayer(False)]), torch.randn(2, 4), cache, grad=grad)


def _tie_second(model):
    model.layers[1].b.weight = model.layers[1].a.weight


@pytest.mark.parametrize("cache", CACHES)
def test_weights_tied_after_a_call_are_seen_by_code_asking_is(cache):
    torch.manual_seed(0)
    _compare(Stack([TiedLayer(False) for _ in range(2)]), torch.randn(2, 4), cache, calls=2, between=_tie_second)


settings = types.ModuleType("block_settings")  # a user module the layers read
settings.SCALE = 1.0
CONFIG = {"attention": {"scale": 1.0}}


class GlobalLayer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x):
        if self.kind == "nested global dict":
            scale = CONFIG["attention"]["scale"]
        elif self.kind == "another module's global":
            scale = settings.SCALE
        else:
            scale = float(os.environ.get("DTCOMPILE_TEST_LAYER_SCALE", "1"))
        return self.lin(x) * scale


def _set_scale(kind, value):
    if kind == "nested global dict":
        CONFIG["attention"]["scale"] = value
    elif kind == "another module's global":
        settings.SCALE = value
    else:
        os.environ["DTCOMPILE_TEST_LAYER_SCALE"] = str(int(value))


class SettingParent(Stack):
    def __init__(self, kind):
        super().__init__([GlobalLayer(kind) for _ in range(3)])
        self.kind = kind

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            _set_scale(self.kind, float(index + 1))  # each layer runs with its own scale
            x = layer(x)
        _set_scale(self.kind, 1.0)
        return x


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", ["nested global dict", "another module's global", "environment"])
def test_state_the_parent_changes_past_the_blocks_own_globals(cache, kind):
    torch.manual_seed(0)
    _set_scale(kind, 1.0)
    try:
        _compare(SettingParent(kind), torch.randn(2, 4), cache)
    finally:
        os.environ.pop("DTCOMPILE_TEST_LAYER_SCALE", None)


class LeafLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y * 2.0 if x.is_leaf else y


@pytest.mark.parametrize("cache", CACHES)
def test_blocks_told_apart_by_whether_their_input_is_a_leaf(cache):
    torch.manual_seed(0)
    _compare(Stack([LeafLayer() for _ in range(3)]), torch.randn(2, 4), cache, grad=True)


class HookedParent(Stack):
    def __init__(self, hooked):
        super().__init__([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
        self.hooked = hooked

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            if index == self.hooked:  # what autograd saves for this layer comes back doubled
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t * 2):
                    x = layer(x)
            else:
                x = layer(x)
        return x


@pytest.mark.parametrize("hooked", [0, 2])
def test_blocks_told_apart_by_the_saved_tensors_hooks_around_them(hooked):
    torch.manual_seed(0)
    _compare(HookedParent(hooked), torch.randn(2, 4), "constant values", grad=True)


class DrawingLayer(nn.Module):
    def __init__(self, generator):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rng = generator

    def forward(self, x):
        draw = self.rng.random() if hasattr(self.rng, "random") else self.rng.rand()
        return self.lin(x) * float(draw)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "generator",
    [lambda: random.Random(0), lambda: numpy.random.default_rng(0), lambda: numpy.random.RandomState(0)],
    ids=["random.Random", "numpy Generator", "numpy RandomState"],
)
def test_a_generator_of_a_modules_own_is_refused_and_put_back(cache, generator):
    layer = DrawingLayer(generator())
    expected = generator().random() if not isinstance(layer.rng, numpy.random.RandomState) else generator().rand()
    with torch.no_grad(), pytest.raises(dtcompile.TracingError, match="rng"):
        dtcompile.jit(layer, cache=cache)(torch.randn(2, 4))
    draw = layer.rng.random() if hasattr(layer.rng, "random") else layer.rng.rand()
    assert draw == expected  # the draw made while tracing was undone


assert "block_settings" not in sys.modules  # (the module above is reached through this file's globals)
