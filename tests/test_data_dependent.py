"""Values read from tensor data (issue 14): numbers read with ``.item()`` / ``.tolist()``
and ops whose sizes come from the data are computed by the program at run time, one
compilation for every value, under both cache options; forward and with gradients,
against eager (values, shapes and strides)."""

from __future__ import annotations

import pytest
import torch

import dtcompile
from dtcompile.testing.compare import assert_same

CACHES = ["constant values", "symbolic values"]


def _split_in_two(generator):
    first = int(torch.randint(0, 7, (), generator=generator))
    return torch.tensor([first, 6 - first])


# name -> (function, arguments from a generator); each call draws new data.
CASES = {
    "narrow at a tensor start": (
        lambda x, s: x.narrow(0, s, 2),
        lambda g: (torch.randn(6, 3, generator=g), torch.randint(0, 5, (), generator=g)),
    ),
    "narrow at an item": (
        lambda x, s: x.narrow(0, s.item(), 2) * 2,
        lambda g: (torch.randn(6, 3, generator=g), torch.randint(0, 5, (), generator=g)),
    ),
    "tensor_split at tensor indices": (
        lambda x, i: torch.tensor_split(x, i),
        lambda g: (torch.randn(7, 2, generator=g), torch.randint(0, 7, (2,), generator=g).sort().values),
    ),
    "split by tolist": (
        lambda x, c: [p * (i + 2) for i, p in enumerate(x.split(c.tolist()))],
        lambda g: (torch.randn(6, 2, generator=g), _split_in_two(g)),
    ),
    "boolean mask": (lambda x: x[x > 0] * 2, lambda g: (torch.randn(5, 3, generator=g),)),
    "masked_select": (lambda x: torch.masked_select(x, x > 0).sum(0), lambda g: (torch.randn(5, 3, generator=g),)),
    "nonzero": (lambda x: torch.nonzero(x > 0) + 1, lambda g: (torch.randn(5, 3, generator=g),)),
    "repeat_interleave by a tensor": (
        lambda x, r: torch.repeat_interleave(x, r, dim=0),
        lambda g: (torch.randn(3, 2, generator=g), torch.randint(0, 3, (3,), generator=g)),
    ),
    "scaled by an item": (lambda x: x * x.abs().max().item(), lambda g: (torch.randn(4, generator=g),)),
    "sized by an item": (
        lambda x, c: torch.zeros(c.sum().item(), 2) + x.sum(),
        lambda g: (torch.randn(4, generator=g), torch.randint(0, 3, (3,), generator=g)),
    ),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", list(CASES))
def test_values_read_from_data_compile_once(name, cache):
    fn, make = CASES[name]
    jitted = dtcompile.jit(fn, cache=cache)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        args = make(generator)
        assert_same(jitted(*args), fn(*args), name)
    assert dtcompile.cache_misses(jitted) == 1


# name -> (function of a differentiable x and data c, arguments from a generator)
GRADIENT_CASES = {
    "split by tolist": (
        lambda x, c: [p * (i + 2) for i, p in enumerate(x.split(c.tolist()))],
        lambda g: (torch.randn(6, 2, generator=g), _split_in_two(g)),
    ),
    "scaled by an item": (
        lambda x, c: x * x.detach().abs().max().item(),
        lambda g: (torch.randn(4, generator=g), None),
    ),
    "boolean mask": (lambda x, c: x[x.detach() > 0] * 3, lambda g: (torch.randn(5, 3, generator=g), None)),
    "repeat_interleave by a tensor": (
        lambda x, c: torch.repeat_interleave(x, c, dim=0),
        lambda g: (torch.randn(3, 2, generator=g), torch.randint(0, 3, (3,), generator=g)),
    ),
}


def _backward(out) -> None:
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    torch.autograd.backward(outs, [torch.full_like(o, 0.5) for o in outs])


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_values_read_from_data_with_gradients(name, cache):
    """The backward reads the numbers the forward read (saved as numbers) or sizes its
    saved tensors hold."""
    fn, make = GRADIENT_CASES[name]
    jitted = dtcompile.jit(fn, cache=cache)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, c = make(generator)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = fn(xe, c), jitted(xc, c)
        assert_same(got, expected, name)
        _backward(expected)
        _backward(got)
        assert_same(xc.grad, xe.grad, f"{name}, gradient")
    assert dtcompile.cache_misses(jitted) == 1


def test_a_number_read_from_data_prints_as_such():
    jitted = dtcompile.jit(lambda x, c: x.split(c.tolist()))
    jitted(torch.randn(6, 2), torch.tensor([2, 4]))
    computation, execution = dtcompile.last_traces(jitted)[0], str(dtcompile.last_traces(jitted)[-1])
    numbers = [b.output for b in computation.bound_symbols if isinstance(b.output, dtcompile.core.NumberProxy)]
    assert [str(n.provenance) for n in numbers] == [
        "read from tensor data (by aten._local_scalar_dense.default; no value while tracing)"
    ] * 2
    assert execution.count("read from data at run time") == 2
    assert f".split_with_sizes([{numbers[0].label}, {numbers[1].label}])" in execution
