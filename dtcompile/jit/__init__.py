"""The public entry: jit, the cache, prologues and epilogues."""

from .api import (
    JittedFunction,
    cache_hits,
    cache_misses,
    collectives,
    compile_seconds,
    jit,
    last_epilogue,
    last_prologue,
    last_traces,
    timed_call,
)
from .check import EagerMismatchError
from .consistency import RankFailedError, RankMismatchError

__all__ = [
    "EagerMismatchError",
    "JittedFunction",
    "RankFailedError",
    "RankMismatchError",
    "cache_hits",
    "cache_misses",
    "collectives",
    "compile_seconds",
    "jit",
    "last_epilogue",
    "last_prologue",
    "last_traces",
    "timed_call",
]
