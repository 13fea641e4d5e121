"""A call that fails while tracing raises eager's exception type: torch's fake and meta
kernels raise a RuntimeError for some calls where eager's kernel raises a
NotImplementedError, so ``except NotImplementedError`` written against eager took another
path (``capture/eager_errors.py``)."""

import pytest
import torch
import torch.nn.functional as F

import dtcompile
from dtcompile.testing.compare import assert_same

CACHES = ["constant values", "symbolic values"]

CALLS = {
    "floor division of complex": lambda x: x.to(torch.complex64) // 2,
    "mse_loss of integers": lambda x: F.mse_loss(x.long(), x.long()),
    "mse_loss of integers, inside": lambda x: F.mse_loss(x.long() + 1, x.long()) + x.sum(),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("call", CALLS)
def test_eagers_exception_type_and_message(cache, call):
    fn = CALLS[call]
    x = torch.arange(6.0)
    with pytest.raises(Exception) as eager:
        fn(x)
    with pytest.raises(Exception) as compiled:
        dtcompile.jit(fn, cache=cache)(x)
    assert type(compiled.value) is type(eager.value) is NotImplementedError
    assert str(compiled.value) == str(eager.value)


REJECTED_DTYPES = {
    "interpolate of integers": lambda x: F.interpolate(x.long().view(1, 1, 6), scale_factor=2.0),
    "hardshrink of integers": lambda x: F.hardshrink(x.long()),
    "softshrink of integers": lambda x: F.softshrink(x.long()),
    "one_hot of int32": lambda x: F.one_hot(x.int()),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("call", REJECTED_DTYPES)
def test_dtypes_eager_rejects_are_rejected(cache, call):
    """Traced through torch's decompositions these checked no dtype: a result (or a
    TypeError) where eager raises."""
    fn = REJECTED_DTYPES[call]
    x = torch.arange(6.0)
    with pytest.raises(Exception) as eager:
        fn(x)
    with pytest.raises(Exception) as compiled:
        dtcompile.jit(fn, cache=cache)(x)
    assert type(compiled.value) is type(eager.value) and str(compiled.value) == str(eager.value)


@pytest.mark.parametrize("cache", CACHES)
def test_the_same_calls_of_dtypes_eager_takes_match_eager(cache):
    def fn(x):
        return F.interpolate(x.view(1, 1, -1), scale_factor=2.0), F.hardshrink(x), F.one_hot(x.long() % 3)

    jitted = dtcompile.jit(fn, cache=cache)
    for n in (6, 8):
        x = torch.arange(float(n)) - 2
        for got, expected in zip(jitted(x), fn(x)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.interpolate(x, size=x.shape[-1] * 2, mode="nearest") * 2,
        lambda x: F.interpolate(x, size=(x.shape[-1] + 3,), mode="nearest"),
        lambda x: F.interpolate(x, size=(x.shape[-1] + 3,), mode="linear"),  # (decomposed: last bits)
        lambda x: F.one_hot(torch.arange(x.shape[-1]), num_classes=x.shape[-1] + 1) * 2,
        lambda x: F.hardshrink(x[..., : x.shape[-1] // 2], 0.5),
    ],
    ids=["interpolate size", "interpolate tuple", "interpolate linear", "one_hot classes", "hardshrink slice"],
)
def test_dtype_checked_ops_with_sizes_from_shapes_under_symbolic_values(fn):
    """The ops run on stand-ins while tracing get their sizes (SymInts) as numbers: eager's
    result at each length (torch's kernel raised on the SymInt)."""
    jitted = dtcompile.jit(fn, cache="symbolic values")
    for length in (8, 5, 12):
        x = torch.randn(2, 3, length)
        torch.testing.assert_close(jitted(x), fn(x), rtol=1e-6, atol=2e-6)


_FLOAT_INTO_INTEGERS = {
    "an argument, mul_": lambda a, b: a.mul_(b),
    "an intermediate, mul_": lambda a, b: (a * 1).mul_(b),
    "an intermediate, *=": lambda a, b: a.clone().__imul__(b),
    "index_put_": lambda a, b: (a * 1).index_put_((torch.tensor([0]),), b[:1]),
    "a bool tensor, add_": lambda a, b: (a > 1).add_(b),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("case", _FLOAT_INTO_INTEGERS)
def test_a_float_written_into_an_integer_tensor_in_place_raises_eagers_error(case, cache):
    # The fake kernels wrote it; with gradients autograd then took the integer tensor for
    # one needing a gradient: a false refusal, or torch's internal assert in the backward.
    fn = _FLOAT_INTO_INTEGERS[case]
    for requires_grad in (True, False):

        def arguments(requires_grad=requires_grad):
            return torch.tensor([1, 2]), torch.tensor([1.5, 2.0]).requires_grad_(requires_grad)

        with pytest.raises(RuntimeError) as eager:
            fn(*arguments())
        with pytest.raises(RuntimeError) as compiled:
            dtcompile.jit(fn, cache=cache)(*arguments())
        assert type(compiled.value) is type(eager.value) and str(compiled.value) == str(eager.value)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("where", ["made inside", "an argument"])
def test_matmul_out_with_an_argument_requiring_grad_raises_eagers_error(where, cache):
    # torch's Python form of matmul.out recorded it: the call ran (or refused with another
    # message) where eager's kernel raises that out= does not support autograd.
    def fn(a, b, o=None):
        return torch.matmul(a, b, out=torch.empty(2, 2) if o is None else o)

    args = (torch.randn(2, 3, requires_grad=True), torch.randn(3, 2))
    args += () if where == "made inside" else (torch.empty(2, 2),)
    with pytest.raises(RuntimeError) as eager:
        fn(*args)
    with pytest.raises(RuntimeError) as compiled:
        dtcompile.jit(fn, cache=cache)(*args)
    assert type(compiled.value) is type(eager.value) and str(compiled.value) == str(eager.value)


def _weighted_cov(x, w):
    return torch.cov(x, aweights=w)


def _inverse_into(a, o):
    return torch.linalg.inv(a, out=o)


def _restrided_beyond_the_view(x):
    return x.as_strided_((2, 2), (1, 2), storage_offset=10)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn, make",
    [
        (_weighted_cov, lambda: (torch.randn(2, 3), torch.tensor([0.3, 0.2, 0.4]))),
        (_inverse_into, lambda: (torch.randn(4, 4) + 4 * torch.eye(4), torch.zeros(4, 4))),
        (_restrided_beyond_the_view, lambda: (torch.randn(20)[5:15],)),
    ],
)
def test_a_refusal_is_not_replaced_by_an_error_eager_raises_on_zeros(fn, make, cache):
    # Where tracing refused an op, eager's kernel ran on zero stand-ins of the arguments, and
    # its error replaced the refusal: "weights sum to zero", "matrix is singular", "out of
    # bounds for storage" (the view's stand-in has only its own storage), for inputs eager
    # takes. The refusal is what the user gets now.
    fn(*make())  # eager runs
    with pytest.raises(dtcompile.TracingError, match="dtcompile.jit: "):
        dtcompile.jit(fn, cache=cache)(*make())


def _rank_into(a, o):
    return torch.linalg.matrix_rank(a, out=o)


@pytest.mark.parametrize("cache", CACHES)
def test_an_out_call_torch_computes_without_writing_out_is_refused(cache):
    # Under any dispatch mode torch runs matrix_rank's out= form functionally and writes no
    # out tensor: the program was empty, and the caller's out tensor kept its zero (eager 4).
    a = torch.randn(4, 4)
    assert _rank_into(a, torch.zeros((), dtype=torch.int64)) == 4
    with pytest.raises(dtcompile.TracingError, match="matrix_rank with out= writes no out tensor"):
        dtcompile.jit(_rank_into, cache=cache)(a, torch.zeros((), dtype=torch.int64))


def _kron_into(a, b, o):
    return torch.kron(a, b, out=o)


def _unbind_into(a, o1, o2):
    torch.unbind_copy(a, out=[o1, o2])
    return o1, o2


@pytest.mark.parametrize("cache", CACHES)
def test_out_calls_writing_through_a_view_of_out_or_a_list_run(cache):
    # (The check of an out= call's write sees those written through a view of the out
    # tensor, kron's, or into a list of them, unbind_copy's.)
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    assert_same(dtcompile.jit(_kron_into, cache=cache)(a, b, torch.empty(6, 6)), _kron_into(a, b, torch.empty(6, 6)))
    outs = lambda: (torch.empty(3), torch.empty(3))  # noqa: E731
    assert_same(dtcompile.jit(_unbind_into, cache=cache)(a, *outs()), _unbind_into(a, *outs()))
