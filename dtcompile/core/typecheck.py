"""Checking a trace's types: each recorded op, run again on its inputs' FakeTensors, must
give the dtypes, shapes and strides the trace says its outputs have.

A pass that rewires symbols (swaps an input, drops a view, fuses a linear) can leave a
trace whose names are all defined but whose values are not what their proxies claim; the
printed program would then lie about shapes and strides. ``verify`` checks names at every
pass; with ``DTCOMPILE_VERIFY_TYPES=1`` (the tests set it; off at run time, it costs a
fake op per symbol) :func:`check_types` runs too. Symbols without an op (prims, executor
symbols) and in-place ops (running them would change the fakes the trace holds) are not
re-run, nor random ops and ops whose output shape comes from data; nor an op with a
traced number among its arguments (its value is an expression of the trace, not a SymInt
here) or a number read from data (run again, it would make new unbacked sizes).
"""

from __future__ import annotations

import os

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_flatten, tree_map

from .eager_paths import eager_paths
from .printing import NamedConstant
from .proxy import NumberProxy, TensorProxy
from .symbolic import is_symbolic, known_shape_equal
from .view_strides import with_eager_strides

VERIFY_TYPES_ENV = "DTCOMPILE_VERIFY_TYPES"
# Random ops (a generator given to them must not move) and ops whose output shape comes
# from data (run again, they would make new unbacked sizes, u1 for u0).
_SKIPPED_TAGS = {torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}


def types_checked() -> bool:
    return os.environ.get(VERIFY_TYPES_ENV) == "1"


class TraceTypeError(AssertionError):
    """A symbol's recorded output types are not what its op gives."""


def _fresh_sizes(got, recorded: TensorProxy) -> bool:
    """Whether running the op again made new sizes read from data, not in the recorded output."""
    made = free_unbacked_symbols(tuple(got.shape))
    return bool(made) and not made <= free_unbacked_symbols(tuple(recorded.shape))


def _mismatch(got, recorded: TensorProxy) -> str | None:
    if got.dtype != recorded.dtype:
        return f"dtype {got.dtype}, recorded {recorded.dtype}"
    if not known_shape_equal(tuple(got.shape), tuple(recorded.shape)):
        return f"shape {tuple(got.shape)}, recorded {tuple(recorded.shape)}"
    if not known_shape_equal(tuple(got.stride()), tuple(recorded.stride())):
        return f"strides {tuple(got.stride())}, recorded {tuple(recorded.stride())}"
    return None


def _fake_argument(x):
    if isinstance(x, TensorProxy):
        return x.fake
    return x.value if isinstance(x, NamedConstant) else x


def check_types(trace) -> None:
    """Raise :class:`TraceTypeError` at the first symbol whose op, run on FakeTensors, gives
    other output dtypes, shapes or strides than the trace records."""
    for index, bsym in enumerate(trace.bound_symbols):
        op = bsym.op
        if op is None or op._schema.is_mutable or _SKIPPED_TAGS.intersection(op.tags):
            continue
        leaves, _ = tree_flatten((bsym.args, bsym.kwargs))
        if any(isinstance(x, NumberProxy) or (is_symbolic(x) and free_unbacked_symbols(x)) for x in leaves):
            continue
        tensors = [x for x in leaves if isinstance(x, TensorProxy)]
        recorded = bsym.output_tensors()
        source = tensors or recorded
        if not source:
            continue
        fake_mode = source[0].fake.fake_mode
        args, kwargs = tree_map(_fake_argument, (bsym.args, bsym.kwargs))
        # As recorded (composite ops decompose); no autograd: the user's saved tensors hooks
        # would be called with fake tensors.
        with fake_mode, enable_python_dispatcher(), eager_paths(), torch.no_grad():
            out = op(*args, **kwargs)
        out = with_eager_strides(fake_mode, op, args, out)
        got = [x for x in tree_flatten(out)[0] if hasattr(x, "dtype") and hasattr(x, "stride")]
        if len(got) != len(recorded):
            raise TraceTypeError(
                f"{trace.fn_name}: symbol {index} ({bsym.symbol.name}) gives {len(got)} tensors, recorded {len(recorded)}"
            )
        for g, r in zip(got, recorded):
            if _fresh_sizes(g, r):
                continue  # (torch 2.10 gives a slice of a size read from data a new one: u2 for min(2, u0))
            problem = _mismatch(g, r)
            if problem is not None:
                raise TraceTypeError(
                    f"{trace.fn_name}: symbol {index} ({bsym.symbol.name}) output {r.label}: {problem}"
                )
