"""A refusal is raised inside the user's code while it is traced; code that catches it
(``except Exception``, ``contextlib.suppress``) and goes on another way must not make the
compiled call take that way at every call, where eager takes the first: the refusal is
raised once the traced code returns."""

import contextlib
import pickle

import pytest
import torch

import dtcompile
from dtcompile import TracingError
from dtcompile.testing.compare import assert_same

CACHES = ["constant values", "symbolic values"]


def _via_numpy(x):
    try:
        return torch.from_numpy(x.numpy() * 2)
    except Exception:
        return x * 0


def _via_version(x):
    with contextlib.suppress(Exception):
        return x * (x._version + 10)
    return x * 9


def _via_pickle(x):
    try:
        pickle.dumps(x)
        return x * 1
    except Exception:
        return x * 0


def _via_seed(x):
    with contextlib.suppress(RuntimeError):
        torch.manual_seed(0)
    return x + torch.rand(4)


def _via_storage(x):
    try:
        return x * x.untyped_storage().nbytes()
    except Exception:
        return x


def _via_text(x):
    try:
        return x * len(str(x))
    except Exception:
        return x


def _branch_on_a_random_number(x):
    try:
        return x * 2 if torch.rand(()).item() > 2 else x * 3
    except Exception:
        return x * 4


def _branch_after_a_write(x):
    x.add_(1)
    try:
        return x * 2 if x.sum() > 0 else x * 3
    except Exception:
        return x * 4


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn",
    [
        _via_numpy,
        _via_version,
        _via_pickle,
        _via_seed,
        _via_storage,
        _via_text,
        _branch_on_a_random_number,
        _branch_after_a_write,
    ],
)
def test_a_refusal_the_code_catches_is_still_raised(cache, fn):
    fn(torch.ones(4))  # eager runs it the first way
    with pytest.raises(TracingError, match="dtcompile.jit"):
        dtcompile.jit(fn, cache=cache)(torch.ones(4))


@pytest.mark.parametrize("cache", CACHES)
def test_a_hook_refusal_the_code_catches_is_still_raised(cache):
    def f(x):
        try:
            x.register_hook(lambda g: g * 10)
        except RuntimeError:
            pass
        return x * 2

    with pytest.raises(TracingError, match="register_hook"):
        dtcompile.jit(f, cache=cache)(torch.ones(2, requires_grad=True))


@pytest.mark.parametrize("cache", CACHES)
def test_the_users_own_exceptions_caught_and_a_branch_on_data_still_compile(cache):
    def f(x):
        try:
            if x.sum() > 0:  # a branch on data: compiled, checked at each call
                raise ValueError("positive")
            y = x * 2
        except ValueError:
            y = x * 3
        try:
            y = y @ torch.ones(5)  # a size mismatch: eager's error, caught
        except RuntimeError:
            y = y + 1
        return y

    jitted = dtcompile.jit(f, cache=cache)
    for x in (torch.ones(4), -torch.ones(4), torch.ones(4)):
        assert_same(jitted(x), f(x))


@pytest.mark.parametrize("layer", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_recurrent_layers_are_refused_by_name(layer):
    with pytest.raises(TracingError, match="nn.LSTM, nn.GRU and nn.RNN are not supported yet"):
        dtcompile.jit(layer(4, 8))(torch.randn(3, 2, 4))


class _Config:
    scale = 1.0


CONFIG = _Config()


@contextlib.contextmanager
def _scaled(value):  # no try/finally: a refusal inside leaves it entered
    old, CONFIG.scale = CONFIG.scale, value
    yield CONFIG.scale
    CONFIG.scale = old


def _refused_inside_a_context_manager(x):  # (``CONFIG`` reached only through the helper)
    with _scaled(0.5) as scale:
        print(x)
        return x * scale


@pytest.mark.parametrize("cache", CACHES)
def test_what_a_failed_trace_left_changed_is_put_back(cache):
    CONFIG.scale = 1.0
    with pytest.raises(TracingError, match="into text"):
        dtcompile.jit(_refused_inside_a_context_manager, cache=cache)(torch.ones(2))
    assert vars(CONFIG) == {"scale": 1.0}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "op",
    [
        torch.nn.functional.linear,
        lambda x, w: torch.matmul(x, w.t()),
        lambda x, w: x @ w.t(),
        lambda x, w: torch.mm(x, w.t()),
        lambda x, w: torch.addmm(torch.zeros(2, 4), x, w.t()),
    ],
    ids=["linear", "matmul", "@", "mm", "addmm"],
)
def test_eagers_dtype_error_is_caught_by_the_code_as_in_eager(cache, op):
    def f(x, w):
        try:
            return op(x, w) * 1
        except RuntimeError:  # eager's: float32 with float64
            return op(x, w.to(x.dtype)) * 2

    x, w = torch.ones(2, 3), torch.ones(4, 3, dtype=torch.float64)
    assert_same(dtcompile.jit(f, cache=cache)(x, w), f(x, w))


class _Counting(torch.nn.Module):
    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        if x.shape[0] > 2:
            raise ValueError("too long")
        return x * 2


