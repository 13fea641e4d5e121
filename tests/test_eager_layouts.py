"""Fresh results that torch's fake tensors lay out otherwise than eager's CPU kernel: an
elementwise op whose reference composes other ops (``x // y``, ``copysign``, ``xlogy`` of
a transposed ``x``), ops whose kernel makes a row-major result (``logsigmoid``, ``isin``,
``rrelu``, a complex ``angle``) or one in the input's suggested memory format (``roll`` of
a channels-last tensor). The trace holds eager's layout, so code after the op sees eager's
strides: a ``.contiguous()`` is kept where eager's result is not contiguous (it was
dropped, and a non-contiguous tensor returned), a ``reshape`` that eager does as a view
stays one (it was recorded as ``view`` and raised), ``.stride()`` reads eager's."""

import pytest
import torch
import torch.nn.functional as F

import dtcompile
from dtcompile.testing.compare import assert_same

CACHES = ["constant values", "symbolic values"]

_OPS = {
    "x // y": lambda x, y: x // (y.abs() + 1),
    "div floor": lambda x, y: torch.div(x, y.abs() + 1, rounding_mode="floor"),
    "div trunc": lambda x, y: torch.div(x, y.abs() + 1, rounding_mode="trunc"),
    "copysign": torch.copysign,
    "xlogy": lambda x, y: torch.xlogy(x, y.abs() + 0.5),
    "special.xlog1py": lambda x, y: torch.special.xlog1py(x, y.abs()),
    "y // x": lambda x, y: y // (x.abs() + 1),
    "logsigmoid": lambda x, y: F.logsigmoid(x),
    "rrelu, eval": lambda x, y: F.rrelu(x, training=False),
    "isin": lambda x, y: torch.isin(x, y),
    "angle of complex": lambda x, y: torch.angle(torch.complex(x, y)),
    "angle of real": lambda x, y: torch.angle(x),
    "roll": lambda x, y: torch.roll(x, 1, -1),
}
_AFTER = {
    "returned": lambda r: r,
    "made contiguous": lambda r: r.contiguous(),
    "reshaped": lambda r: r.reshape(-1) * 1,
    "strides read": lambda r: (r * 1, r.stride(), r.is_contiguous()),
}
_LAYOUTS = {
    "x transposed": lambda n: (torch.randn(n, 4, 3).transpose(1, 2), torch.randn(n, 3, 4)),
    "y transposed": lambda n: (torch.randn(n, 3, 4), torch.randn(n, 4, 3).transpose(1, 2)),
    "channels last": lambda n: (
        torch.randn(n, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.randn(n, 3, 4, 5),
    ),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("after", list(_AFTER))
@pytest.mark.parametrize("op", list(_OPS))
def test_a_fresh_result_has_eagers_layout_inside_the_call(op, after, layout, cache):
    def fn(x, y):
        return _AFTER[after](_OPS[op](x, y))

    jitted = dtcompile.jit(fn, cache=cache)
    for n in (5, 2, 7):
        torch.manual_seed(n)
        x, y = _LAYOUTS[layout](n)
        assert_same(jitted(x, y), fn(x, y), f"{op}, {after}, n={n}")
