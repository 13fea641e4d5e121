"""Helpers shared by the single-process tests."""

import torch

from dtcompile.capture import capture_call


def assert_same_tensor(got, expected):
    assert type(got) is type(expected)
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert got.stride() == expected.stride()
    torch.testing.assert_close(got, expected)


def assert_same_result(got, expected):
    """Same containers (types and keys), same constants, same tensors."""
    assert type(got) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert_same_tensor(got, expected)
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert_same_result(g, e)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            assert_same_result(got[key], expected[key])
    else:
        assert got == expected


def traced(fn, *args, **kwargs):
    """The trace of ``fn(*args, **kwargs)`` as recorded, before any pass."""
    return capture_call(fn, args, kwargs).trace


def op_names(trace) -> list[str]:
    return [b.symbol.name for b in trace.bound_symbols]
