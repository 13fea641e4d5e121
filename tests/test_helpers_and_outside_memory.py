"""Helpers the traced code calls through a library's wrapper (``@torch.no_grad()``,
``@contextlib.contextmanager``, ``functools.lru_cache``) and tensors over memory outside
torch (``torch.from_numpy`` of a global array): what eager reads, writes and keeps."""

import contextlib
import functools

import numpy as np
import pytest
import torch

import dtcompile
from dtcompile import TracingError
from dtcompile.testing.compare import assert_same

CACHES = ["constant values", "symbolic values"]
SCALE = 2.0
LOG: list = []


@torch.no_grad()
def _scaled_no_grad(x):
    return x * SCALE


@torch.compiler.disable
def _scaled_disabled(x):
    return x * SCALE


@torch.autocast("cpu", enabled=False)
def _scaled_autocast_off(x):
    return x * SCALE


@contextlib.contextmanager
def _scale():
    yield SCALE


def _through_a_context_manager(x):
    with _scale() as s:
        return x * s


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn",
    [lambda x: _scaled_no_grad(x) + 1, lambda x: _scaled_disabled(x) + 1, lambda x: _scaled_autocast_off(x) + 1]
    + [_through_a_context_manager],
    ids=["no_grad", "compiler.disable", "autocast", "contextmanager"],
)
def test_what_a_wrapped_helper_reads_is_guarded(cache, fn):
    global SCALE
    jitted, x = dtcompile.jit(fn, cache=cache), torch.ones(3)
    try:
        assert_same(jitted(x), fn(x))
        SCALE = 3.0
        assert_same(jitted(x), fn(x))
        assert jitted(x)[0].item() == fn(x)[0].item() and fn(x)[0].item() in (3.0, 4.0)
    finally:
        SCALE = 2.0


@torch.no_grad()
def _logged(x):
    LOG.append("called")
    return x * 2


@contextlib.contextmanager
def _recorded(name):
    LOG.append(name)
    yield


def _through_a_recording_context(x):
    with _recorded("forward"):
        return x * 2


@pytest.mark.parametrize("fn", [_logged, _through_a_recording_context], ids=["no_grad", "contextmanager"])
def test_a_wrapped_helpers_side_effect_is_refused_and_put_back(fn):
    LOG.clear()
    with pytest.raises(TracingError, match="LOG"):
        dtcompile.jit(fn)(torch.ones(3))
    assert LOG == []


@functools.lru_cache(maxsize=4)
def _causal_mask(n: int):
    return torch.triu(torch.full((n, n), float("-inf")), 1)


def _masked(x):
    return x + _causal_mask(x.shape[-1])


def _masked_twice(x):
    return x * 2 + _causal_mask(x.shape[-1])


@pytest.mark.parametrize("cache", CACHES)
def test_an_lru_cached_helper_keeps_no_traced_tensor(cache):
    _causal_mask.cache_clear()
    x = torch.randn(3, 3)
    assert_same(dtcompile.jit(_masked, cache=cache)(x), _masked(x))
    assert all(type(_causal_mask(n)) is torch.Tensor for n in (2, 3))  # eager calls get real tensors
    assert_same(dtcompile.jit(_masked_twice, cache=cache)(x), _masked_twice(x))  # another trace
    assert_same(dtcompile.jit(_masked, cache=cache)(x.double()), _masked(x.double()))


def _cached_helpers_held(how: str):
    @functools.lru_cache
    def doubled_ones(n):
        return torch.ones(n) * 2

    if how == "a default":

        def fn(x, make=doubled_ones):
            return x + make(x.shape[0])

    elif how == "a list":
        held = [doubled_ones]

        def fn(x):
            return x + held[0](x.shape[0])

    else:
        held = {"make": doubled_ones}

        def fn(x):
            return x + held["make"](x.shape[0])

    return fn, doubled_ones


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("how", ["a default", "a list", "a dict"])
def test_an_lru_cached_helper_held_by_a_default_a_list_or_a_dict_keeps_no_traced_tensor(how, cache):
    # Called while traced, it kept the trace's proxy, which the caller's next call got.
    fn, helper = _cached_helpers_held(how)
    jitted = dtcompile.jit(fn, cache=cache)
    for n in (3, 3, 4):
        assert_same(jitted(torch.ones(n)), torch.full((n,), 3.0))
        assert type(helper(n)) is torch.Tensor and type(helper(n + 5)) is torch.Tensor


ARRAY = np.zeros(3, dtype=np.float32)
BUFFER = bytearray(12)


def _written_through(x):
    t = torch.from_numpy(ARRAY)
    t.add_(x)
    return t * 1


def _returned(x):
    return torch.from_numpy(ARRAY)


def _view_written(x):
    t = torch.from_numpy(ARRAY[1:])
    t.mul_(x[1:])
    return t + 1


def _made_inside(x):
    t = torch.from_numpy(np.ones(3, dtype=np.float32))
    t.add_(x)
    return t * 1


def _buffer_written(x):
    t = torch.frombuffer(BUFFER, dtype=torch.float32)
    t.add_(x)
    return t * 1


def _as_tensor_written(x):
    t = torch.as_tensor(ARRAY)
    t.sub_(x)
    return t * 1


