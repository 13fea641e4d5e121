"""Tensors made from Python numbers the trace computes (a size under symbolic values, a
number read from data, a comparison of them) hold eager's values, not 32-bit ones, and
are computed at each call (one compilation for every length); a view of an elementwise
result with a dim of size 1 keeps eager's strides."""

import numpy as np
import pytest
import torch

import dtcompile
from dtcompile.testing.compare import assert_same

CACHES = ["constant values", "symbolic values"]

CASES = {
    "a size times 10**9": lambda x: torch.tensor([x.shape[0] * 10**9]),
    "a size past 2**31": lambda x: torch.tensor(x.shape[0] + 2**31),
    "as_tensor": lambda x: torch.as_tensor([-x.shape[0] * 10**9, 1]),
    "new_tensor": lambda x: x.new_tensor([x.shape[0] * 10**9]),
    "float64": lambda x: torch.tensor([x.shape[0] * 10**9 + 1], dtype=torch.float64),
    "a float": lambda x: torch.tensor([[x.shape[0] / 2, 1.0], [2.0, x.shape[0] * 1.5]]),
    "added to the input": lambda x: x.sum() + torch.tensor([x.shape[0], 2 * x.shape[0]]),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", list(CASES))
def test_a_tensor_of_sizes(cache, name):
    fn = CASES[name]
    jitted = dtcompile.jit(fn, cache=cache)
    for n in (3, 4, 5):
        x = torch.ones(n)
        assert_same(jitted(x), fn(x), rtol=0, atol=0)
    if cache == "symbolic values":
        assert jitted._dtcompile.stats.misses == 1


# A comparison of sizes in the user's code is Python's bool, as eager's (torch's ops refuse a
# SymBool as a flag: ``keepdim=n > 4``): a guard, so an entry for each outcome.
COMPARISONS = {
    "a comparison": lambda x: torch.tensor([x.shape[0] > 3, x.shape[0] % 2 == 0]),
    "a comparison as float": lambda x: torch.tensor(x.shape[0] == 3, dtype=torch.float32),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", list(COMPARISONS))
def test_a_tensor_of_size_comparisons(cache, name):
    fn = COMPARISONS[name]
    jitted = dtcompile.jit(fn, cache=cache)
    outcomes = set()
    for n in (3, 4, 5, 3, 4):
        x = torch.ones(n)
        assert_same(jitted(x), fn(x), rtol=0, atol=0)
        outcomes.add(tuple(fn(x).tolist()) if fn(x).dim() else fn(x).item())
    if cache == "symbolic values":
        assert jitted._dtcompile.stats.misses == len(outcomes)


@pytest.mark.parametrize("cache", CACHES)
def test_a_tensor_of_numbers_read_from_data(cache):
    def f(t):
        return torch.tensor([t.item() * 10**9, 1])

    jitted = dtcompile.jit(f, cache=cache)
    for value in (3, 4):
        assert_same(jitted(torch.tensor(value)), f(torch.tensor(value)), rtol=0, atol=0)
    assert jitted._dtcompile.stats.misses == 1  # a number read at run time, not one entry per value


VIEWS = {
    "view": lambda t: (t.T * 2).view(1, t.shape[0]),
    "view_as": lambda t: (t.T * 2).view_as(t.T),
    "reshape": lambda t: (t.T + 1).reshape(1, -1),
    "where": lambda t: torch.where(t.T > 0, t.T, 0.0).view(1, -1),
    "unsqueeze": lambda t: (t.squeeze(1).unsqueeze(0) * 1).view(1, -1),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name", list(VIEWS))
def test_a_view_of_an_elementwise_result_with_a_dim_of_size_one(cache, grad, name):
    fn = VIEWS[name]
    jitted = dtcompile.jit(fn, cache=cache)
    for n in (4, 6):
        t = torch.randn(n, 1, requires_grad=grad)
        assert_same(jitted(t), fn(t))  # (strides too)


FROM_DATA = {
    "beside a NumPy float": lambda x: torch.tensor([x[0].long().item(), np.float64(2.5)]),
    "beside a NumPy int": lambda x: torch.tensor([x[0].long().item(), np.int32(2)]),
    "beside a complex": lambda x: torch.tensor([x[0].long().item(), 1j]),
    "past float32": lambda x: torch.tensor([x[0].item() * 1e300]),
    "a float as int64": lambda x: torch.tensor([x[0].item() * 2.5, 1], dtype=torch.int64),
    "a size beside a complex": lambda x: torch.tensor([x.shape[0], 1j]),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", list(FROM_DATA))
def test_a_tensor_of_numbers_read_from_data_has_eagers_dtype(cache, name):
    fn = FROM_DATA[name]
    jitted = dtcompile.jit(fn, cache=cache)
    for x in (torch.full((3,), 3.0), torch.full((4,), 2.0)):
        assert_same(jitted(x), fn(x), rtol=0, atol=0)


def _outcome(fn, *args):
    try:
        return fn(*args)
    except RuntimeError as error:
        return str(error)


_NARROW = {  # dtype, the numbers read (each twice: first and cached calls), ints then floats
    torch.int8: [3, 100, 200, 3, -300, 127, 100.5, 127.5, -128.0],
    torch.int16: [7, 40000, 7, -32768],
    torch.int32: [5, 2**31, 5, -(2**31)],
    torch.uint8: [3, 255, 256, -1, -255, -256],
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dtype", list(_NARROW), ids=str)
def test_a_number_that_does_not_fit_a_narrow_integer_dtype_raises_as_eager(cache, dtype):
    # torch.tensor([n], dtype=torch.int8) of a number read from data wrapped (200 -> -56)
    # where eager raises "value cannot be converted to type int8 without overflow".
    def fn(x):
        return torch.tensor([x.sum().item(), 1], dtype=dtype) * 2

    jitted = dtcompile.jit(fn, cache=cache)
    for value in _NARROW[dtype] * 2:
        x = torch.tensor([value], dtype=torch.float64 if isinstance(value, float) else torch.int64)
        expected, got = _outcome(fn, x), _outcome(jitted, x)
        if isinstance(expected, str):
            assert got == expected
        else:
            assert_same(got, expected)


@pytest.mark.parametrize("cache", CACHES)
def test_a_size_that_does_not_fit_a_narrow_integer_dtype_raises_as_eager(cache):
    def fn(x):
        return torch.tensor([x.shape[0] * 20], dtype=torch.int8)

    jitted = dtcompile.jit(fn, cache=cache)
    for n in [2, 6, 7, 3, 7]:
        expected, got = _outcome(fn, torch.ones(n)), _outcome(jitted, torch.ones(n))
        assert got == expected if isinstance(expected, str) else torch.equal(got, expected)
