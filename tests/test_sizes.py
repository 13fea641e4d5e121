"""Single process: sizes under symbolic values: prims.shape, materialization, first-producer
DCE, on small traces; and printed traces that compute their sizes."""

import dataclasses
import re

import pytest
import torch
from support import assert_same_result, assert_same_tensor
from torch.utils._pytree import tree_flatten

import dtcompile
from dtcompile.capture import capture_call
from dtcompile.core import NumberProxy, TensorProxy, verify
from dtcompile.core.prims import ShapeQuery, SizeExpression
from dtcompile.core.symbolic import SYMBOLIC_TYPES, is_symbolic, symbolic_expr
from dtcompile.executors import lower, resolve_executors
from dtcompile.transforms import (
    combine_all_reduces,
    cse,
    dce,
    has_symbolic_sizes,
    materialize_sizes,
    remove_identity_views,
)

SYMBOLIC = "symbolic values"


@pytest.fixture(autouse=True)
def no_grad():
    # Inference; the training tests turn grad mode on themselves.
    with torch.no_grad():
        yield


def _captured(fn, *args):
    """The call captured with symbolic sizes: (recorded trace, its ShapeEnv)."""
    captured = capture_call(fn, args, {}, symbolic=True)
    return captured.trace, captured.shape_env


def _size_producers(trace) -> list:
    return [b for b in trace.bound_symbols if isinstance(b.output, NumberProxy)]


def _shape_queries(trace) -> list[tuple[str, int]]:
    return [(b.args[0].label, b.args[1]) for b in trace.bound_symbols if isinstance(b.symbol, ShapeQuery)]


def _assert_numbers_replace_sizes(recorded, materialized):
    """Each SymInt among the recorded symbols' arguments (and in the output) is, in the
    materialized trace, a NumberProxy of the same expression, made by a size symbol of the
    trace that precedes its use; constants stay constants; nothing else changes."""
    verify(materialized)
    assert has_symbolic_sizes(recorded) and not has_symbolic_sizes(materialized)
    defined_at = {}
    ops = []
    for index, bsym in enumerate(materialized.bound_symbols):
        if isinstance(bsym.output, NumberProxy):
            assert isinstance(bsym.symbol, (ShapeQuery, SizeExpression)), bsym.symbol
            assert bsym.op is None
            defined_at[bsym.output.label] = index
        else:
            ops.append((index, bsym))
    assert [b.op for _, b in ops] == [b.op for b in recorded.bound_symbols]

    def check(old_leaves, new_leaves, use_index):
        assert len(old_leaves) == len(new_leaves)
        for old, new in zip(old_leaves, new_leaves):
            if is_symbolic(old):
                assert isinstance(new, NumberProxy), (old, new)
                assert new.expr == symbolic_expr(old)
                assert defined_at[new.label] < use_index
            elif isinstance(old, SYMBOLIC_TYPES):  # a SymInt whose value is a known constant
                assert type(new) in (int, float, bool) and new == old
            elif isinstance(old, TensorProxy):
                assert new is old
            else:
                assert new == old

    for (index, new), old in zip(ops, recorded.bound_symbols):
        check(tree_flatten((old.args, old.kwargs))[0], tree_flatten((new.args, new.kwargs))[0], index)
        assert new.output is old.output
    check(tree_flatten(recorded.output)[0], tree_flatten(materialized.output)[0], len(materialized.bound_symbols))


def _leaves(value) -> list:
    """Tensors and numbers of a (nested) result, in order: what a computation returns flat."""
    if isinstance(value, (tuple, list)):  # torch.Size too
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _assert_trace_computes(trace, fn, *args):
    """The trace, compiled from its own source, returns ``fn``'s result (flat) for ``args``."""
    assert_same_result(_leaves(trace.compile()(*args)), _leaves(fn(*args)))


def _input(trace, label: str) -> TensorProxy:
    (proxy,) = [p for p in trace.inputs if p.label == label]
    return proxy


def _reads(trace, label: str) -> list:
    """The symbols that read the value called ``label``."""
    return [b for b in trace.bound_symbols if any(p.label == label for p in b.input_proxies())]


# ---------------------------------------------------------------------------------------
# prims.shape and materialize_sizes, on small traces


def _views_factories_and_splits(x, y):
    a = x.view(x.shape[0], -1).reshape(x.shape[1], x.shape[0], -1)
    b = y.new_zeros(x.shape[2] * 2, y.shape[1]) + torch.arange(y.shape[1], dtype=y.dtype)
    first, second = torch.split(y, [y.shape[0] - 2, 2])
    return a.sum(0), b, first * 2, second, x.expand(2, *x.shape)


