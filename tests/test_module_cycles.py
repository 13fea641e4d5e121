"""A module holding one of its ancestors as a submodule (``self.parent =
weakref.proxy(model)``: the proxy passes ``nn.Module``'s check) makes a module tree with no
end. Tracing walks it, and recursed until Python's limit: a RecursionError where a clear
error is due. Holding the parent otherwise compiles."""

import weakref

import pytest
import torch
from torch import nn

import dtcompile
from dtcompile.core import TracingError


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


class Model(nn.Module):
    def __init__(self, hold):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        for layer in self.layers:
            hold(layer, self)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _proxy(layer, model):
    layer.parent = weakref.proxy(model)


def _itself(layer, model):
    layer.inner = nn.Sequential()
    layer.inner.back = layer


def test_a_module_holding_its_ancestor_is_refused_naming_it():
    for hold, where in ((_proxy, "layers.0.parent"), (_itself, "layers.0.inner.back")):
        model = Model(hold)
        with pytest.raises(TracingError, match=where.replace(".", r"\.") + " is a module above it"):
            dtcompile.jit(model)(torch.randn(2, 4))


def test_a_parent_held_by_a_weak_reference_compiles():
    model = Model(lambda layer, parent: setattr(layer, "parent", weakref.ref(parent)))
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(dtcompile.jit(model)(x), model(x))
