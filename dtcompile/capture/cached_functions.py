"""The user's functions behind ``functools.lru_cache`` (or ``cache``) that the traced code
can call. One called while tracing keeps what it returned then, the trace's own values (a
traced tensor, a size symbol), and would hand them to its next caller, eager or traced:
a cache that computed anything while tracing is emptied afterwards, so its function runs
again at its next call, as at a first one (what it held before is computed anew)."""

from __future__ import annotations

import functools

from .user_code import is_library


def user_caches(reads) -> list[tuple[functools._lru_cache_wrapper, int]]:
    """The cached user functions among the values the code can read (``Read``), each with
    its count of misses so far."""
    found = {}
    for read in reads:
        value = read.value
        if isinstance(value, functools._lru_cache_wrapper) and not is_library(getattr(value, "__wrapped__", value)):
            found[id(value)] = (value, value.cache_info().misses)
    return list(found.values())


def forget_traced_results(caches: list[tuple[functools._lru_cache_wrapper, int]]) -> None:
    """Empty each cache that computed a result while tracing (its misses went up)."""
    for cached, misses in caches:
        if cached.cache_info().misses != misses:
            cached.cache_clear()
