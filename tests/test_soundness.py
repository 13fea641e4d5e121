"""Eager's results or a clear error, in one process: aliased inputs, module state changed
by assignment, Python side effects, outputs rebuilt as eager returns them, jitted code
called inside jitted code, and data-dependent code refused by name."""

import collections
import contextlib
import copy
import dataclasses
import random
import types

import numpy
import pytest
import torch
from numpy.random import rand as _rand
from support import assert_same_result
from torch import initial_seed as _initial_seed
from torch.random import fork_rng as _fork_rng

import dtcompile
from dtcompile.core import TensorProxy
from dtcompile.testing.broken import MulAsAddExecutor

NT = collections.namedtuple("NT", "scaled shifted")


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    count: int = 2


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenPair:
    first: torch.Tensor
    rest: list


def _calls(fn, *calls, no_grad=True):
    """``fn`` compiled and eager, called with each argument tuple (fresh clones for each)."""
    jitted = dtcompile.jit(fn)
    for args in calls:
        with torch.no_grad() if no_grad else torch.enable_grad():
            got = jitted(*copy.deepcopy(args))
            expected = fn(*copy.deepcopy(args))
        assert_same_result(got, expected)
    return jitted


# Item 1: aliased inputs. Passes reason about writes as if any two inputs may share memory.
def _writes_x_reads_y(x, y):
    a = y * 2
    x.add_(1)
    return a + y * 2


def _copy_then_write(x, y):
    a = y.clone()
    x.mul_(2)
    return a + y


@pytest.mark.parametrize("fn", [_writes_x_reads_y, _copy_then_write])
def test_inputs_that_share_memory_get_eagers_values(fn):
    jitted = dtcompile.jit(fn)
    for make in (
        lambda: (torch.zeros(3), torch.zeros(3)),  # distinct (traced first)
        lambda: (lambda z: (z, z))(torch.zeros(3)),  # the same tensor twice
        lambda: (lambda z: (z[:3], z[1:]))(torch.arange(4.0)),  # overlapping views
        lambda: (lambda z: (z[0], z[1]))(torch.ones(2, 3)),  # views of one base, apart
    ):
        got_args, expected_args = make(), make()
        got = jitted(*got_args)
        expected = fn(*expected_args)
        assert_same_result(got, expected)
        assert_same_result(list(got_args), list(expected_args))


def test_tensors_traced_apart_or_together_are_guarded_by_identity():
    def fn(q, k):
        return q * 2 if q is k else q - k

    jitted = dtcompile.jit(fn)
    a, b = torch.ones(3), torch.full((3,), 5.0)
    for args in ((a, a), (a, b), (b, b), (b, a)):
        assert_same_result(jitted(*args), fn(*args))
    assert dtcompile.cache_misses(jitted) == 2


# Item 3: module state changed by assignment after or during calls.
def test_a_parameter_assigned_to_an_empty_slot_is_used():
    lin = torch.nn.Linear(3, 4, bias=False)
    jitted = dtcompile.jit(lin)
    x = torch.randn(2, 3)
    with torch.no_grad():
        assert_same_result(jitted(x), lin(x))
        lin.bias = torch.nn.Parameter(torch.randn(4))
        assert_same_result(jitted(x), lin(x))
        lin.bias = None
        assert_same_result(jitted(x), lin(x))


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def test_untying_and_tying_weights_after_a_call():
    model = _Tied()
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 3)
    with torch.no_grad():
        assert_same_result(jitted(x), model(x))
        model.b.weight = torch.nn.Parameter(torch.randn(3, 3))  # untied
        assert_same_result(jitted(x), model(x))
        model.b.weight = model.a.weight  # tied again
        assert_same_result(jitted(x), model(x))
        model.a.register_buffer("extra", torch.ones(1))  # a new buffer: a new entry, same values
        assert_same_result(jitted(x), model(x))
    assert dtcompile.cache_misses(jitted) == 3


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        self.step = self.step + 1  # a new tensor in the buffer slot
        y = self.lin(x) * self.step
        self.last = y.detach()  # a plain tensor attribute
        self.lin.seen = x.shape[0]  # a number on a submodule
        return y


def test_attribute_assignments_in_the_forward_are_made_at_each_call():
    model = _Counting()
    eager = copy.deepcopy(model)
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(3):
            assert_same_result(jitted(x), eager(x))
            assert_same_result(model.step, eager.step)
            assert_same_result(model.last, eager.last)
            assert model.lin.seen == eager.lin.seen
    assert not any(isinstance(t, TensorProxy) for t in [*model.buffers(), *vars(model).values()])


def test_attribute_assignments_in_a_training_forward_are_an_error_and_change_nothing():
    model = _Counting()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dtcompile.TracingError, match="assigns the module attribute 'step'"):
        dtcompile.jit(model)(torch.randn(2, 3))
    assert not hasattr(model, "last") and not hasattr(model.lin, "seen")
    for key, value in model.state_dict().items():
        assert type(value) is torch.Tensor and torch.equal(value, before[key])


# Item 5: Python side effects happen at each call, or the compile says why they cannot.
def test_a_forward_hook_that_stores_activations_is_refused_and_leaves_no_proxy():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    store = []
    model[0].register_forward_hook(lambda module, inputs, output: store.append(output))
    with torch.no_grad(), pytest.raises(dtcompile.TracingError, match="'store' .*forward hook"):
        dtcompile.jit(model)(torch.randn(2, 3))
    assert store == []


