"""Attributes of Python functions (``f.scale = 2``, a function's "static variable"): read
by the traced code, they are guarded like other Python state, and the traced code changing
them (a call counter, a stashed result) is refused, as for globals. Before, a changed
attribute kept the first call's value, and one set inside the call ran once, while
tracing (leaving a traced stand-in in ``h.last``)."""

import pytest
import torch
from torch import nn

import dtcompile

CACHES = ["constant values", "symbolic values"]


def own(x):
    return x * own.scale


def holder():
    pass


def reaching(x):
    return x * holder.scale


def in_a_dict(x):
    return x * in_a_dict.cfg["s"]


class WithHelper(nn.Module):
    def helper(self, x):
        return x * WithHelper.helper.scale

    def forward(self, x):
        return self.helper(x)


@dtcompile.jit
def jitted_inner(x):
    return x * jitted_inner.scale


def calls_jitted(x):
    return jitted_inner(x) + 1


def _set(fn, name):
    return lambda value: setattr(fn, name, value)


CASES = {
    "its own": (own, _set(own, "scale")),
    "another function's": (reaching, _set(holder, "scale")),
    "a dict it holds, changed in place": (in_a_dict, lambda value: in_a_dict.cfg.__setitem__("s", value)),
    "a method's function": (WithHelper(), _set(WithHelper.helper, "scale")),
    "a jitted function's": (calls_jitted, _set(jitted_inner, "scale")),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("case", CASES)
def test_a_function_attribute_changed_between_calls_is_seen(cache, case):
    fn, change = CASES[case]
    in_a_dict.cfg = {"s": 1.0}
    jitted = dtcompile.jit(fn, cache=cache)
    x = torch.arange(3.0)
    for value in (2, 3, 4.5):
        change(value)
        torch.testing.assert_close(jitted(x), fn(x), rtol=0, atol=0)


def counting(x):
    counting.calls = counting.calls + 1
    return x * counting.calls


def stashing(x):
    stashing.last = x * 2
    return x


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("fn", [counting, stashing])
def test_a_function_attribute_set_inside_the_call_is_refused_and_put_back(cache, fn):
    counting.calls = 0
    before = dict(vars(fn))
    with pytest.raises(dtcompile.TracingError, match=rf"changed {fn.__name__}\.__dict__"):
        dtcompile.jit(fn, cache=cache)(torch.ones(2))
    assert vars(fn) == before  # no traced stand-in left there


def named(x):
    return x


def by_name(x):
    return x * (2.0 if named.__name__ == "named" else 3.0)


def renaming(x):
    named.__qualname__ = "renamed"
    return x


@pytest.mark.parametrize("cache", CACHES)
def test_a_functions_name_read_and_set(cache):
    jitted, x = dtcompile.jit(by_name, cache=cache), torch.ones(2)
    try:
        torch.testing.assert_close(jitted(x), by_name(x))
        named.__name__ = "other"
        torch.testing.assert_close(jitted(x), by_name(x), rtol=0, atol=0)
    finally:
        named.__name__ = "named"
    with pytest.raises(dtcompile.TracingError, match="__qualname__ of named"):
        dtcompile.jit(renaming, cache=cache)(x)
    assert named.__qualname__ == "named"
