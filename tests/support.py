"""Helpers shared by the single-process tests."""

from dtcompile.capture import capture_call
from dtcompile.testing.compare import assert_same

# One comparison with eager for every test (dtcompile.testing.compare).
assert_same_tensor = assert_same_result = assert_same


def traced(fn, *args, **kwargs):
    """The trace of ``fn(*args, **kwargs)`` as recorded, before any pass."""
    return capture_call(fn, args, kwargs).trace


def op_names(trace) -> list[str]:
    return [b.symbol.name for b in trace.bound_symbols]