def test_side_effects_on_data_the_call_does_not_receive_are_refused():
    log = {"calls": 0}

    def counts(x):
        log["calls"] += 1
        return x * 2

    with pytest.raises(dtcompile.TracingError, match="'log'"):
        dtcompile.jit(counts)(torch.randn(3))
    assert log == {"calls": 0}

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.history = []

        def forward(self, x):
            self.history.append(x * 2)
            return x + 1

    holder = Holder()
    with torch.no_grad(), pytest.raises(dtcompile.TracingError, match="history"):
        dtcompile.jit(holder)(torch.randn(3))
    assert holder.history == []


# Item 6: outputs rebuilt as eager returns them.
@pytest.mark.parametrize(
    "fn",
    [
        lambda x: NT(x * 2, x + 1),
        lambda x: [NT(x * 2, NT(x, 1)), {"pair": Pair(x - 1, 3)}],
        lambda x: Pair(x * 2),
        lambda x: torch.max(x, 1),
    ],
)
def test_namedtuple_dataclass_and_structseq_outputs(fn):
    x = torch.randn(4, 3)
    jitted = dtcompile.jit(fn)
    for _ in range(2):
        got, expected = jitted(x), fn(x)
        assert type(got) is type(expected)
        flat_got, flat_expected = _leaves(got), _leaves(expected)
        assert len(flat_got) == len(flat_expected)
        for g, e in zip(flat_got, flat_expected):
            assert_same_result(g, e)


def test_frozen_slotted_dataclass_outputs_are_made_anew_each_call():
    jitted = dtcompile.jit(lambda x: FrozenPair(x * 2, [x, 3]))
    x = torch.randn(3)
    first, second = jitted(x), jitted(x)
    assert type(second) is FrozenPair and first is not second
    assert_same_result(second.first, x * 2)
    assert_same_result(second.rest, [x, 3])


class _OwnNew:
    def __new__(cls, held):
        obj = super().__new__(cls)
        obj.held = held
        return obj


class _Bag(list):
    pass


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda y: [_Bag([y])], "_Bag"),
        (lambda y: {y}, "set"),
        (lambda y: lambda: y, "function"),
        (lambda y: _OwnNew({"k": [y]}), "_OwnNew"),
        (lambda y: types.SimpleNamespace(t=y).__repr__, "method-wrapper"),
    ],
    ids=["list subclass", "set", "closure", "own __new__", "method-wrapper"],
)
def test_outputs_that_cannot_be_rebuilt_are_an_error(make, kind):
    """A result holding traced tensors where they cannot be put back after each call is
    refused, however deep they are (never a proxy handed back)."""
    with pytest.raises(dtcompile.TracingError, match=f"inside a {kind}"):
        dtcompile.jit(lambda x: make(x * 2))(torch.randn(3))


@pytest.mark.parametrize("levels", [1, 3, 7])
def test_simple_namespace_outputs_at_any_depth_are_rebuilt(levels):
    def nested(x):
        out = x * 2
        for _ in range(levels):
            out = types.SimpleNamespace(inner=[out])
        return out

    jitted = dtcompile.jit(nested)
    x = torch.randn(3)
    for _ in range(2):
        got = jitted(x)
        for _ in range(levels):
            assert type(got) is types.SimpleNamespace
            (got,) = got.inner
        assert_same_result(got, x * 2)


@pytest.mark.parametrize("container", [dict, collections.OrderedDict], ids=["dict", "OrderedDict"])
def test_input_dict_keys_equal_but_of_another_type(container):
    """1, 1.0 and True are one key to ``==``; code iterating the dict sees which."""

    def filled(table, t):
        return torch.full((2,), next(iter(table))) + t

    jitted = dtcompile.jit(filled)
    t = torch.ones(2, dtype=torch.int64)
    for key in (1, 1.0, True, 1, -0.0, 0.0):
        table = container({key: None})
        assert_same_result(jitted(table, t), filled(table, t))


def test_namedtuple_inputs():
    def fn(pair):
        return pair.scaled * pair.shifted

    jitted = dtcompile.jit(fn)
    x = torch.randn(3)
    assert_same_result(jitted(NT(x, 2.0)), fn(NT(x, 2.0)))
    assert_same_result(jitted(NT(x, 3.0)), fn(NT(x, 3.0)))
    with pytest.raises(AttributeError):
        jitted((x, 3.0))  # a plain tuple is a new entry, traced like eager: it fails like eager


def _leaves(value):
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if dataclasses.is_dataclass(value):
        return [leaf for f in dataclasses.fields(value) for leaf in _leaves(getattr(value, f.name))]
    return [value]


