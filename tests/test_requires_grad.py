"""What a call does to ``requires_grad`` and ``.grad`` that a compiled program would not do
(``capture/grad_checks.py``, ``capture/annotator.py``): refused with a clear error, where
eager's tensors would differ with none."""

import pytest
import torch

import dtcompile


def _enables_grad(x):
    with torch.enable_grad():
        return x * 2


def _requires_grad_inside(x):
    return (x * 2).requires_grad_()


def _factory_requiring_grad(x):
    return torch.zeros(3, requires_grad=True) + x


def _parameter_made_inside(x):
    return torch.nn.Parameter(x * 2)


def _makes_the_argument_require_grad(x):
    x.requires_grad_()
    return (x * x).sum()


def _writes_a_value_that_requires_grad(x, w):
    x.add_(w)
    return x * 2


def _returns_a_leaf_made_inside(x, w):
    a = torch.zeros(3, requires_grad=True)
    return (a * x).sum() + w.sum(), a


def _reads_grad(x):
    return x.grad * 2 + x


def _sets_data(x, y):
    x.data = y
    return x * 2


def _sets_grad(x):
    x.grad = torch.ones(3)
    return x * 2


def _plain():
    return torch.ones(3)


def _needs_grad():
    return torch.ones(3, requires_grad=True)


CASES = [
    (_enables_grad, (_needs_grad,), True, "a tensor that requires grad, made so inside"),
    (_requires_grad_inside, (_plain,), False, "a tensor that requires grad, made so inside"),
    (_factory_requiring_grad, (_plain,), False, "a tensor that requires grad, made so inside"),
    (_parameter_made_inside, (_plain,), False, "a tensor that requires grad, made so inside"),
    (_makes_the_argument_require_grad, (_plain,), False, r"args\[0\] requires grad"),
    (_writes_a_value_that_requires_grad, (_plain, _needs_grad), False, r"args\[0\] requires grad"),
    (_returns_a_leaf_made_inside, (_plain, _needs_grad), False, "a leaf tensor that requires grad"),
    (_reads_grad, (_needs_grad,), False, "reads .grad"),
    (_sets_data, (_plain, _plain), False, "Tensor.data is assigned"),
    (_sets_grad, (_needs_grad,), False, "Tensor.grad is assigned"),
]


@pytest.mark.parametrize("fn, makers, no_grad, message", CASES, ids=[c[0].__name__ for c in CASES])
def test_refused_where_eager_would_differ(fn, makers, no_grad, message):
    args = [make() for make in makers]
    if fn is _reads_grad:
        args[0].grad = torch.full((3,), 7.0)
    with torch.no_grad() if no_grad else torch.enable_grad():
        with pytest.raises(dtcompile.TracingError, match=message):
            dtcompile.jit(fn)(*args)
    assert all(not a.requires_grad for a, make in zip(args, makers) if make is _plain)  # nothing changed


def test_the_call_s_own_tensors_returned_as_they_are():
    model = torch.nn.Linear(2, 2)
    jitted = dtcompile.jit(lambda x: (model(x), model.weight))
    for mode in (torch.no_grad, torch.enable_grad):
        with mode():
            out, weight = jitted(torch.ones(1, 2))
        assert weight.requires_grad


def _doubles_in_place(x):
    x.mul_(2)
    return x


def test_an_in_place_change_of_a_non_leaf_argument_is_refused_by_name():
    w = torch.arange(4.0, requires_grad=True)
    with pytest.raises(dtcompile.TracingError, match=r"changes args\[0\] in place, a tensor that requires grad"):
        dtcompile.jit(_doubles_in_place)(w * 1)  # eager changes it, extending its graph
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        dtcompile.jit(_doubles_in_place)(w)  # eager's own error for a leaf


class _RunningMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x):
        self.mean.mul_(0.9).add_(x.mean(0))  # eager's buffer now carries this call's graph
        return self.lin(x - self.mean)


class _State:
    pass


def _writes_an_object_s_tensor(x, state):
    state.total.add_(x.sum(0))
    return x * 2


_GLOBAL = torch.zeros(3)


def _writes_a_global(x):
    _GLOBAL.add_(x.sum(0))
    return x * 2