def _written_then_raising(x, y):
    x.add_(1)
    if x.shape[0] > 2:
        raise ValueError("too long")
    return x @ y  # (a shape error of torch's for another y)


@pytest.mark.parametrize("cache", CACHES)
def test_an_error_of_the_codes_leaves_eagers_changes(cache):
    """Eager raises after its in-place write and attribute set; so does a compiled call (it
    runs eagerly once tracing met the code's own error or a torch kernel's check)."""
    for y in (torch.ones(3), torch.ones(4)):  # the code's ValueError, then torch's shape error
        results = []
        for fn in (_written_then_raising, dtcompile.jit(_written_then_raising, cache=cache)):
            x = torch.zeros(3 if y.shape[0] == 3 else 2)
            with pytest.raises((ValueError, RuntimeError)) as error:
                fn(x, y)
            results.append((type(error.value), x.clone()))
        assert results[0][0] is results[1][0]
        assert_same(results[1][1], results[0][1])
    model = _Counting()
    with pytest.raises(ValueError, match="too long"):
        dtcompile.jit(model, cache=cache)(torch.ones(3))
    assert model.calls == 1


@pytest.mark.parametrize("cache", CACHES)
def test_a_refusal_is_not_run_eagerly(cache):
    x = torch.zeros(2)

    def f(x):
        x.add_(1)
        print(x)
        return x

    with pytest.raises(TracingError, match="into text"):
        dtcompile.jit(f, cache=cache)(x)
    assert x.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("cache", CACHES)
def test_eagers_own_error_before_a_refusal_is_caught_as_in_eager(cache):
    def f(x):
        try:
            return torch.from_numpy(x.numpy() * 2)  # eager: x requires grad, numpy() raises
        except RuntimeError:
            return x * 3

    x = torch.ones(3, requires_grad=True)
    assert_same(dtcompile.jit(f, cache=cache)(x), f(x))


class _LSTMCell(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w_ih, self.w_hh = torch.nn.Parameter(torch.randn(32, 4)), torch.nn.Parameter(torch.randn(32, 8))
        self.b_ih, self.b_hh = torch.nn.Parameter(torch.randn(32)), torch.nn.Parameter(torch.randn(32))

    def forward(self, x):
        h0 = torch.zeros(1, x.shape[1], 8)
        weights = (self.w_ih, self.w_hh, self.b_ih, self.b_hh)
        return torch.lstm(x, (h0, h0), weights, True, 1, 0.0, self.training, False, False)[0]


def test_a_recurrent_op_with_gradients_is_refused_and_without_is_eagers():
    model = _LSTMCell()
    with pytest.raises(TracingError, match="torch.lstm with gradients"):
        dtcompile.jit(model)(torch.randn(3, 2, 4))
    with torch.no_grad():
        x = torch.randn(3, 2, 4)
        assert_same(dtcompile.jit(model)(x), model(x), rtol=0, atol=0)


def _checked(x):
    if x.shape[0] > 2:
        raise ValueError(f"too long for this model: {x}")
    return x * 2


def _printed(x):
    print(f"x is {x.sum():.2f}")
    return x * 2


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_code_formatting_a_tensor_into_the_error_it_raises_raises_its_own(cache):
    # The text refusal fired first: a library's check (local_map's placements) or the
    # user's raised dtcompile's advice to print outside the call, the real cause lost.
    x = torch.ones(3)
    with pytest.raises(ValueError) as eager:
        _checked(x)
    with pytest.raises(ValueError) as compiled:
        dtcompile.jit(_checked, cache=cache)(x)
    assert str(compiled.value) == str(eager.value)
    with pytest.raises(dtcompile.TracingError, match="turns args\\[0\\] into text|turns a tensor into text"):
        dtcompile.jit(_printed, cache=cache)(x)  # (a formatted print is still refused, not a TypeError)


def _view_under_no_grad(x, written):
    with torch.no_grad():
        y = x[1:]
        if written:
            y.add_(1)
    return (x * 2).sum(), y


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("written", [False, True])
def test_a_view_taken_under_no_grad_and_returned_from_a_call_with_gradients_is_refused_as_such(written, cache):
    # Refused as "a leaf tensor made inside the call"; written in place, autograd's own error
    # ("A view was created in no_grad mode ...") came out of dtcompile's check of the outputs.
    x = torch.ones(4, 5, requires_grad=True)
    _view_under_no_grad(x, written)  # eager runs
    with pytest.raises(TracingError, match="a view of a tensor that requires grad, taken under torch.no_grad"):
        dtcompile.jit(_view_under_no_grad, cache=cache)(torch.ones(4, 5, requires_grad=True), written)


def _same_memory(x, y):
    return x * 2 if x.data_ptr() == y.data_ptr() else x + y


@pytest.mark.parametrize("cache", CACHES)
def test_data_ptr_is_refused_as_an_address_not_as_values(cache):
    """``data_ptr()`` reads no values: the refusal says what it reads."""
    x = torch.randn(3)
    with pytest.raises(TracingError, match=r"Tensor.data_ptr of a traced tensor: its memory address") as raised:
        dtcompile.jit(_same_memory, cache=cache)(x, x.clone())
    assert "depends on the values" not in str(raised.value)
