"""Compiling leaves no reference cycles of dtcompile's objects: what tracing made is
freed as the compile returns, not by Python's cyclic collector, whose next collection
would otherwise walk all of it (at 32 layers a tenth of a second after each compile)."""

import gc
import types
from functools import partial

import pytest
import torch

import dtcompile

CACHES = ["constant values", "symbolic values"]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))[..., :8]


class Model(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x[:, 1:]


def _cyclic_garbage(call) -> list:
    """What of dtcompile's (objects, and frames of its code) ``call`` left in reference cycles."""
    gc.collect()
    debug = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        call()
        gc.collect()
        return [
            f"{type(o).__module__}.{type(o).__qualname__}"
            if not isinstance(o, types.FrameType)
            else f"a frame of {o.f_code.co_qualname}"
            for o in gc.garbage
            if type(o).__module__.startswith("dtcompile")
            or (isinstance(o, types.FrameType) and "dtcompile" in o.f_code.co_filename)
        ]
    finally:
        gc.set_debug(debug)
        gc.garbage.clear()


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("grad", [False, True])
def test_a_compile_leaves_no_cycles_of_its_objects(cache, grad):
    dtcompile.jit(torch.sin)(torch.ones(2))  # (a process's first compile imports torch modules, with cycles)
    torch.manual_seed(0)
    model = Model(layers=4)
    jitted = dtcompile.jit(model, cache=cache)
    x = torch.randn(3, 8)

    def call():
        with torch.set_grad_enabled(grad):
            out = jitted(x)
        if grad:
            out.sum().backward()
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)

    left = _cyclic_garbage(call)
    assert dtcompile.cache_misses(jitted) == 1
    assert not left, f"{len(left)} objects left in cycles, such as {sorted(set(left))[:8]}"


def _all_cyclic_garbage(call) -> int:
    """How many objects (anyone's: torch's pytree walks included) ``call`` left in cycles."""
    gc.collect()
    debug = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        call()
        gc.collect()
        return len(gc.garbage)
    finally:
        gc.set_debug(debug)
        gc.garbage.clear()


def test_the_cycles_a_compile_leaves_do_not_grow_with_the_layers(monkeypatch):
    """Layers checked rather than traced (``capture/verified.py``: each takes its own cache
    layer) made each of their torch calls go through torch's ``tree_flatten``, whose
    recursive closure is a reference cycle per call on torch 2.13: about 19,000 objects at
    32 layers of the Hugging Face Llama for the cyclic collector."""
    from test_outlining import Cache
    from test_outlining import Model as CachedModel

    monkeypatch.delenv("DTCOMPILE_VERIFY_TYPES", raising=False)  # (the tests' own check walks pytrees)
    dtcompile.jit(torch.sin)(torch.ones(2))
    left = {}
    for layers in (4, 16):
        model = CachedModel(layers)
        jitted = dtcompile.jit(model)
        x, cache, expected_cache = torch.randn(1, 2, 8), Cache(layers), Cache(layers)
        with torch.no_grad():
            left[layers] = _all_cyclic_garbage(partial(jitted, x, cache))
            model(x, expected_cache)
            torch.testing.assert_close(jitted(x, cache), model(x, expected_cache), rtol=0, atol=0)
        assert dtcompile.cache_misses(jitted) == 1
    assert left[16] <= left[4] + 100, left  # (14 more per layer before)