def test_every_symbolic_size_becomes_a_number_made_before_its_use():
    x, y = torch.randn(3, 4, 5), torch.randn(6, 7)
    recorded, _ = _captured(_views_factories_and_splits, x, y)
    materialized = materialize_sizes(recorded)
    _assert_numbers_replace_sizes(recorded, materialized)
    assert "with its sizes computed in the trace" in materialized.title
    # The sizes come from the trace's inputs: x and y hold every symbol used here.
    assert {label for label, _ in _shape_queries(materialized)} == {"x", "y"}
    # ``2*s`` is computed from the number read for ``s``.
    doubled = [b for b in materialized.bound_symbols if isinstance(b.symbol, SizeExpression)]
    assert doubled and all(isinstance(b.args[0], NumberProxy) for b in doubled)
    for trace in (materialized, dce(cse(materialized))):
        verify(trace)
        assert not has_symbolic_sizes(trace)
        program = trace.compile()
        for sizes in ((4, 6, 2, 5, 3), (5, 2, 9, 4, 8)):  # other sizes than traced
            x, y = torch.randn(*sizes[:3]), torch.randn(*sizes[3:])
            assert_same_result(_leaves(program(x, y)), _leaves(_views_factories_and_splits(x, y)))


def test_shape_symbols_print_and_run():
    recorded, _ = _captured(lambda x: x.view(x.shape[1], -1), torch.randn(3, 4))
    materialized = materialize_sizes(recorded)
    ((label, dim),) = _shape_queries(materialized)
    (query,) = _size_producers(materialized)
    assert (label, dim) == ("x", 1)
    assert f"{query.output.label} = prims.shape(x, 1)" in str(materialized)
    assert "from dtcompile.core import prims" in str(materialized)
    assert query.symbol.pure  # passes may drop or merge it
    execution = lower(materialized, resolve_executors(None))
    assert f"{query.output.label} = x.shape[1]" in str(execution)
    x = torch.randn(5, 6)
    assert_same_tensor(execution.compile()(x)[0], x.view(6, -1))


def _two_holders(x, y):
    return x.view(x.shape[1], -1), y.reshape(y.shape[0], -1), x.shape[1] + y.shape[0]


def test_the_first_producer_of_a_size_is_kept_and_its_uses_renamed():
    # Duck sizing: x.shape[1] and y.shape[0] are both 4, so one symbol.
    x, y = torch.randn(3, 4), torch.randn(4, 5)
    recorded, _ = _captured(_two_holders, x, y)
    materialized = materialize_sizes(recorded)
    _assert_numbers_replace_sizes(recorded, materialized)
    queries = [b for b in materialized.bound_symbols if isinstance(b.symbol, ShapeQuery)]
    assert len(queries) == 3 and len({b.output.expr for b in queries}) == 1  # one per use
    # Make the second read come from the other holder, y.shape[0]: same value, another tensor.
    second = queries[1]
    swapped = [
        dataclasses.replace(b, args=(_input(recorded, "y"), 0)) if b is second else b
        for b in materialized.bound_symbols
    ]
    materialized = materialized.derive(materialized.title, swapped)
    assert _shape_queries(materialized) == [("x", 1), ("y", 0), ("x", 1)]

    # CSE merges the identical queries only; DCE keeps the first producer of the value.
    merged = cse(materialized)
    assert _shape_queries(merged) == [("x", 1), ("y", 0)]
    for trace in (dce(materialized), dce(merged)):
        verify(trace)
        assert _shape_queries(trace) == [("x", 1)]
        (first,) = _size_producers(trace)[:1]
        assert first.output.label == queries[0].output.label
        views = [b for b in trace.bound_symbols if b.op is not None]
        assert [b.args[1][0].label for b in views] == [first.output.label] * 2
        # x.shape[1] + y.shape[0]: 2*n, from the first producer too.
        (total,) = [b for b in _reads(trace, first.output.label) if isinstance(b.symbol, SizeExpression)]
        assert total.args == (first.output,) and trace.output[-1] is total.output
        _assert_trace_computes(trace, _two_holders, torch.randn(5, 6), torch.randn(6, 2))


def test_the_same_size_queried_twice_is_read_once():
    def fn(x):
        return x.view(x.shape[0], -1) + 1, x.reshape(x.shape[0], x.shape[1], -1), x.shape[0]

    recorded, _ = _captured(fn, torch.randn(3, 4, 5))
    materialized = materialize_sizes(recorded)
    _assert_numbers_replace_sizes(recorded, materialized)
    assert _shape_queries(materialized).count(("x", 0)) == 3
    trace = dce(materialized)
    verify(trace)
    assert _shape_queries(trace) == [("x", 0), ("x", 1)]
    first = _size_producers(trace)[0].output
    assert trace.output[-1] is first
    _assert_trace_computes(trace, fn, torch.randn(6, 2, 3))


