"""dtcompile: DTensor programs compiled into per-rank programs.

``dtcompile.jit(model)`` traces a call once below DTensor (DTensor's own sharding
propagation decides placements and collectives), then runs the recorded per-rank program
of local ops and collectives, with no DTensor dispatch left at run time.
"""

from .capture import TracingError, UnsupportedInputError
from .jit import (
    EagerMismatchError,
    RankFailedError,
    RankMismatchError,
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

__version__ = "0.1.0"

__all__ = [
    "EagerMismatchError",
    "RankFailedError",
    "RankMismatchError",
    "TracingError",
    "UnsupportedInputError",
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
