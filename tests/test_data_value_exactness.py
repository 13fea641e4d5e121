"""Numbers read from tensor data (and sizes) computed exactly as eager's Python does: a
value specialized while tracing is checked exactly at run time (NaN by ``isnan``, a
zero with its sign), float arithmetic keeps Python's order and IEEE results (``k - k``
of inf is NaN, ``(k + 1e16) - 1e16`` is not ``k``) and stays a float, ``math.trunc`` of
a negative quotient truncates, and the checks torch's ops make of such numbers
(``narrow``, ``split``) raise at run time as eager's op does. Each test runs one compiled
function over several values, against eager, under both cache options."""

from __future__ import annotations

import math

import pytest
import torch

import dtcompile

CACHES = ["constant values", "symbolic values"]
NAN, INF = float("nan"), float("inf")


def _same(actual, expected, where="result") -> None:
    """Equal as Python and torch see them: types, NaN, the sign of zero, dtypes."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _same(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        same = (math.isnan(actual) and math.isnan(expected)) or (
            actual == expected and math.copysign(1.0, actual) == math.copysign(1.0, expected)
        )
        assert same, f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, f"{where}: {actual} != {expected}"
        assert torch.equal(actual.isnan(), expected.isnan()), f"{where}: {actual} != {expected}"
        finite = ~expected.isnan()
        assert torch.equal(actual[finite], expected[finite]), f"{where}: {actual} != {expected}"
        if expected.is_floating_point():
            signs = actual[finite].signbit(), expected[finite].signbit()
            assert torch.equal(*signs), f"{where}: {actual} != {expected} (signs)"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _outcome(fn, *args):
    try:
        return fn(*args), None
    except Exception as error:  # noqa: BLE001 - the error is what is compared
        return None, error


def _compare(fn, cache, calls) -> None:
    """Run eager and one compiled ``fn`` over ``calls`` (argument tuples), in order."""
    compiled = dtcompile.jit(fn, cache=cache)
    for args in calls:
        expected, eager_error = _outcome(fn, *args)
        actual, error = _outcome(compiled, *args)
        where = f"{cache}, {args[-1]!r}"
        if eager_error is not None:
            assert error is not None, f"{where}: eager raised {eager_error!r}, compiled returned {actual!r}"
            assert isinstance(error, (RuntimeError, IndexError, type(eager_error))), f"{where}: {error!r}"
            assert not isinstance(error, dtcompile.TracingError), f"{where}: {error!r}"
            continue
        assert error is None, f"{where}: eager returned {expected!r}, compiled raised {error!r}"
        _same(actual, expected, where)


def _scalars(*values, dtype=torch.float64):
    return [(torch.ones(2), torch.tensor(v, dtype=dtype)) for v in values]


def _float_and_text(x, t):
    k = float(t.item())
    return x * k, str(t.item())


def _isnan_branch(x, t):
    k = t.item()
    return x * 2 if math.isnan(k) else x


def _self_unequal(x, t):
    k = t.item()
    return x * 2 if k != k else x


def _min_with_zero(x, t):
    return x * min(t.item(), 0.0)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("fn", [_float_and_text, _isnan_branch, _self_unequal, _min_with_zero])
def test_nan_read_from_data_is_checked_exactly(fn, cache):
    # An entry specialized on a NaN served every later value; ``k != k`` was False.
    _compare(fn, cache, _scalars(1.5, NAN, 2.0, 7.0, NAN, -1.0))


_SELF_COMPARISONS = {
    "ge": lambda k: k >= k,
    "le": lambda k: k <= k,
    "negated": lambda k: -k <= -k,
    "plus one": lambda k: k + 1 > k,
    "minus one": lambda k: k - 1 < k,
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("comparison", list(_SELF_COMPARISONS))
def test_float_compared_with_itself_follows_nan_and_infinity(comparison, cache):
    # ``k >= k`` and ``k + 1 > k``, which sympy decides for finite numbers, were True for a
    # NaN (and the latter for inf), with no check.
    decided = _SELF_COMPARISONS[comparison]

    def fn(x, t):
        return x * 2 if decided(t.item()) else x

    _compare(fn, cache, _scalars(1.5, NAN, 2.0, INF, NAN, -INF))


def _sign_of_zero(x, t):
    k = t.item()
    return x * math.copysign(1.0, k), str(k), float(k), x / torch.tensor(k), math.atan2(k, -1.0)


@pytest.mark.parametrize("cache", CACHES)
def test_negative_zero_read_from_data_keeps_its_sign(cache):
    # -0.0 passed the check made for 0.0 (``k == 0``), and was traced as 0.0.
    _compare(_sign_of_zero, cache, _scalars(0.0, -0.0, 0.0, -0.0, 2.5))
    _compare(_sign_of_zero, cache, _scalars(-0.0, 0.0))


def _trunc_of_quotient(x, t):
    k = t.item()
    return math.trunc(k / 3), x[: math.trunc(k / 3) + 4]


@pytest.mark.parametrize("cache", CACHES)
def test_trunc_of_a_negative_quotient_truncates(cache):
    # math.trunc(k / 3) was computed as k // 3, which floors.
    _compare(_trunc_of_quotient, cache, [(torch.arange(10.0), torch.tensor(v)) for v in (5, -5, -1, 7, -7)])


def _float_minus_itself(x, t):
    k = t.item()
    return k - k, 0 * k, x * (k - k), torch.full((2,), k - k), k * 0.0


def _float_of_size_minus_size(x):
    n = x.shape[0]
    return float(n) - n, torch.full((2,), float(n) - n), float(n) * 2 - n


@pytest.mark.parametrize("cache", CACHES)
def test_float_arithmetic_stays_float_and_ieee(cache):
    # k - k and 0 * k became the int 0: NaN and inf lost, an int64 tensor from torch.full.
    _compare(_float_minus_itself, cache, _scalars(3.5, INF, NAN, -2.0, 3.5, -INF, 0.0, -0.0, dtype=torch.float32))
    _compare(_float_of_size_minus_size, cache, [(torch.randn(n, 3),) for n in (5, 7, 5)])


def _reassociated(x, t):
    k = t.item()
    n = x.shape[0]
    return (k + 1e16) - 1e16, (k + 0.1) - 0.1, n * 0.1 * 10, x * ((k + 1e16) - 1e16), k * 0.29 * 100


def _sliced_by_float(x, t):
    return x[: int(t.item() * 0.29 * 100)]


def _sized_by_float(x):
    return torch.zeros(int(x.shape[0] * 0.29 * 100))


def _branch_on_sum(x, t):
    k = t.item()
    return x * 2 if (k + 0.2) + 0.7 >= 1.0 else x * 3


@pytest.mark.parametrize("cache", CACHES)
def test_float_arithmetic_in_python_order(cache):
    # sympy regrouped (k + 1e16) - 1e16 as k, and n * 0.29 * 100 as 29.0 * n.
    _compare(_reassociated, cache, [(torch.ones(3), torch.tensor(v, dtype=torch.float64)) for v in (5.0, 0.3, 5.0)])
    _compare(_sliced_by_float, cache, [(torch.randn(1000), torch.tensor(v)) for v in (3, 5, 3)])
    _compare(_sized_by_float, cache, [(torch.randn(n),) for n in (3, 5, 3)])
    _compare(_branch_on_sum, cache, _scalars(0.5, 0.1, 0.5, 0.1))


def _narrow_length(x, t):
    return x.narrow(0, 0, t.item())


def _narrow_start(x, t):
    return x.narrow(0, t.item(), 1)


def _narrow_past_the_end(x, t):
    return x.narrow(1, t[0].item(), 2)


def _narrow_if_positive(x, t):
    k = t.item()
    return x.narrow(0, 0, k) if k > 0 else x * 2


@pytest.mark.parametrize("cache", CACHES)
def test_checks_of_ops_on_values_read_from_data_raise(cache):
    # narrow by a length or start read from data, out of range: eager raises, compiled
    # returned a tensor (torch's deferred runtime asserts were dropped).
    values = (3, -2, 3, 9, -9, 0)
    _compare(_narrow_length, cache, [(torch.arange(8.0), torch.tensor(v)) for v in values])
    _compare(_narrow_start, cache, [(torch.arange(8.0), torch.tensor(v)) for v in values])
    x = torch.arange(6.0).reshape(2, 3)
    _compare(_narrow_past_the_end, cache, [(x, torch.tensor([v])) for v in (0, 2, 1, 2)])
    # The op runs only where the branch is taken: its checks hold only there.
    _compare(_narrow_if_positive, cache, [(torch.arange(8.0), torch.tensor(v)) for v in (3, -2, 2, -5, 9)])


def _split_by_item(x, t):
    return x.split(t.item())


@pytest.mark.parametrize("cache", CACHES)
def test_split_by_zero_read_from_data_raises(cache):
    # The program's own check computed n // k: a ZeroDivisionError inside it for k == 0.
    _compare(_split_by_item, cache, [(torch.arange(8.0), torch.tensor(v)) for v in (2, 0, -1, 2, 3, 0)])


def _pair(x, t):
    return t[0].item(), t[1].item()


def _over_negated(x, t):
    v, w = _pair(x, t)
    return x * (2.0 if w / -v > -1 else 3.0)


def _over_a_remainder(x, t):
    v, w = _pair(x, t)
    return x * (2.0 if (w * 1.0) / (v % 1.5) > 1 else 3.0)


def _improvements(x, t):
    values = t.tolist()
    best, count = values[0], 0
    for v in values:
        if v > best:
            best, count = v, count + 1
    return x * count


def _self_less(x, t):
    v = t[0].item()
    return x * (2.0 if v < v else 3.0) + (1.0 if v > v else 0.0)


def _fraction(x, t):
    v = t[0].item()
    return x * (2.0 if v % 1.0 > 0.5 else 3.0) + (1.0 if v % 1 == 0 else 0.0) + (1.0 if (v * 2) % 1 > 0.2 else 0.0)


def _squared(x, t):
    v = t[0].item()
    return x * (v**2) + (1.0 if v**3 > 3 else 0.0)


def _int_reciprocal(x, t):
    n = t.to(torch.int64)[0].item()
    return x * (n**-1) + (1.0 if n**-2 > 0.05 else 0.0)


def _remainders(x, t):
    v, w = _pair(x, t)
    return x * float(v % w) + (1.0 if v % 1.0 else 0.0) + float(v // 0.1) + math.floor(w % v)


def _ratio_of_maxima(x, t):
    v, w = _pair(x, t)
    return x * float(max(v, 1.0) / max(w, v))


def _bits(x, t):
    n, m = t.to(torch.int64)[0].item(), t.to(torch.int64)[1].item()
    return x * float(n & -3) + (1.0 if (n & m) < 0 else 0.0) + (1.0 if n | 4 > 5 else 0.0)


def _ints_and_bools(x, t):
    n = t.to(torch.int64)[0].item()
    flags = (t > 0).tolist()
    same = 1.0 if (t == t[0]).all().item() == 1 else 0.0
    return x * round(n, -1) + same, n // 0.1, divmod(n, 0.3)[0], flags.count(1), 1 in flags


def _flags_compared(x, t):
    flag, n = (t[0] > 0).item(), t.to(torch.int64)[1].item()
    return flag == True, flag == n, flag == 1.0, x * (2 if flag == True else 3)  # noqa: E712


def _shifted(x, t):
    n, m = t.to(torch.int64)[0].item(), t.to(torch.int64)[1].item()
    return n << m, n >> m, 5 << m


def _indexed_by_a_flag(x, t):
    return x[(t[0] > 0).item()] * 2


def _vectors(*rows):
    return [(torch.ones(2), torch.tensor(row, dtype=torch.float64)) for row in rows]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn",
    [_over_negated, _over_a_remainder, _improvements, _self_less, _fraction, _squared, _int_reciprocal]
    + [_remainders, _ratio_of_maxima, _bits, _ints_and_bools, _indexed_by_a_flag, _flags_compared, _shifted],
)
def test_branches_on_floats_read_from_data_are_decided_by_their_values(fn, cache):
    """A branch on floats read from data is decided by their values and checked at run time:
    torch's static analysis, made for sizes, took ``v > v`` to be True and ``v % 1.0 > 0.5``
    to be False (an integer range), with no check; a check printed ``w / -v`` as
    ``w / (-1)*v``; ``v ** 2`` of a negative ``v`` raised (torch's ``v >= 0``); a float's
    ``%`` and ``//`` were an integer's (``float(v % w)`` baked in, ``2.5 // 0.1`` 25); a
    check divided by a number before the check that it is not zero; ``n & -3`` of a negative
    int was decided by a non-negative int's ranges; a bool read from data never equalled 1;
    ``round(n, -1)`` was ``n``; ``n // 0.1`` was ``floor(n / 0.1)``; ``x[flag]`` indexed by 1."""
    rows = [[1.0, 0.5, 2.0, 4.0], [0.5, 1.0, 3.0, 2.0], [4.0, 1.0, 0.5, 0.25], [-1.75, 0.75, 5.0, 1.0]]
    rows += [[1.75, -0.25, 1.0, 3.0], [-4.0, 2.0, 1.0, 1.0], [0.25, 1.0, 0.0, 1.0], [-2.0, -3.0, 1.0, 1.0]]
    rows += [[0.75, -3.0, 1.0, 1.0], [0.0, 4.0, 1.0, 1.0], [2.5, 2.0, 1.0, 1.0], [2.0, 0.0, 1.0, 1.0]]
    rows += [[7.0, 7.0, 7.0, 7.0], [25.0, 1.0, 1.0, 1.0], [-3.0, -3.0, -3.0, -3.0], [123.0, 123.0, 123.0, 123.0]]
    _compare(fn, cache, _vectors(*rows))