@pytest.mark.parametrize("kind", ["buffer", "object's tensor", "global", "global with a graph"])
def test_a_held_tensor_given_the_call_s_graph_is_refused_by_name(kind):
    """An in-place write of a value that requires grad into a tensor the call holds (a
    module's buffer, an input object's tensor, a closed-over one) gives it the call's graph
    in eager; the compiled call would not: refused, naming it, and the tensor as it was."""
    global _GLOBAL
    x = torch.ones(2, 3, requires_grad=True)
    before = torch.zeros(3) + torch.zeros(3, requires_grad=True) if kind == "global with a graph" else torch.zeros(3)
    if kind == "buffer":
        model = _RunningMean()
        call, held, where = lambda: dtcompile.jit(model)(x), model.mean, r"buffers\['mean'\]"
    elif kind == "object's tensor":
        state = _State()
        state.total = torch.zeros(3)
        call, held, where = (
            lambda: dtcompile.jit(_writes_an_object_s_tensor)(x, state),
            state.total,
            r"args\[1\]\.total",
        )
    else:
        _GLOBAL = held = before
        call, where = (
            lambda: dtcompile.jit(_writes_a_global)(x),
            r"a Tensor of shape \(3,\) it closes over \(a global or a closure's\)",
        )
    grad_fn = held.grad_fn
    with pytest.raises(dtcompile.TracingError, match=f"changes whether {where} requires grad"):
        call()
    assert held.requires_grad is (grad_fn is not None) and torch.equal(held, torch.zeros(3))
    if grad_fn is None:
        assert held.grad_fn is None  # not left with a graph of the trace's


def _returns_its_input(x, y):
    return x, x * y


class _ReturnsItsWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x), self.lin.weight


def test_a_tensor_returned_as_it_is_in_a_training_call_is_the_caller_s_own():
    a = torch.ones(3, requires_grad=True)
    out, product = dtcompile.jit(_returns_its_input)(a, torch.full((3,), 2.0))
    assert out is a  # a leaf, as eager returns it: backward fills its .grad
    (out.sum() + product.sum()).backward()
    assert torch.equal(a.grad, torch.full((3,), 3.0))

    torch.manual_seed(0)
    model = _ReturnsItsWeight()
    reference = _ReturnsItsWeight()
    reference.load_state_dict(model.state_dict())
    got, weight = dtcompile.jit(model)(torch.ones(1, 2))
    expected, expected_weight = reference(torch.ones(1, 2))
    assert weight is model.lin.weight and expected_weight is reference.lin.weight
    (got.sum() + weight.sum()).backward()
    (expected.sum() + expected_weight.sum()).backward()
    torch.testing.assert_close(model.lin.weight.grad, reference.lin.weight.grad, rtol=0, atol=0)


class _ReturnsAViewOfItsWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin.weight.t(), self.lin.weight[0] * x.sum()


_CLOSED = torch.nn.Linear(3, 2)


@pytest.mark.parametrize("closed_over", [False, True], ids=["module's", "closed over"])
def test_a_view_of_a_parameter_returned_under_no_grad_is_eager_s(closed_over):
    """Under no_grad a view of a tensor that requires grad still requires grad (eager keeps
    it a view of the parameter); the program's view is the same, not a refused tensor
    "made to require grad inside"."""
    model = _ReturnsAViewOfItsWeight()
    call = dtcompile.jit(lambda x: (_CLOSED.weight.t(), _CLOSED.weight[0] * x.sum())) if closed_over else None
    weight = _CLOSED.weight if closed_over else model.lin.weight
    with torch.no_grad():
        for _ in range(2):
            view, product = call(torch.ones(3)) if closed_over else dtcompile.jit(model)(torch.ones(3))
            assert view.requires_grad and view._base is weight and torch.equal(view, weight.t())
            assert not product.requires_grad and torch.equal(product, weight[0] * 3)


_DETACHED_VIEWS = {
    "slice": lambda x: x.detach()[1:],
    "transpose": lambda x: x.detach().t(),
    "view": lambda x: x.detach().view(-1),
    "with another output": lambda x: (x.detach()[1:], x * 2),
}


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("case", list(_DETACHED_VIEWS))
def test_a_view_of_a_detached_input_returned_in_a_training_call_needs_no_grad(case, cache):
    """Eager's ``x.detach()[1:]`` does not require grad; the compiled step's did (a view of
    the input from autograd's Function), and the caller's in-place change of it raised."""
    fn = _DETACHED_VIEWS[case]
    jitted = dtcompile.jit(fn, cache=cache)
    for _ in range(2):
        x = torch.randn(4, 3, requires_grad=True)
        expected = fn(x)
        got = jitted(x)
        for g, e in zip(*(((v,) if isinstance(v, torch.Tensor) else v) for v in (got, expected))):
            assert (g.requires_grad, g.is_leaf) == (e.requires_grad, e.is_leaf)
            assert torch.equal(g, e)
        first = got if isinstance(got, torch.Tensor) else got[0]
        first.add_(1)  # as eager's may be
