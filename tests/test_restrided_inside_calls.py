"""A tensor torch's own code makes inside a call and restrides in place (``quantile``'s
``unsqueeze_``, ``stft``'s ``transpose_``): the compiled call gives eager's results and
strides (``capture/restrided.py``) and gradients, under both cache options, at every length;
the same in the user's code is still refused clearly."""

import warnings

import pytest
import torch

import dtcompile

CACHES = ["constant values", "symbolic values"]
# torch 2.10's quantile checks its q with ``equal`` (a value read from data): refused there.
QUANTILE_REFUSED = torch.__version__ < "2.11"
Q = torch.tensor([0.1, 0.5, 0.9])


def _hann_stft(x):
    return torch.stft(x, 8, hop_length=2, window=torch.hann_window(8), return_complex=True)


CASES = {
    "quantile of a dim": (lambda x: torch.quantile(x, 0.3, dim=1), [(5, 6), (7, 6), (9, 8)]),
    "quantile of q values, keepdim": (lambda x: torch.quantile(x, Q, dim=0, keepdim=True), [(5, 6), (8, 3)]),
    "quantile of all, midpoint": (lambda x: torch.quantile(x, 0.7, interpolation="midpoint"), [(5, 6), (4, 4)]),
    "nanquantile": (lambda x: torch.nanquantile(x.masked_fill(x > 1, float("nan")), 0.5, dim=-1), [(5, 6), (3, 9)]),
    "stft": (_hann_stft, [(40,), (2, 50)]),
    "stft then ops": (lambda x: _hann_stft(x).abs().sum(-1) * 2, [(40,), (64,)]),
    "istft of stft": (
        lambda x: torch.istft(_hann_stft(x), 8, hop_length=2, window=torch.hann_window(8)),
        [(40,), (64,)],
    ),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("case", list(CASES))
def test_torchs_code_restriding_its_own_tensor_runs_as_eager(case, cache):
    fn, shapes = CASES[case]
    jitted = dtcompile.jit(fn, cache=cache)
    torch.manual_seed(0)
    if QUANTILE_REFUSED and "quantile" in case:
        with pytest.raises(dtcompile.TracingError, match="quantile"):
            jitted(torch.randn(shapes[0]))
        return
    for shape in shapes:
        x = torch.randn(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected, got = fn(x), jitted(x)
        assert torch.equal(got, expected), case
        assert got.stride() == expected.stride(), case
    if cache == "symbolic values" and case != "stft":  # (stft's inputs: a 1-D one, then a 2-D one)
        assert dtcompile.cache_misses(jitted) == 1


def test_the_program_shows_the_restrided_tensor_as_a_view():
    jitted = dtcompile.jit(_hann_stft)
    x = torch.randn(40)
    assert torch.equal(jitted(x), _hann_stft(x))
    text = str(dtcompile.last_traces(jitted)[0])
    assert "aten.transpose.int(" in text and "transpose_" not in text


@pytest.mark.parametrize("cache", CACHES)
def test_the_users_own_tensor_restrided_in_place_is_still_refused(cache):
    def fn(x):
        y = x + 1
        y.unsqueeze_(0)
        return y * 2

    with pytest.raises(dtcompile.TracingError, match="changes the sizes or strides"):
        dtcompile.jit(fn, cache=cache)(torch.randn(3, 4))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "case", ["quantile of a dim", "quantile of q values, keepdim", "stft then ops", "istft of stft"]
)
def test_gradients_as_eager(case, cache):
    fn, shapes = CASES[case]
    jitted = dtcompile.jit(fn, cache=cache)
    for shape in shapes:
        x = torch.randn(shape)
        if QUANTILE_REFUSED and "quantile" in case:
            with pytest.raises(dtcompile.TracingError, match="quantile"):
                jitted(x.requires_grad_())
            return
        expected_x, x = x.clone().requires_grad_(), x.requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected, got = fn(expected_x), jitted(x)
        cotangent = torch.randn(expected.shape)
        expected.backward(cotangent)
        got.backward(cotangent)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(x.grad, expected_x.grad)
        assert x.grad.stride() == expected_x.grad.stride()
