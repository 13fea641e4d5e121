"""A view of a detached input returned under ``no_grad`` does not require grad, as in eager.

The program dropped ``detach`` as an identity view, so ``w.detach().t()`` came back as
``w.t()``: a view requiring grad that a later backward ran through silently (filling
nothing), and that ``mul_`` refused as "a view created in no_grad mode"."""

import pytest
import torch
from torch import nn

import dtcompile

VIEWS = {
    "data.t()": lambda w: w.data.t(),
    "data[:2]": lambda w: w.data[:2],
    "data.view(-1)": lambda w: w.data.view(-1),
    "detach().t()": lambda w: w.detach().t(),
    "detach()[..., 0:]": lambda w: w.detach()[..., 0:],
    "detach().view_as(w)": lambda w: w.detach().view_as(w),
    "detach()[:1].expand(3, -1)": lambda w: w.detach()[:1].expand(3, -1),
    "detach().reshape(9).view(3, 3)": lambda w: w.detach().reshape(9).view(3, 3),
}


class Returns(nn.Module):
    def __init__(self, view):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.view = view

    def forward(self, x):
        return self.lin(x), self.view(self.lin.weight)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("name", list(VIEWS))
def test_a_view_of_a_detached_parameter(name, cache):
    results = []
    for compiled in (False, True):
        module = Returns(VIEWS[name])
        call = dtcompile.jit(module, cache=cache) if compiled else module
        with torch.no_grad():
            y, v = call(torch.ones(2, 3))
        assert not v.requires_grad and v.grad_fn is None
        assert v.untyped_storage().data_ptr() == module.lin.weight.untyped_storage().data_ptr()
        if 0 not in v.stride():  # (an expanded view may not be written, in eager either)
            v.mul_(2)  # a view made of a detached tensor may be written
        results.append((y, v.stride(), module.lin.weight.detach().clone()))
    (y0, s0, w0), (y1, s1, w1) = results
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    assert s1 == s0
    torch.testing.assert_close(w1, w0, rtol=0, atol=0)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_a_view_of_a_detached_input_that_requires_grad(cache):
    jitted = dtcompile.jit(lambda x: (x.detach().t(), x.detach()[1:]), cache=cache)
    for rows in (2, 3):
        x = torch.randn(rows, 3, requires_grad=True)
        with torch.no_grad():
            outs = jitted(x)
        for out, expected in zip(outs, (x.detach().t(), x.detach()[1:])):
            assert not out.requires_grad
            assert out.stride() == expected.stride() and torch.equal(out, expected)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_pieces_of_an_input_split_and_detached(cache):
    # ``split`` of an input returns a list of views: the pass that keeps a detach of an
    # input's memory followed them (it crashed on the list, as a TP head's backward met it).
    def f(x):
        pieces = x.split(2)
        return pieces[0].detach().t(), sum(p.sum() for p in pieces)

    jitted = dtcompile.jit(f, cache=cache)
    for rows in (4, 5):
        for grad in (False, True):
            x = torch.randn(rows, 3, requires_grad=True)
            with torch.set_grad_enabled(grad):
                piece, total = jitted(x)
            assert not piece.requires_grad and torch.equal(piece, x.detach()[:2].t())
            assert total.requires_grad == grad
            torch.testing.assert_close(total, x.sum())
