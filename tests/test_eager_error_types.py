"""A call that fails while tracing raises eager's exception type: torch's fake and meta
kernels raise a RuntimeError for some calls where eager's kernel raises a
NotImplementedError, so ``except NotImplementedError`` written against eager took another
path (``capture/eager_errors.py``)."""

import pytest
import torch
import torch.nn.functional as F

import dtcompile

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
