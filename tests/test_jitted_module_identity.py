"""Single process: the jitted module shares the module's state and is traced as the module
itself (its forward's ``self`` is of the module's own class, as eager's code may ask). What
changes the module's class is followed; what changes the jitted object's class alone (a
parametrization registered on it, its class set or patched) is refused at its next call,
where it crashed inside tracing or silently ran the old forward; copies are of the module."""

import copy

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch.nn.utils.parametrizations import weight_norm

import dtcompile

CACHES = ["constant values", "symbolic values"]
_REFUSED = "the class of the jitted Linear was changed after jit"


class _Symmetric(torch.nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).t()


def _parametrize(target, how):
    if how == "weight_norm":
        weight_norm(target)
    else:
        parametrize.register_parametrization(target, "weight", _Symmetric())


@torch.no_grad()
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("how", ["parametrization", "weight_norm"])
def test_a_parametrization_on_the_jitted_module_is_refused_on_the_module_followed(how, cache):
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    jitted = dtcompile.jit(torch.nn.Linear(4, 4), cache=cache)
    jitted(x)
    _parametrize(jitted, how)  # an AttributeError inside tracing before
    with pytest.raises(dtcompile.TracingError, match=_REFUSED):
        jitted(x)
    # On the module before jit, or on a submodule of a jitted model, it is the call's.
    module, eager = torch.nn.Sequential(torch.nn.Linear(4, 4)), None
    eager = copy.deepcopy(module)
    jitted = dtcompile.jit(module, cache=cache)
    jitted(x)
    _parametrize(module[0], how)
    _parametrize(eager[0], how)
    assert torch.allclose(jitted(x), eager(x))


@torch.no_grad()
@pytest.mark.parametrize("cache", CACHES)
def test_the_jitted_objects_class_set_or_patched_is_refused(cache):
    # The old forward ran, silently.
    module = torch.nn.Linear(4, 4)
    jitted = dtcompile.jit(module, cache=cache)
    x = torch.randn(2, 4)
    jitted(x)

    class Doubled(type(jitted)):
        def forward(self, x):
            return super().forward(x) * 2

    jitted.__class__ = Doubled
    with pytest.raises(dtcompile.TracingError, match=_REFUSED):
        jitted(x)


class _Typed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        scale = 2.0 if type(self) is _Typed else 3.0  # what eager's self is
        return self.lin(x) * scale, type(self).__name__


def test_the_forwards_self_is_of_the_modules_own_class():
    module = _Typed()
    jitted = dtcompile.jit(module)
    with torch.no_grad():
        got, expected = jitted(torch.ones(1, 3)), module(torch.ones(1, 3))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] == "_Typed"


def test_copies_of_a_jitted_module_are_the_modules_own():
    # A shallow copy shared the module's __dict__ (its eval() changed the module); a deep
    # copy after the module's class was set lost that class.
    module = torch.nn.Linear(3, 3)
    jitted = dtcompile.jit(module)
    shallow = copy.copy(jitted)
    shallow.eval()
    shallow.extra = 1
    assert module.training and not hasattr(module, "extra")

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 3

    module.__class__ = Scaled
    deep = copy.deepcopy(jitted)
    with torch.no_grad():
        x = torch.ones(1, 3)
        assert torch.allclose(deep(x), module(x)) and torch.allclose(jitted(x), module(x))