# Item 7: jitted code called by jitted code runs inline.
def test_jitted_functions_and_modules_inside_jitted_code_run_inline():
    inner = dtcompile.jit(lambda x: x * 2)
    layer = torch.nn.Linear(3, 3)
    jitted_layer = dtcompile.jit(layer)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), jitted_layer)
    jitted_model = dtcompile.jit(model)

    def outer(x):
        return jitted_layer(inner(x)) + 1

    x = torch.randn(2, 3)
    jitted_outer = dtcompile.jit(outer)
    with torch.no_grad():
        got = [jitted_outer(x), jitted_outer(x + 1), jitted_model(x)]
        # Traced as part of the outer programs: the inner ones never compiled on their own.
        assert dtcompile.cache_misses(inner) == 0 and dtcompile.cache_misses(jitted_layer) == 0
        for g, e in zip(got, [outer(x), outer(x + 1), model(x)]):
            assert_same_result(g, e)


def _write_then_branch(x):
    x.mul_(2)
    return x if x.sum() > 0 else -x


def _random_branch(x):
    return x * (2 if torch.rand(()).item() > 0.5 else 3)


# Item 8: what cannot be read from tensor data is a TracingError naming the torch-level
# call (numbers read from data are run-time numbers of the program, and branches on them
# are checked at run time: tests/test_data_dependent.py).
@pytest.mark.parametrize(
    "fn, call",
    [
        (_write_then_branch, "Tensor.__bool__"),
        (_random_branch, "Tensor.item"),
        (lambda x: x * x.numpy().sum(), "Tensor.numpy"),
    ],
)
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_control_flow_on_tensor_data_is_a_tracing_error_naming_the_call(fn, call, cache):
    with pytest.raises(dtcompile.TracingError, match=f"{call.replace('.', '[.]')} depends on the values"):
        dtcompile.jit(fn, cache=cache)(torch.randn(4, 3))


_DATA_SHAPED = [
    lambda x: x[x > 0] * 2,
    lambda x: x.nonzero() + 1,
    lambda x: torch.masked_select(x, x > 0).sum(0, keepdim=True),
    lambda x: x[x.sum(1) > 0].reshape(-1, 3).t(),
    lambda x: torch.zeros(x.nonzero().shape[0]) + 1,
    lambda x: x * x.sum().item(),
    lambda x: x * len(x.sum(1).tolist()),
]


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("fn", _DATA_SHAPED)
def test_shapes_and_numbers_from_data_compile_once(fn, cache):
    jitted = dtcompile.jit(fn, cache=cache)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(4, 3, generator=generator)
        assert_same_result(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 1


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_python_branches_on_shapes_from_data_give_eagers_result(cache):
    """A branch on a size read from data is traced as taken and checked at run time (it
    was refused); each branch compiles once."""

    def fn(x):
        kept = x[x > 0]
        return kept * 2 if kept.shape[0] > 5 else kept

    jitted = dtcompile.jit(fn, cache=cache)
    for seed in (0, 1, 2, 3):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed)) + (seed % 2) - 0.5
        expected = fn(x)
        got = jitted(x)
        assert got.shape == expected.shape and torch.equal(got, expected)
    assert dtcompile.cache_misses(jitted) <= 2


# Item 4: tensors a program closes over that require grad are differentiable inputs.
def test_closed_over_parameters_get_gradients():
    weight = torch.nn.Parameter(torch.randn(3, 3))
    layer = torch.nn.Linear(3, 2)

    def loss(d, target):
        return torch.nn.functional.mse_loss(layer(d @ weight), target)

    jitted = dtcompile.jit(loss)
    d, target = torch.randn(4, 3), torch.randn(4, 2)
    for _ in range(2):
        params = [weight, *layer.parameters()]
        for p in params:
            p.grad = None
        got = jitted(d, target)
        got.backward()
        got_grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        expected = loss(d, target)
        expected.backward()
        assert_same_result(got.detach(), expected.detach())
        for g, p in zip(got_grads, params):
            assert_same_result(g, p.grad)
    assert dtcompile.cache_misses(jitted) == 1
    with torch.no_grad():  # without gradients: another entry
        assert_same_result(jitted(d, target), loss(d, target))


class _Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


_W = torch.nn.Parameter(torch.randn(4, 3))
_VIEWS = {"rows": lambda: _W[1:3], "a transpose (a tied head)": lambda: _W.T, "a computed view": lambda: _W.view(2, 6)}
_READS = {
    "an op": lambda d, v: torch.mul(d, v),
    "a method": lambda d, v: v.mul(d),
    "its .mT": lambda d, v: d.mT * v.mT,
    "a Function given it": lambda d, v: _Mul.apply(d, v),
}


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("read", list(_READS))
@pytest.mark.parametrize("view", list(_VIEWS))
def test_a_closed_over_view_of_a_parameter_read_with_it_gets_its_gradient_once(view, read, cache):
    """A closed-over tensor that requires grad and is no leaf (``Wv = W[1:3]``, a tied
    head's ``emb.weight.T``), read with ``W`` itself: the program's gradient for ``Wv`` is
    carried into ``W`` by autograd after the call, as eager's; ``W``'s own must not carry it
    too (it was counted twice)."""
    torch.manual_seed(0)
    Wv = _VIEWS[view]()

    def loss(d, e):
        return (_READS[read](d, Wv) ** 2).sum() + (_W * e).sum()

    jitted = dtcompile.jit(loss, cache=cache)
    for _ in range(3):
        d, e = torch.randn(Wv.shape), torch.randn(_W.shape)
        _W.grad = None
        loss(d, e).backward(retain_graph=True)
        expected = _W.grad.clone()
        _W.grad = None
        jitted(d, e).backward(retain_graph=True)
        torch.testing.assert_close(_W.grad, expected, rtol=1e-6, atol=1e-6)


