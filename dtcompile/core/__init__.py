"""The IR: proxies, provenance, symbols, traces. Imports nothing above it."""

from .errors import DataCheckFailed, TracingError, data_dependent_error
from .provenance import FromData, InputPath, NoProvenance, Provenance, Step
from .proxy import FutureProxy, NumberProxy, TensorProxy, is_proxy
from .symbol import BoundSymbol, Note, Symbol, aten_symbol, renamed
from .trace import Trace, TraceError, verify

__all__ = [
    "BoundSymbol",
    "FutureProxy",
    "InputPath",
    "NoProvenance",
    "FromData",
    "Note",
    "Provenance",
    "Step",
    "Symbol",
    "NumberProxy",
    "TensorProxy",
    "is_proxy",
    "Trace",
    "TraceError",
    "TracingError",
    "DataCheckFailed",
    "data_dependent_error",
    "aten_symbol",
    "renamed",
    "verify",
]
