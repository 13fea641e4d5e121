"""A NaN's sign is part of the value guarded and baked in; torch's newer float32
precision API (``torch.backends.fp32_precision``) does not break compiling.

- ``inf - inf`` is a NaN with its sign bit set, which ``copysign`` and ``signbit`` read:
  guarded by ``repr`` (``nan`` for both) and printed as ``float('nan')``, a call with it
  reused the entry of ``float("nan")`` and got the other sign.
- torch refuses to read its legacy ``allow_tf32`` flags once the newer API set a
  precision; dtcompile read them at every compile, so every call raised where eager runs."""

import math

import pytest
import torch
from torch import nn

import dtcompile

CACHES = ["constant values", "symbolic values"]
POSITIVE_NAN, NEGATIVE_NAN = float("nan"), -float("nan")
SIGNED = None  # read by ``_of_global``


def _of_argument(x, s):
    return torch.copysign(x, s)


def _of_global(x):
    return x * math.copysign(1.0, SIGNED)


def _in_a_tuple(x, pair):
    return torch.copysign(x, pair[1]) + pair[0]


def _signbit_of_full(x, s):
    return torch.signbit(torch.full_like(x, s))


class _Attribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = POSITIVE_NAN

    def forward(self, x):
        return torch.copysign(x, self.s)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("how", ["argument", "global", "tuple", "signbit", "attribute", "complex"])
def test_a_nans_sign_is_guarded_and_kept(how, cache):
    global SIGNED
    assert math.copysign(1.0, NEGATIVE_NAN) < 0 < math.copysign(1.0, POSITIVE_NAN)
    module = _Attribute()
    fns = {
        "argument": (_of_argument, lambda s: (s,)),
        "global": (_of_global, lambda s: ()),
        "tuple": (_in_a_tuple, lambda s: ((1.0, s),)),
        "signbit": (_signbit_of_full, lambda s: (s,)),
        "attribute": (module, lambda s: ()),
        "complex": (lambda x, c: torch.copysign(x, c.real), lambda s: (complex(s, 1.0),)),
    }
    fn, extra = fns[how]
    jitted = dtcompile.jit(fn, cache=cache)
    for rows in (3, 4):
        for s in (POSITIVE_NAN, NEGATIVE_NAN, POSITIVE_NAN, float("inf") - float("inf")):
            SIGNED = module.s = s
            x = torch.ones(rows)
            assert torch.equal(jitted(x, *extra(s)), fn(x, *extra(s)))


_PRECISIONS = ["", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv"]


def _backend(path):
    found = torch.backends
    for part in filter(None, path.split(".")):
        found = getattr(found, part)
    return found


@pytest.fixture
def precisions_put_back():
    before = {path: _backend(path).fp32_precision for path in _PRECISIONS}
    yield
    for path, value in before.items():
        _backend(path).fp32_precision = value
    torch._C._get_cublas_allow_tf32()  # (the legacy flags readable again)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "setting", [("", "tf32"), ("cuda.matmul", "tf32"), ("cudnn", "tf32"), ("mkldnn", "bf16"), ("mkldnn.matmul", "bf16")]
)
def test_the_newer_precision_api_set_by_the_caller(setting, cache, precisions_put_back):
    path, value = setting
    _backend(path).fp32_precision = value
    jitted = dtcompile.jit(lambda x: x @ x, cache=cache)
    x = torch.randn(3, 3)
    torch.testing.assert_close(jitted(x), x @ x, rtol=0, atol=0)
    assert _backend(path).fp32_precision == value  # the caller's setting left as it was
    # A precision changed between calls is guarded: the next call compiles again.
    _backend(path).fp32_precision = "ieee" if value != "ieee" else "tf32"
    torch.testing.assert_close(jitted(x), x @ x, rtol=0, atol=0)
    assert dtcompile.cache_misses(jitted) == 2


class _Signed(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.s = s

    def forward(self, x):
        return torch.copysign(self.lin(x).relu() + 1, self.s)


@pytest.mark.parametrize("cache", CACHES)
def test_repeated_layers_that_differ_in_a_nans_sign(cache):
    # Later layers equivalent to the first are replayed from its recording: the floats they
    # pass to ops are compared as the guards compare them, a NaN by its sign too.
    torch.manual_seed(0)
    model = nn.Sequential(*(_Signed(s) for s in (POSITIVE_NAN, NEGATIVE_NAN, POSITIVE_NAN, NEGATIVE_NAN)))
    jitted = dtcompile.jit(model, cache=cache)
    with torch.no_grad():
        for rows in (2, 3):
            x = torch.randn(rows, 4)
            assert torch.equal(jitted(x), model(x))