# check="eager": a compiled call checked against eager, naming the first differing line.
def test_check_eager_names_the_first_line_that_differs():
    def fn(x):
        return (x + 1).exp() * 3 - x

    jitted = dtcompile.jit(fn, check="eager", executors=["collectives", MulAsAddExecutor(), "torch"])
    with pytest.raises(
        dtcompile.EagerMismatchError, match=r"(?s)output 0: values differ.*torch\.add\(t1, 3\)  # Tensor\.mul"
    ):
        jitted(torch.randn(3))


def test_check_eager_tells_a_tracing_difference_and_passes_otherwise(monkeypatch):
    # A Python module's attribute reached through a name made at run time is not guarded.
    settings, name = types.ModuleType("settings"), "".join(["sca", "le"])
    settings.scale = 2.0
    jitted = dtcompile.jit(lambda x: x * getattr(settings, name), check="eager")
    assert_same_result(jitted(torch.ones(2)), torch.full((2,), 2.0))
    settings.scale = 3.0
    with pytest.raises(dtcompile.EagerMismatchError, match="difference is in what tracing saw"):
        jitted(torch.ones(2))

    def writes(x, counter):
        counter.add_(1)
        return torch.randn(2) + x * counter  # random numbers too: the generator is replayed

    monkeypatch.setenv("DTCOMPILE_CHECK", "eager")
    jitted = dtcompile.jit(writes)
    x, counter = torch.ones(2), torch.zeros(())
    torch.manual_seed(0)
    got = [jitted(x, counter) for _ in range(3)]
    torch.manual_seed(0)
    eager_counter = torch.zeros(())
    expected = [writes(x, eager_counter) for _ in range(3)]
    assert_same_result(got, expected)
    assert_same_result(counter, eager_counter)  # each call's change made once
    with pytest.raises(ValueError, match="check must be one of"):
        dtcompile.jit(writes, check="sometimes")


class _Made:
    """An object a call makes (a KV cache): no ``==`` of its own."""

    def __init__(self, keys, step):
        self.keys, self.step = keys, step


def test_check_eager_compares_a_made_object_by_what_it_holds():
    # A new object the call makes, eager's too, was a difference by identity: an HF model's
    # DynamicCache raised EagerMismatchError at every call. Its tensors still are compared.
    jitted = dtcompile.jit(lambda x: _Made([x * 2, x + 1], 3), check="eager")
    out = jitted(torch.ones(2))
    assert isinstance(out, _Made) and out.step == 3

    # A module's attribute reached through a name made at run time is not guarded.
    settings, name = types.ModuleType("settings"), "".join(["sca", "le"])
    settings.scale = 2.0
    jitted = dtcompile.jit(lambda x: _Made([x * getattr(settings, name)], 1), check="eager")
    jitted(torch.ones(2))
    settings.scale = 3.0
    with pytest.raises(dtcompile.EagerMismatchError, match=r"_Made\.keys: list\[0\]: values differ"):
        jitted(torch.ones(2))


def test_tensor_hooks_registered_by_the_function():
    store = []

    def keeps_gradients(x):
        y = x * 2
        y.register_hook(store.append)
        return y.sum()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(dtcompile.TracingError, match="'store'"):
        dtcompile.jit(keeps_gradients)(x)
    assert store == []

    def scales_gradients(x):
        y = x * 2
        y.register_hook(lambda grad: grad * 3)
        return (y * y).sum()

    dtcompile.jit(scales_gradients)(x).backward()
    got, x.grad = x.grad, None
    scales_gradients(x).backward()
    assert_same_result(got, x.grad)

    def after_accumulation(x):
        x.register_post_accumulate_grad_hook(lambda t: None)
        return x.sum()

    with pytest.raises(dtcompile.TracingError, match="register_post_accumulate_grad_hook"):
        dtcompile.jit(after_accumulation)(torch.randn(3, requires_grad=True))


def _buffers_written_apart(x):
    a, b = torch.zeros(3), torch.zeros(3)  # equal computations, then written apart
    a.add_(x)
    b.mul_(x)
    return a * 2 + b


def _empties_filled_apart(x):
    a, b = torch.empty_like(x), torch.empty_like(x)
    a.copy_(x)
    b.fill_(2.0)
    return a + b


@pytest.mark.parametrize("fn", [_buffers_written_apart, _empties_filled_apart])
def test_equal_buffers_written_in_place_are_not_merged(fn):
    jitted = dtcompile.jit(fn)
    for x in (torch.ones(3), torch.arange(3.0)):
        torch.testing.assert_close(jitted(x), fn(x))