def test_a_size_computed_two_ways_keeps_the_first_way():
    def fn(x):
        flat = x.reshape(x.shape[0] * x.shape[1], -1)
        return flat.view(flat.shape[0], 1, -1)

    recorded, _ = _captured(fn, torch.randn(3, 4, 5))
    materialized = materialize_sizes(recorded)
    _assert_numbers_replace_sizes(recorded, materialized)
    # s0*s1 is computed for the reshape, then read from the reshape's result for the view.
    (product,) = [b for b in _size_producers(materialized) if isinstance(b.symbol, SizeExpression)]
    same_value = [b for b in _size_producers(materialized) if b.output.expr == product.output.expr]
    flat = recorded.bound_symbols[0].output
    assert same_value == [product, same_value[1]] and same_value[1].args == (flat, 0)
    trace = dce(materialized)
    verify(trace)
    assert [b for b in _size_producers(trace) if b.output.expr == product.output.expr] == [product]
    assert [b.args[1][0] for b in trace.bound_symbols if b.op is not None] == [product.output] * 2
    _assert_trace_computes(trace, fn, torch.randn(2, 7, 3))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.shape[0] * 2,
        lambda x: (x + 1, x.new_zeros(x.shape[0] * 2)),
        lambda x: (x.shape, x.shape[1] // 2, x.numel()),
    ],
    ids=["returned-size", "last-op-size", "returned-shape"],
)
def test_sizes_needed_only_at_the_end_are_materialized(fn):
    recorded, _ = _captured(fn, torch.randn(3, 5))
    materialized = materialize_sizes(recorded)
    _assert_numbers_replace_sizes(recorded, materialized)
    trace = dce(materialized)
    verify(trace)
    assert not has_symbolic_sizes(trace) and _size_producers(trace)
    for shape in ((4, 7), (9, 2)):
        _assert_trace_computes(trace, fn, torch.randn(*shape))


def test_a_size_only_a_meta_function_computes_is_materialized():
    def doubled(x):
        both = torch.cat([x, x])
        return both.view(-1).reshape(both.shape[0], -1)

    def halves(x):  # odd sizes: ceil(n / 2) and n - ceil(n / 2), known from chunk's meta function
        first, second = x.chunk(2, dim=1)
        return first.shape[1], second.shape[1], x.new_ones(second.shape[1] * 3)

    for fn, shape, others in ((doubled, (3, 4), [(5, 2), (6, 7)]), (halves, (2, 5), [(3, 7), (4, 9)])):
        recorded, _ = _captured(fn, torch.randn(*shape))
        materialized = materialize_sizes(recorded)
        _assert_numbers_replace_sizes(recorded, materialized)
        trace = dce(materialized)
        verify(trace)
        assert not has_symbolic_sizes(trace)
        for other in others:
            _assert_trace_computes(trace, fn, torch.randn(*other))


def test_passes_and_printing_add_no_guard():
    def fn(x, y):
        a = x.view(x.shape).reshape(x.shape[0], -1) + y  # identity views, asked about without guarding
        b = a.transpose(0, 1).contiguous().t()  # strides printed beside the values
        return b * 2, a.view(x.shape[0], x.shape[1]), torch.ones_like(x.t()), x.shape

    recorded, shape_env = _captured(fn, torch.randn(3, 4), torch.randn(3, 4))
    guards = list(shape_env.guards)
    traces = [recorded]
    for transform in (materialize_sizes, remove_identity_views, cse, combine_all_reduces, dce):
        traces.append(transform(traces[-1]))
    traces.append(lower(traces[-1], resolve_executors(None)))
    for trace in traces:
        verify(trace)
        assert str(trace)
    assert list(shape_env.guards) == guards


# ---------------------------------------------------------------------------------------
# Printed traces


def _code(trace) -> str:
    """The trace's Python without comments."""
    return "\n".join(line.split("#", 1)[0] for line in str(trace).splitlines())


def test_printed_traces_compute_sizes_from_tensors():
    def fn(x, y):
        return x.view(x.shape[1], -1) + y.new_zeros(x.shape[1] * 2, 1)[: x.shape[1]], x.shape[0] * x.shape[1]

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    x, y = torch.randn(3, 4), torch.randn(2, 3)
    assert_same_result(jitted(x, y), fn(x, y))
    traces = dtcompile.last_traces(jitted)
    recorded, materialized, execution = traces[0], traces[1], traces[-1]
    assert recorded.title == "computation, as recorded below DTensor"
    assert materialized.title == "computation, with its sizes computed in the trace"
    assert re.search(r"\bs\d+\b", _code(recorded))  # the recorded trace shows the symbols it was given
    assert re.search(r"n\d+ = prims\.shape\(x, 1\)", str(materialized))
    for trace in traces:
        verify(trace)
        assert str(trace)
    for trace in traces[1:]:
        assert not has_symbolic_sizes(trace)
        assert not re.search(r"\bs\d+\b", _code(trace)), str(trace)  # no SymInt literal in the code
    code = _code(execution)
    assert re.search(r"n\d+ = x\.shape\[1\]", code) and re.search(r"n\d+ = x\.shape\[0\]", code)
    assert re.search(r"n\d+ = 2\*n\d+", code) and "prims" not in code
    assert len(re.findall(r"= x\.shape\[1\]", code)) == 1  # read once, however often used
    # The printed execution trace runs, at other sizes too.
    program = execution.compile()
    x, y = torch.randn(5, 6), torch.randn(2, 3)
    assert_same_result(program(x, y), fn(x, y))  # a tuple, like the computation's flat result
