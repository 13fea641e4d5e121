"""The IR: proxies, provenance, symbols, traces. Imports nothing above it."""

from .provenance import InputPath, NoProvenance, Provenance, Step
from .proxy import NumberProxy, TensorProxy, is_proxy
from .symbol import BoundSymbol, Note, Symbol, aten_symbol, renamed
from .trace import Trace, TraceError, verify

__all__ = [
    "BoundSymbol",
    "InputPath",
    "NoProvenance",
    "Note",
    "Provenance",
    "Step",
    "Symbol",
    "NumberProxy",
    "TensorProxy",
    "is_proxy",
    "Trace",
    "TraceError",
    "aten_symbol",
    "renamed",
    "verify",
]