def test_int_of_tensor_data_is_checked_at_run_time():
    """``int()`` of a float read from data specializes the program on the value (as
    torch.compile does), checked at each call: eager's results, a compilation per value."""

    def fn(x):
        return x * int(x.sum())

    jitted = dtcompile.jit(fn)
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(4, 3, generator=generator) for _ in range(3)]
    for x in inputs + inputs:
        assert_same_result(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 3


# Factory functions take the default dtype and device when the code names none: a program
# traced under one default must not serve a call under another.
def _zeros_cast_back(x):
    return (x + torch.zeros(3)).to(torch.float32)  # a no-op cast when traced under float32


def _arange_divided(x):
    return torch.arange(3) / 3 + x.half()


def _scalar_tensor(x):
    return torch.tensor(1.5) * x.sum()


def _full(x):
    return torch.full((3,), 2.0) * x


@pytest.mark.parametrize("fn", [_zeros_cast_back, _arange_divided, _scalar_tensor, _full])
def test_a_new_default_dtype_is_a_miss_with_eagers_result(fn):
    jitted = dtcompile.jit(fn)
    x = torch.ones(3)
    assert_same_result(jitted(x), fn(x))
    try:
        torch.set_default_dtype(torch.float64)
        assert_same_result(jitted(x), fn(x))
        assert dtcompile.cache_misses(jitted) == 2
    finally:
        torch.set_default_dtype(torch.float32)
    assert_same_result(jitted(x), fn(x))
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (2, 1)


def _made_and_scaled(x):
    return torch.zeros(3) + 1, x * 2


def test_a_default_device_is_a_miss_with_eagers_devices():
    jitted = dtcompile.jit(_made_and_scaled)
    x = torch.ones(3)
    assert_same_result(jitted(x), _made_and_scaled(x))
    with torch.device("meta"):  # a function mode on torch's stack
        got, expected = jitted(x), _made_and_scaled(x)
    assert [t.device.type for t in got] == [t.device.type for t in expected] == ["meta", "cpu"]
    try:
        torch.set_default_device("meta")  # the same device, set for the thread: a hit
        assert [t.device.type for t in jitted(x)] == ["meta", "cpu"]
    finally:
        torch.set_default_device(None)
    assert_same_result(jitted(x), _made_and_scaled(x))
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (2, 2)


def _dtype_for_a_part(x):
    torch.set_default_dtype(torch.float64)
    try:
        return x + torch.ones(3)  # float64 ones in eager
    finally:
        torch.set_default_dtype(torch.float32)


def _dtype_for_arithmetic(x):
    with _default_dtype(torch.float64):
        return torch.arange(3) * 0.5 + x.sum()  # int * float: the default dtype decides


def _dtype_with_explicit_dtype(x):
    with _default_dtype(torch.float16):
        made = torch.zeros(3, dtype=torch.float32)
    return made + x


@contextlib.contextmanager
def _default_dtype(dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@pytest.mark.parametrize("fn", [_dtype_for_a_part, _dtype_for_arithmetic, _dtype_with_explicit_dtype])
def test_ops_under_a_default_dtype_set_inside_the_call_are_refused(fn):
    # The program runs every op under the call's default dtype: a part traced under
    # another would give other dtypes (or values) than eager, with no error.
    with pytest.raises(dtcompile.TracingError, match="default dtype torch.float(64|16), set by the traced code"):
        dtcompile.jit(fn)(torch.ones(3))
    assert torch.get_default_dtype() is torch.float32


def _restores_before_any_op(x):
    with _default_dtype(torch.float64):
        pass
    return x + torch.ones(3)


def test_a_default_dtype_changed_and_restored_before_any_op_compiles():
    jitted = dtcompile.jit(_restores_before_any_op)
    x = torch.ones(3)
    assert_same_result(jitted(x), _restores_before_any_op(x))


def _leaves_grad_off(x):
    torch.set_grad_enabled(False)
    return x * 2


def _leaves_default_dtype(x):
    y = x * 2
    torch.set_default_dtype(torch.float64)
    return y


def _leaves_default_device(x):
    y = x * 2
    torch.set_default_device("cpu")
    return y


@pytest.mark.parametrize(
    "fn, what",
    [
        (_leaves_grad_off, "the grad mode"),
        (_leaves_default_dtype, "the default dtype"),
        (_leaves_default_device, "the torch function modes"),
    ],
)
def test_global_state_the_call_leaves_changed_is_refused_and_put_back(fn, what):
    # Eager's forward changes it at every call; a compiled program, only while tracing.
    try:
        with pytest.raises(dtcompile.TracingError, match=f"changed {what}.* and left it so"):
            dtcompile.jit(fn)(torch.ones(3))
        assert torch.is_grad_enabled() and torch.get_default_dtype() is torch.float32
    finally:
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)


class _TiesInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.b.weight = self.a.weight  # a Parameter moved to another module, as eager allows
        self.shared = self.a.bias  # registered as a parameter under a new name
        return self.b(x)


def test_parameters_assigned_in_the_forward_are_assigned_at_each_call():
    model, reference = _TiesInForward(), _TiesInForward()
    reference.load_state_dict(model.state_dict())
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert_same_result(jitted(x), reference(x))
            assert model.b.weight is model.a.weight and model.shared is model.a.bias
            assert type(model.b.weight) is torch.nn.Parameter and "shared" in model._parameters
            assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == [
                n for n, _ in reference.named_parameters(remove_duplicate=False)
            ]
    with pytest.raises(dtcompile.TracingError, match="assigns the module attribute '(b.weight|shared)'"):
        dtcompile.jit(_TiesInForward())(x)  # with gradients: a clear error


def _seeds_inside(x):
    torch.manual_seed(0)
    return torch.nn.functional.dropout(x, 0.5, training=True)


def _restores_generator_state(x):
    state = torch.get_rng_state()
    y = x + torch.rand(3)
    torch.set_rng_state(state)  # the next call draws the same: a compiled one would not
    return y


def _seeds_the_generator_object(x):
    torch.default_generator.manual_seed(5)
    return x + torch.rand(3)


def _forks_the_generator(x):
    with torch.random.fork_rng():  # the same numbers at every call in eager
        return x + torch.rand(3)


def _forks_by_name(x):  # (``from torch.random import fork_rng``: a name the patch of torch's missed)
    with _fork_rng():
        return x + torch.rand(3)


def _reads_the_seed_by_name(x):
    return x * (_initial_seed() % 5)


def _reads_python_s_state(x):  # (no draw: the state is unchanged, and was baked in)
    return x + random.getstate()[1][5] % 7


def _reads_numpy_s_state(x):
    return x + float(numpy.random.get_state()[1][0] % 7)


def _python_random(x):
    return x * random.random()


def _python_seed(x):
    random.seed(3)
    return x * 2


def _numpy_random(x):
    return x * float(numpy.random.rand())


def _numpy_random_by_name(x):  # (``from numpy.random import rand``: a raw AttributeError walking its class)
    return x * float(_rand())


@pytest.mark.parametrize(
    "fn, generator",
    [
        (_seeds_inside, "torch.manual_seed"),
        (_restores_generator_state, "torch.get_rng_state"),  # (its state read, to be set back)
        (_seeds_the_generator_object, "torch's default random generator"),
        (_forks_the_generator, "torch.fork_rng"),
        (_forks_by_name, "torch.fork_rng"),
        (_reads_the_seed_by_name, "torch.initial_seed"),
        (_reads_python_s_state, "random.getstate"),
        (_reads_numpy_s_state, "numpy.random.get_state"),
        (_python_random, "Python's random module"),
        (_python_seed, "Python's random module"),
        (_numpy_random, "NumPy's global random generator"),
        (_numpy_random_by_name, "NumPy's global random generator"),
    ],
)
def test_random_generators_used_by_python_code_are_refused_and_put_back(fn, generator):
    # Seeding or drawing in Python happens once, while tracing: eager's next call sees
    # the seed again (or a new number), a compiled one a constant of the program.
    before = (torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy())
    with pytest.raises(dtcompile.TracingError, match=f"(used|called) {generator}"):
        dtcompile.jit(fn)(torch.ones(3))
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (numpy.random.get_state()[1] == before[2]).all()


class _DrawingLayer(torch.nn.Module):
    """Draws from a torch.Generator: one it holds (``held``; reseeded in the forward:
    ``reseeded``), one the forward makes (``made``), or one of its Python module."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.lin, self.generator = kind, torch.nn.Linear(4, 4), torch.Generator().manual_seed(3)

    def forward(self, x):
        generator = {"made": torch.Generator, "global": lambda: _GLOBAL_GENERATOR}.get(
            self.kind, lambda: self.generator
        )()
        if self.kind in ("made", "reseeded"):
            generator.manual_seed(7)
        return x + self.lin(x) * torch.rand(x.shape, generator=generator)


_GLOBAL_GENERATOR = torch.Generator()


def _drawing_layers(kind: str, layers: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(*(_DrawingLayer(kind) for _ in range(layers)))


@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("kind", ["held", "global", "made", "reseeded"])
def test_torch_generators_made_or_seeded_in_the_forward_are_refused_and_held_ones_drawn_from(kind, layers):
    """A generator made in the forward would be the one made while tracing at every call,
    one seeded there seeded once: refused, its state put back. One the module holds, or a
    global one, is drawn from at each call as in eager (the repeated layers' program too)."""
    model, compiled = _drawing_layers(kind, layers), _drawing_layers(kind, layers)
    jitted, x = dtcompile.jit(compiled), torch.randn(2, 3, 4)
    with torch.no_grad():
        if kind in ("made", "reseeded"):
            before = [layer.generator.get_state() for layer in compiled]
            with pytest.raises(dtcompile.TracingError, match="a torch.Generator it made|changed the module attribute"):
                jitted(x)
            assert all(torch.equal(layer.generator.get_state(), s) for layer, s in zip(compiled, before))
            return
        for call in range(3):
            _GLOBAL_GENERATOR.manual_seed(5 + call)
            expected = model(x)
            _GLOBAL_GENERATOR.manual_seed(5 + call)
            assert_same_result(jitted(x), expected)
            for ours, theirs in zip(compiled, model):
                assert torch.equal(ours.generator.get_state(), theirs.generator.get_state())


def test_torch_random_ops_draw_anew_at_each_call():
    jitted = dtcompile.jit(lambda x: x + torch.rand(3) + torch.nn.functional.dropout(x, 0.5, training=True))
    x = torch.ones(3)
    assert not torch.equal(jitted(x), jitted(x))


def _changes_a_literal(x):
    t = torch.tensor([1.0, 2.0, 3.0])
    t.add_(x)
    return t


def _returns_a_literal(x):
    r = torch.tensor(1.0)
    return x * r, r


def _changes_an_alias_of_a_literal(x):
    t = torch.tensor([1.0, 2.0, 3.0]).float()  # the same tensor: float() of a float32
    t.mul_(2)
    return t + x


@pytest.mark.parametrize("fn", [_changes_a_literal, _returns_a_literal, _changes_an_alias_of_a_literal])
def test_a_tensor_literal_is_a_new_tensor_at_each_call(fn):
    # The program holds the literal's value as a constant: it must lift a copy, or an
    # in-place change (by the program, or by the caller of a returned one) reaches the
    # next call.
    jitted = dtcompile.jit(fn)
    x = torch.ones(3)
    for _ in range(3):
        got, expected = jitted(x), fn(x)
        assert_same_result(got, expected)
        for tensor in got if isinstance(got, tuple) else (got,):
            tensor.add_(100)  # the caller's to change


def _scale_linear_outputs(module, args, output):
    return output * 3 if isinstance(module, torch.nn.Linear) else output


def _scale_linear_grads(module, grad_input, grad_output):
    if isinstance(module, torch.nn.Linear):
        return tuple(None if g is None else g * 5 for g in grad_input)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_global_module_hooks_added_and_removed_after_compiling(cache):
    """Global hooks run around every module call: one added after compiling changes what a
    call computes (forward and backward), so each change compiles a new entry."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    jitted = dtcompile.jit(copy.deepcopy(model), cache=cache)

    def step():
        x, y = torch.ones(2, 3, requires_grad=True), torch.ones(2, 3, requires_grad=True)
        assert_same_result(jitted(y), model(x))
        jitted(y).sum().backward()
        model(x).sum().backward()
        torch.testing.assert_close(y.grad, x.grad, rtol=0, atol=0)

    step()
    handles = [
        torch.nn.modules.module.register_module_forward_hook(_scale_linear_outputs),
        torch.nn.modules.module.register_module_full_backward_hook(_scale_linear_grads),
    ]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    step()
    assert dtcompile.cache_misses(jitted) == 2  # the hooks, then none: the first entry again


_HOOK_SCALE = [1.0]
_HOOK_OUTPUTS = []


def _scale_by_a_global(module, args, output):
    return output * _HOOK_SCALE[0] if isinstance(module, torch.nn.Linear) else output


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("kind", ["module", "function"])
def test_what_a_global_module_hook_reads_is_guarded_and_what_it_changes_refused(cache, kind):
    """A global module hook runs around every module call, as a module's own hooks do: a
    global it reads changed between calls is seen, and a list it appends tensors to is
    the user's data, which a compiled call cannot change at each call (refused, never a
    proxy left in it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(4)))
    program = model if kind == "module" else (lambda x: model(x) + 1)
    jitted, x = dtcompile.jit(program, cache=cache), torch.randn(2, 4)
    handle = torch.nn.modules.module.register_module_forward_hook(_scale_by_a_global)
    try:
        for scale in (1.0, 2.0, -0.5, 2.0):
            _HOOK_SCALE[0] = scale
            assert_same_result(jitted(x), program(x))
    finally:
        handle.remove()
        _HOOK_SCALE[0] = 1.0
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: _HOOK_OUTPUTS.append(out))
    try:
        with pytest.raises(dtcompile.TracingError, match="_HOOK_OUTPUTS"):
            jitted(x)
        assert not any(isinstance(t, TensorProxy) for t in _HOOK_OUTPUTS)
    finally:
        handle.remove()
        _HOOK_OUTPUTS.clear()


