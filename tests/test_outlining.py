"""Blocks traced as they are, then called (``capture/outlining.py``): layers that cannot
be replayed (each reads its own KV-cache layer through its index, and updates it in
place) are traced one by one; where they recorded the same symbols with other tensors,
the trace calls one program per layer.

Every result must be eager's, bit for bit, and so must every tensor the layers write;
the program with outlining must compute what the one without computes.
"""

import re

import pytest
import torch
import torch.nn as nn
from test_block_calls import calls_in

import dtcompile
from dtcompile.capture import outlining

CACHES = ["constant values", "symbolic values"]


class CacheLayer:
    def __init__(self, length: int, dim: int):
        self.keys = torch.zeros(1, length, dim)
        self.filled = torch.tensor(0)


class Cache:
    """A static cache, a layer of it per decoder layer (as Hugging Face's ``StaticCache``)."""

    def __init__(self, layers: int, length: int = 16, dim: int = 8):
        self.layers = [CacheLayer(length, dim) for _ in range(layers)]

    def update(self, keys: torch.Tensor, index: int) -> torch.Tensor:
        layer = self.layers[index]
        positions = torch.arange(keys.shape[1]) + layer.filled
        layer.filled.add_(keys.shape[1])
        layer.keys.index_copy_(1, positions, keys)
        return layer.keys


class Layer(nn.Module):
    def __init__(self, index: int, dim: int = 8):
        super().__init__()
        self.layer_idx = index
        self.key = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, cache):
        keys = cache.update(self.key(x), self.layer_idx)
        scores = torch.softmax(x @ keys.transpose(1, 2), dim=-1)
        return x + self.out(scores @ keys)


class Model(nn.Module):
    def __init__(self, layers: int = 4, layer=Layer):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(layer(i) for i in range(layers))

    def forward(self, x, cache):
        for layer in self.layers:
            x = layer(x, cache)
        return x


def generate(forward, cache: Cache, steps: int = 3, length: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(1)
    outs = []
    with torch.no_grad():
        for step in range(steps):
            outs.append(forward(torch.randn(1, length if step == 0 else 1, 8), cache))
    return outs


def assert_like_eager(model, cache_layers: int, outlined: bool = True, mode: str = "constant values") -> str:
    """Runs a generation compiled and eagerly, each with its own cache; compares every
    output and every cache tensor bit for bit; returns the compiled program."""
    expected_cache, cache = Cache(cache_layers), Cache(cache_layers)
    expected = generate(model, expected_cache)
    saved, outlining.ENABLED = outlining.ENABLED, outlined
    try:
        jitted = dtcompile.jit(model, cache=mode)
        got = generate(jitted, cache)
    finally:
        outlining.ENABLED = saved
    for out, want in zip(got, expected, strict=True):
        assert out.stride() == want.stride()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    for layer, want in zip(cache.layers, expected_cache.layers):
        torch.testing.assert_close(layer.keys, want.keys, rtol=0, atol=0)
        torch.testing.assert_close(layer.filled, want.filled, rtol=0, atol=0)
    return str(dtcompile.last_traces(jitted)[0])


@pytest.mark.parametrize("cache", CACHES)
def test_layers_reading_their_cache_layer_are_one_program(cache):
    model = Model(6)
    program = assert_like_eager(model, 6, mode=cache)
    called = calls_in(program)
    assert len(called) == 6 and len(set(called)) == 1, program
    assert "one program for 6 blocks traced alike (layers.0, layers.1, layers.2, ...)" in program
    # The program writes the cache layer it is given, in place: the call names it.
    assert "index_copy_" not in program.split("def computation")[1]


@pytest.mark.parametrize("cache", CACHES)
def test_outlined_and_traced_programs_compute_alike(cache):
    model = Model(4)
    traced = assert_like_eager(model, 4, outlined=False, mode=cache)
    assert not calls_in(traced)
    assert_like_eager(model, 4, outlined=True, mode=cache)


class Branching(Layer):
    def forward(self, x, cache):
        out = super().forward(x, cache)
        return out * 2 if self.layer_idx == 2 else out  # one layer computes otherwise


def test_a_layer_that_records_other_symbols_is_left_as_traced():
    model = Model(4, layer=Branching)
    program = assert_like_eager(model, 4)
    called = calls_in(program)
    assert len(called) == 3 and len(set(called)) == 1, program  # every layer but the third
    assert re.search(r"aten\.mul\.Tensor\(\w+, 2\)", program.split("def computation")[1])


class Shared(Layer):
    """Each layer leaves a value of its own for the caller, on the cache."""

    def forward(self, x, cache):
        hidden = self.key(x) * 3
        cache.layers[self.layer_idx].hidden = hidden
        return x + self.out(hidden)


def test_a_value_read_after_its_layer_is_returned_by_the_program():
    class Model2(Model):
        def forward(self, x, cache):
            x = super().forward(x, cache)
            return x + sum(layer.hidden for layer in cache.layers)

    model = Model2(6, layer=Shared)
    program = assert_like_eager(model, 6)
    assert len(calls_in(program)) == 6, program
    first_call = next(line for line in program.splitlines() if "= block_" in line)
    assert first_call.split("=")[0].count("t") == 2  # the layer's output and its hidden value


class WritesItsInput(Layer):
    def forward(self, x, cache):
        x.mul_(2)  # in place, on what its caller passes
        return super().forward(x, cache) + x


def test_a_program_that_writes_its_argument_is_an_in_place_call():
    class Model3(Model):
        def forward(self, x, cache):
            x = x + 1
            outs = []
            for layer in self.layers:
                before = x * 1  # read before the call writes x
                x = layer(x, cache)
                outs.append(before)
            return x, torch.stack(outs)

    model = Model3(6, layer=WritesItsInput)
    expected_cache, cache = Cache(6), Cache(6)
    torch.manual_seed(1)
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        expected = model(x.clone(), expected_cache)
        jitted = dtcompile.jit(model)
        got = jitted(x.clone(), cache)
    for out, want in zip(got, expected):
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert len(calls_in(str(dtcompile.last_traces(jitted)[0]))) == 6
