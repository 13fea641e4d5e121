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


def forget_dtensor_caches():
    """DTensor caches sharding propagation and redistribution plans by DTensorSpec, and
    specs compare meshes by layout, not by process group: a mesh of a later fake world
    would get the process groups of an earlier one's (destroyed) equal mesh."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor import debug as dtensor_debug

    # Private helpers, so each is looked up: releases differ in which caches they have.
    for owner, name in (
        (dtensor_debug, "_clear_sharding_prop_cache"),  # Python's and the C++ fast path's
        (_redistribute, "clear_redistribute_planner_cache"),
    ):
        getattr(owner, name, lambda: None)()
    getattr(_redistribute._gen_transform_infos, "cache_clear", lambda: None)()