def _patched_relu(x, inplace=False):
    return x * 100


def test_a_library_function_patched_after_compiling():
    import torch.nn.functional as F

    def fn(x):
        return F.relu(x) + torch.tanh(x)

    jitted = dtcompile.jit(fn)
    x = torch.tensor([-1.0, 2.0])
    assert_same_result(jitted(x), fn(x))
    original = F.relu
    F.relu = _patched_relu
    try:
        assert_same_result(jitted(x), fn(x))
    finally:
        F.relu = original
    assert_same_result(jitted(x), fn(x))
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (2, 1)


@pytest.mark.parametrize(
    "fn",
    [lambda x: x.t_(), lambda x: x.unsqueeze_(0) * 2, lambda x: x.resize_(4), lambda x: x.transpose_(0, 1) + 1],
)
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_sizes_of_an_argument_changed_in_place_are_refused(fn, cache):
    """A TracingError naming the call and the argument, which is left as it was: a traced
    tensor's sizes are fixed when it is made, so code after the change would read the old
    ones (``x.transpose_(0, 1); x.contiguous()`` returned ``x`` itself)."""
    x = torch.arange(6.0).view(2, 3)
    with pytest.raises(
        dtcompile.TracingError, match=r"Tensor\.\w+_ changes the sizes or strides of (args\[0\]|an arg)"
    ):
        dtcompile.jit(fn, cache=cache)(x)
    assert x.shape == (2, 3) and x.stride() == (3, 1)