def _as_tensor_copied(x):
    t = torch.as_tensor(ARRAY, dtype=torch.float64)
    t.add_(x)
    return t * 1


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn",
    [_written_through, _returned, _view_written, _made_inside, _buffer_written, _as_tensor_written, _as_tensor_copied],
)
def test_a_tensor_over_numpy_or_python_memory(cache, fn):
    """Over memory there before the call, the program uses that memory, as eager's tensor
    does; over memory the call makes, a copy made at each call."""
    results = {}
    for name, run in (("eager", fn), ("compiled", dtcompile.jit(fn, cache=cache))):
        ARRAY[:] = 1.0
        BUFFER[:] = bytes(12)
        outs = [run(torch.full((3,), 2.0)) for _ in range(3)]
        ARRAY[0] = 7.0  # seen by a returned tensor over the array
        results[name] = ([o.clone() for o in outs], ARRAY.copy(), bytes(BUFFER))
    (eager, eager_array, eager_buffer), (got, got_array, got_buffer) = results["eager"], results["compiled"]
    for e, g in zip(eager, got):
        assert_same(g, e)
    assert (eager_array == got_array).all() and eager_buffer == got_buffer


GRID = np.arange(6, dtype=np.float32).reshape(2, 3)  # a view of the array that owns the memory


def _view_of_a_held_view(x):
    t = torch.from_numpy(GRID[:, 1:])
    t += x[:2, None]
    return t.sum() * 1


def _transposed_returned(x):
    return torch.from_numpy(GRID.T)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("fn", [_view_of_a_held_view, _transposed_returned])
def test_a_tensor_over_a_view_of_a_held_array(cache, fn):
    results = []
    for run in (fn, dtcompile.jit(fn, cache=cache)):
        GRID[:] = np.arange(6, dtype=np.float32).reshape(2, 3)
        outs = [run(torch.ones(3)) for _ in range(3)]
        GRID[0, 0] = 9.0  # seen by a returned tensor over the array
        results.append(([o.clone() for o in outs], GRID.copy()))
    for got, expected in zip(results[1][0], results[0][0]):
        assert_same(got, expected)
    assert (results[0][1] == results[1][1]).all()


class _Settings:
    def __init__(self):
        self.scale = 2.0


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("made_before", [True, False])
@pytest.mark.parametrize("another_key", [False, True])
def test_an_object_an_lru_cached_accessor_returns(cache, made_before, another_key):
    """As eager: the cache's own object (a singleton kept), and what the code reads of it
    guarded (a change between calls is seen)."""

    @functools.cache
    def settings(key):
        return _Settings()

    first = settings("a") if made_before else None

    def f(x):
        y = x * settings("a").scale
        return y + settings("b").scale if another_key else y

    jitted, x = dtcompile.jit(f, cache=cache), torch.ones(2)
    assert_same(jitted(x), f(x))
    settings("a").scale = 5.0
    assert_same(jitted(x), f(x))
    assert first is None or settings("a") is first


WEIGHTS = torch.ones(4)


@functools.lru_cache
def _table(n: int):
    return WEIGHTS[:n] * 2


@pytest.mark.parametrize("cache", CACHES)
def test_an_lru_cache_emptied_between_calls_is_computed_anew(cache):
    def f(x):
        return x + _table(4)

    _table.cache_clear()
    jitted, x = dtcompile.jit(f, cache=cache), torch.zeros(4)
    try:
        assert_same(jitted(x), f(x))
        WEIGHTS.fill_(5.0)  # new weights, and the app empties its cache
        _table.cache_clear()
        assert_same(jitted(x), f(x))
        assert jitted(x)[0].item() == 10.0
    finally:
        WEIGHTS.fill_(1.0)
        _table.cache_clear()


@functools.lru_cache
def _counts_calls(n: int):
    return torch.zeros(n)


_TABLE_BASE = {"base": 1.0}


@functools.lru_cache
def _scaled_positions(n: int):
    return torch.arange(n) * _TABLE_BASE["base"]


def _counted(x):
    c = _counts_calls(x.shape[0])
    c.add_(1)  # eager: the cached tensor counts the calls of each length
    return x + c


def _positioned(x):
    return x * _scaled_positions(x.shape[0])


@pytest.mark.parametrize("cache", CACHES)
def test_an_lru_cached_helper_of_a_size_returns_what_its_cache_holds(cache):
    """Eager returns the cached object: written in place by earlier calls, or made before a
    global it read changed (no ``cache_clear``). Under symbolic values the program computed
    it anew at each call; it is now called with the size's value, an entry per value."""
    _counts_calls.cache_clear()
    _scaled_positions.cache_clear()
    jitted, jitted_positions = dtcompile.jit(_counted, cache=cache), dtcompile.jit(_positioned, cache=cache)
    try:
        for n, base in ((2, 1.0), (2, 2.0), (3, 2.0), (2, 3.0), (3, 3.0)):
            _TABLE_BASE["base"] = base
            x = torch.ones(n)
            got = jitted(x)
            _counts_calls(n).sub_(1)  # as if eager had not counted this call: its call counts it again
            assert_same(got, _counted(x))
            assert_same(jitted_positions(x), _positioned(x))
    finally:
        _TABLE_BASE["base"] = 1.0
