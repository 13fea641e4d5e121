"""The conjugate and negative bits (``x.conj()`` of a complex tensor, its ``.imag``) are
metadata like strides: a traced tensor has them where eager's has them, ops dispatch on
them, the guards check them, and fusions never read through them."""

import pytest
import torch
from support import assert_same_result

import dtcompile

FUNCTIONS = {
    "imag": lambda x: x.imag * 2,
    "real": lambda x: x.real + 1,
    "view_as_real": lambda x: torch.view_as_real(x.resolve_conj()),
    # ``resolve_conj`` records a clone that clears the bit: not a copy to remove
    "view_as_real_used": lambda x: torch.view_as_real(x.resolve_conj()) + 0,
    "resolve_neg_used": lambda x: torch.view_as_real(x.conj().imag.resolve_neg().to(x.dtype)) + 0,
    "asks_is_conj": lambda x: x * int(x.is_conj()) + 1,
    "conj_again": lambda x: x.conj(),
    "returned_view": lambda x: x[1:],
    "conj_imag": lambda x: x.conj().imag * 3,
    "asks_conj_is_conj": lambda x: x * int(x.conj().is_conj()),
    "neg_view": lambda x: torch.ops.aten._neg_view(x.real) * 1,
    "asks_is_neg": lambda x: x * int(x.conj().imag.is_neg()),
    "matmul": lambda x: x.unsqueeze(0) @ x.conj().unsqueeze(1),
}


def _complex(n=5):
    return torch.randn(n, dtype=torch.complex64, generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("executors", [None, ["nvfuser:reference"]])
def test_conjugate_inputs_and_views_are_eager(name, executors):
    fn = FUNCTIONS[name]
    jitted = dtcompile.jit(fn, executors=executors)
    # Each call with the bits the last call had not: the guards must tell them apart.
    for x in (_complex(), _complex().conj(), _complex(), _complex().conj()):
        assert_same_result(jitted(x), fn(x), name)


def test_neg_bit_input_is_guarded():
    def fn(x):
        return x * 2 + int(x.is_neg())

    jitted = dtcompile.jit(fn)
    plain = torch.randn(4)
    negated = torch.ops.aten._neg_view(torch.randn(4))
    for x in (plain, negated, plain, negated):
        assert_same_result(jitted(x), fn(x))


def test_module_buffer_and_closed_over_tensor_bits():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", _complex(3).conj())

        def forward(self, x):
            return x + self.b.imag * int(self.b.is_conj())

    module = Holder()
    jitted = dtcompile.jit(module)
    x = torch.randn(3)
    assert_same_result(jitted(x), module(x))
    module.b = module.b.resolve_conj()  # same metadata but for the bit
    assert_same_result(jitted(x), module(x))

    held = _complex(3).conj()
    jitted_closure = dtcompile.jit(lambda x: x + held.imag)
    assert_same_result(jitted_closure(x), x + held.imag)


def test_printed_types_show_the_bits():
    jitted = dtcompile.jit(lambda x: x.imag * 2)
    jitted(_complex().conj())
    text = str(dtcompile.last_traces(jitted)[0])
    assert "c64[5] conj" in text and "neg" in text


@pytest.mark.parametrize("view", [torch.conj, torch._neg_view])
def test_writing_through_a_conjugate_or_negative_view_is_refused(view):
    def fn(x):
        view(x).add_(1)
        return x

    with pytest.raises(dtcompile.TracingError, match="through a conjugate or negative view"):
        dtcompile.jit(fn)(torch.tensor([1 + 2j]))
