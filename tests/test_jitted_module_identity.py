"""Single process: the jitted module is the object traced and guarded, so what is done to
it after compiling (a parametrization registered, its class set or patched) is its next
call's, and its forward's ``self`` is it, as in eager."""

import copy

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch.nn.utils.parametrizations import weight_norm

import dtcompile

CACHES = ["constant values", "symbolic values"]


class _Symmetric(torch.nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).t()


@torch.no_grad()
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("how", ["parametrization", "weight_norm"])
def test_a_parametrization_registered_on_the_jitted_module_is_its_next_calls(how, cache):
    # The traced object was the module before: its weight had moved to the parametrization
    # (an AttributeError while tracing).
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    eager = copy.deepcopy(module)
    jitted = dtcompile.jit(module, cache=cache)
    x = torch.randn(2, 4)
    assert torch.equal(jitted(x), eager(x))
    for target in (jitted, eager):
        if how == "weight_norm":
            weight_norm(target)
        else:
            parametrize.register_parametrization(target, "weight", _Symmetric())
    assert torch.allclose(jitted(x), eager(x))


@torch.no_grad()
@pytest.mark.parametrize("cache", CACHES)
def test_the_jitted_modules_class_set_or_patched_is_seen(cache):
    # The class of the object traced did not change: the old forward ran, silently.
    module = torch.nn.Linear(4, 4)
    jitted = dtcompile.jit(module, cache=cache)
    x = torch.randn(2, 4)
    plain = jitted(x)

    class Doubled(type(jitted)):
        def forward(self, x):
            return super().forward(x) * 2

    jitted.__class__ = Doubled
    assert torch.allclose(jitted(x), plain * 2)
    Doubled.forward = lambda self, x: torch.nn.Linear.forward(self, x) * 3
    assert torch.allclose(jitted(x), plain * 3)


class _ReturnsItself(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x), self


def test_a_forward_returning_self_returns_the_jitted_module():
    jitted = dtcompile.jit(_ReturnsItself())
    with torch.no_grad():
        for _ in range(2):
            assert jitted(torch.ones(1, 3))[1] is jitted
