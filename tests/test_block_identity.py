"""Blocks whose code tells them apart by identity are not replayed (``block_checks.py``,
``identity_read``): equivalent state, but ``REGISTRY[id(self)]``, ``self is LAST`` or
``self in SKIP`` give each block its own computation (in the block's methods, or in
helpers, properties, static and class methods, mixins and held functions they reach), which a replay of the first block's
recording would lose. Each variant's results must be eager's, with and without gradients,
replayed blocks recorded again or called, under both cache options.
"""

import sys
import types
import weakref

import pytest
import torch
import torch.nn as nn

import dtcompile
from dtcompile.capture import block_calls

REGISTRY: dict = {}  # id(block) -> scale
LAST = None  # one block, compared by identity
SKIP: set = set()  # blocks that return their input
WEAK_SKIP: weakref.WeakSet = weakref.WeakSet()
SCALES_BY_BLOCK: dict = {}  # block -> scale


class Block(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def body(self, x):
        return self.down(torch.relu(self.up(x)))


class ById(Block):
    def forward(self, x):
        return x + self.body(x) * REGISTRY[id(self)]


class IsLast(Block):
    def forward(self, x):
        y = self.body(x)
        return x + (y * 0.0 if self is LAST else y)


class InSkip(Block):
    def forward(self, x):
        return x if self in SKIP else x + self.body(x)


class InWeakSkip(Block):
    def forward(self, x):
        return x if self in WEAK_SKIP else x + self.body(x)


class ByBlock(Block):
    def forward(self, x):
        return x + self.body(x) * SCALES_BY_BLOCK[self]


class ClassRegistry(Block):
    SCALES: dict = {}

    def forward(self, x):
        return x + self.body(x) * self.SCALES[id(self)]


class SharedSet(Block):
    """Every block holds the same set (equal attributes), which names one of them."""

    def forward(self, x):
        return x if self in self.skip else x + self.body(x)


def _scale_of(block):  # a helper the block's method calls
    return REGISTRY[id(block)]


def _scale_two_down(block):  # a helper calling a helper
    return _scale_of(block)


class Lookup:  # a user class whose static method reads the registry
    @staticmethod
    def scale(block):
        return SCALES_BY_BLOCK[block]


# A user Python module the block's code reaches by attribute (``helpers.scale_of``).
helpers = types.ModuleType("identity_helpers")
exec("def scale_of(block):\n    return TABLE[id(block)]\n", vars(helpers))
helpers.TABLE = REGISTRY
sys.modules["identity_helpers"] = helpers


class ByHelper(Block):
    def forward(self, x):
        return x + self.body(x) * _scale_two_down(self)


class ByProperty(Block):
    @property
    def scale(self):
        return REGISTRY[id(self)]

    def forward(self, x):
        return x + self.body(x) * self.scale


class ByStaticMethod(Block):
    @staticmethod
    def scale(block):
        return REGISTRY[id(block)]

    def forward(self, x):
        return x + self.body(x) * self.scale(self)


class ByClassMethod(Block):
    @classmethod
    def scale(cls, block):
        return REGISTRY[id(block)]

    def forward(self, x):
        return x + self.body(x) * self.scale(self)


class ByUserClass(Block):
    def forward(self, x):
        return x + self.body(x) * Lookup.scale(self)


class ByHelperModule(Block):
    def forward(self, x):
        return x + self.body(x) * helpers.scale_of(self)


class ScaleMixin:
    def scale(self):
        return REGISTRY[id(self)]


class ByMixinAfterModule(Block, ScaleMixin):  # the mixin comes after nn.Module in the MRO
    def forward(self, x):
        return x + self.body(x) * self.scale()


class ByHeldFunction(Block):
    """Each block holds the same function (equal attributes), which reads the registry."""

    def forward(self, x):
        return x + self.body(x) * self.scale_fn(self)


class ByFunctionTable(Block):
    """Each block holds an equal table of functions; one reads the registry."""

    def forward(self, x):
        return x + self.body(x) * self.functions["scale"](self)


class ByHelperObject(Block):
    """Each block holds an equal helper object whose method reads the registry."""

    def forward(self, x):
        return x + self.body(x) * self.lookup.scale(self)


class Stack(nn.Module):
    def __init__(self, cls, n: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList(cls() for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _model(cls) -> Stack:
    global LAST
    model = Stack(cls)
    layers = list(model.layers)
    REGISTRY.clear()
    REGISTRY.update({id(layer): float(i + 1) for i, layer in enumerate(layers)})
    ClassRegistry.SCALES.clear()
    ClassRegistry.SCALES.update({id(layer): float(i + 1) for i, layer in enumerate(layers)})
    SCALES_BY_BLOCK.clear()
    SCALES_BY_BLOCK.update({layer: float(i + 1) for i, layer in enumerate(layers)})
    LAST = layers[-1]
    SKIP.clear()
    SKIP.add(layers[2])
    WEAK_SKIP.clear()
    WEAK_SKIP.add(layers[2])
    for layer in layers:
        if cls is ByHeldFunction:
            layer.scale_fn = _scale_of
        if cls is ByFunctionTable:
            layer.functions = {"scale": _scale_of}
        if cls is ByHelperObject:
            layer.lookup = Lookup()
    if cls is SharedSet:
        shared = {layers[2]}
        for layer in layers:
            layer.skip = shared
    return model


def _run(model, x, cache: str, calls: bool, grad: bool):
    saved = block_calls.BLOCK_CALLS
    block_calls.BLOCK_CALLS = calls
    try:
        with torch.set_grad_enabled(grad):
            return dtcompile.jit(model, cache=cache)(x)
    finally:
        block_calls.BLOCK_CALLS = saved


VARIANTS = [ById, IsLast, InSkip, InWeakSkip, ByBlock, ClassRegistry, SharedSet]
# Reached through code other than the block's own methods.
VARIANTS += [ByHelper, ByProperty, ByStaticMethod, ByClassMethod, ByUserClass, ByHelperModule]
VARIANTS += [ByMixinAfterModule, ByHeldFunction, ByFunctionTable, ByHelperObject]


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("calls", [True, False], ids=["called", "recorded again"])
@pytest.mark.parametrize("cls", VARIANTS, ids=lambda c: c.__name__)
def test_blocks_told_apart_by_identity_give_eager_results(cls, calls, cache):
    model = _model(cls)
    x = torch.randn(2, 3, 8)
    out = _run(model, x, cache, calls, grad=False)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [ById, IsLast, InSkip, SharedSet, ByHelper, ByHeldFunction], ids=lambda c: c.__name__)
def test_blocks_told_apart_by_identity_give_eager_gradients(cls):
    model = _model(cls)
    x = torch.randn(2, 3, 8)
    out = _run(model, x, "constant values", True, grad=True)
    out.sum().backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()  # a skipped block's parameters get no gradient
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-6)


def test_a_block_named_after_compiling_compiles_anew_and_gives_eager_results():
    model = _model(InSkip)
    SKIP.clear()
    x = torch.randn(2, 3, 8)
    jitted = dtcompile.jit(model)
    with torch.no_grad():
        jitted(x)
        SKIP.add(model.layers[1])
        out = jitted(x)
        expected = model(x)
    assert dtcompile.cache_misses(jitted) == 2
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_blocks_that_do_not_read_identity_are_still_replayed():
    """A global the code names that holds no block (a table of numbers) does not stop the
    replay: the trace says the blocks were recorded once."""
    model = _model(ById)
    REGISTRY.clear()
    REGISTRY.update({i: 2.0 for i in range(4)})
    for layer in model.layers:
        type(layer).forward = _by_index
    try:
        with torch.no_grad():
            jitted = dtcompile.jit(model)
            out = jitted(torch.ones(2, 3, 8))
            expected = model(torch.ones(2, 3, 8))
    finally:
        ById.forward = _by_id
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert "recorded once, replayed for 3 more" in str(dtcompile.last_traces(jitted)[0])


_by_id = ById.forward


def _by_index(self, x):
    return x + self.body(x) * REGISTRY[0]