class NamedLike(torch.nn.Module):
    """A parameter and an argument named like something the compiled programs define."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        torch.manual_seed(0)
        setattr(self, name, torch.nn.Parameter(torch.randn(4, 4)))
        self.b = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, **kwargs):
        w = getattr(self, self.name)
        return (x @ w).relu() @ self.b + x.shape[0] + torch.tensor(2.0) + sum(kwargs.values())


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize(
    "name", ["inputs", "made", "stolen", "cotangent0", "captured0", "t3", "abs", "max", "math", "block_x", "fusion0"]
)
def test_inputs_named_like_the_programs_own_names(name, cache):
    """A backward takes its saved values as a list called ``inputs``, a gradient that did
    not come is ``made``, the recorder names cotangents and captured tensors: an input of
    the same name is renamed, not shadowing them (it crashed, or was defined twice)."""
    x = torch.randn(3, 4)
    kwargs = {name: torch.randn(3, 4)}
    model, reference = NamedLike(name), NamedLike(name)
    xs, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    jitted = dtcompile.jit(model, cache=cache)
    out = jitted(xs, **kwargs)
    out.sum().backward()
    expected = reference(x_ref, **kwargs)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip([*model.parameters(), xs], [*reference.parameters(), x_ref]):
        torch.testing.assert_close(got.grad, want.grad)
    with torch.no_grad():
        torch.testing.assert_close(jitted(x, **kwargs), reference(x, **kwargs))


@torch.library.custom_op("dtcompile_tests::scale", mutates_args=())
def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scale.register_fake
def _(x, factor):
    return torch.empty_like(x)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("name", ["dtcompile_tests", "ops_dtcompile_tests", "aten", "_c10d_functional"])
def test_inputs_named_like_an_op_namespace(name, cache):
    """A custom op prints under a name no input takes (``ops_dtcompile_tests``): an
    argument called like its library hid it (``'Tensor' object has no attribute``)."""

    def fn(x, **kwargs):
        return _scale(x, 2.0) + kwargs[name]

    jitted = dtcompile.jit(fn, cache=cache)
    for _ in range(2):
        x, y = torch.randn(3), torch.randn(3)
        torch.testing.assert_close(jitted(x, **{name: y}), x * 2 + y)


_FROM_PYTHON_DATA = {
    "frombuffer": lambda data: torch.frombuffer(bytearray(data.tobytes()), dtype=torch.float32),
    "from_numpy": lambda data: torch.from_numpy(data.copy()),
    "as_tensor": lambda data: torch.as_tensor(data.copy()),
    "tensor": lambda data: torch.tensor(data),
    "asarray": lambda data: torch.asarray(data.copy()),
}


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("make", list(_FROM_PYTHON_DATA))
def test_a_tensor_made_inside_from_python_data_and_written_in_place_is_fresh_at_each_call(make, cache):
    """``torch.frombuffer`` is made by no torch op: the program held the first call's
    tensor and doubled it again at every call."""
    import numpy

    def fn(x):
        t = _FROM_PYTHON_DATA[make](numpy.float32([1, 2]))
        t.mul_(2)
        return x + t

    jitted = dtcompile.jit(fn, cache=cache)
    for _ in range(3):
        assert_same_result(jitted(torch.zeros(2)), fn(torch.zeros(2)))


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("mode", ["bilinear", "bicubic", "nearest", "nearest-exact"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_interpolation_of_sizes_that_are_numbers_is_eagers_kernel(layout, mode, cache):
    """Under its Python dispatcher (which tracing runs) torch decomposes upsampling into
    index arithmetic, which rounds otherwise than its native kernel and lays a 1x1 result
    of a channels_last input out otherwise: to an output size of numbers, or by a scale
    factor, the native op is recorded, bit for bit and stride for stride eager's, with its
    gradients."""
    import torch.nn.functional as F

    weight = torch.randn(8, 8, 1, 1)

    def fn(x, size):
        scale = {"scale_factor": size} if isinstance(size, float) else {"size": size}
        return F.interpolate(F.conv2d(x, weight), mode=mode, **scale)

    jitted = dtcompile.jit(fn, cache=cache)
    for shape, size in (((2, 8, 5, 4), (2, 3)), ((2, 8, 5, 4), (7, 9)), ((2, 8, 3, 2), (1, 1)), ((2, 8, 6, 4), 0.5)):
        x = torch.randn(shape)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, expected = jitted(x_compiled, size), fn(x_eager, size)
        assert got.stride() == expected.stride()
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        got.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=0, atol=0)


# A helper of torch's own namespace that seeds (as torch.testing's ``wrapper_set_seed``), or
# saves and restores the generator around its draws: it is the user's code here, which the
# compiled program would not run again.
_TORCH_NAMED = {"__name__": "torch.testing._seeding_helper", "torch": torch}
exec(
    "def seeded_draw(x):\n"
    "    state = torch.get_rng_state()\n"
    "    torch.manual_seed(42)\n"
    "    y = x + torch.rand(3)\n"
    "    torch.set_rng_state(state)\n"
    "    return y\n",
    _TORCH_NAMED,
)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_seeding_in_torch_named_code_that_is_not_a_random_op_of_torch_is_refused(cache):
    # Torch's modules were let seed, for DTensor's random regions; a seed set and the state
    # put back by another of torch's helpers made the program draw from the caller's
    # generator, where eager draws seed 42's numbers at every call.
    with pytest.raises(dtcompile.TracingError, match="called torch.get_rng_state"):
        dtcompile.jit(_TORCH_NAMED["seeded_draw"], cache=cache)(torch.ones(3))
