"""Single process, no process group: symbolic values (``cache="symbolic values"``).

Sizes computed in the trace (``materialize_sizes``, first-producer DCE) on small traces;
one compilation serving many sizes with eager's values and strides; the prologue's
symbolic guards (rank, 0/1 constants, duck sizing, divisibility, branches) and that
compiling adds none of its own; printed traces."""

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
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
# One compilation, many sizes, eager's values


def _causal_softmax(x):
    seq = x.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    return (x @ x.transpose(-1, -2)).masked_fill(~mask, float("-inf")).softmax(-1)


def _causal_triu(x):
    seq = x.shape[-2]
    future = torch.triu(torch.ones(seq, seq), diagonal=1).bool()
    return x.matmul(x.transpose(-2, -1)).masked_fill(future, -1e9)


def _attention(q, k, v):
    batch, seq, dim = q.shape
    scores = q @ k.transpose(-2, -1) / dim**0.5  # a SymFloat scale, not math.sqrt: that specializes dim
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (weights @ v).transpose(1, 2).reshape(batch, -1), batch * seq


def _heads(x):
    batch, seq, width = x.shape
    heads = x.view(batch, seq, 2, width // 2).transpose(1, 2)
    return heads.reshape(batch * 2, seq, -1).softmax(-1)


def _shape_arithmetic(x):
    rows = x.shape[0] * x.shape[1]
    return x.reshape(rows, -1) * 2, x.shape[1] * 3 - 1, x.shape[2] // 2, x.numel() / x.shape[0]


def _expand_and_factories(x, y):
    grid = x.unsqueeze(1).expand(x.shape[0], y.shape[0], x.shape[1])
    rows = torch.arange(x.shape[0], dtype=x.dtype)[:, None, None]
    return grid + y[None, :, None] + rows, x.new_zeros(x.shape[0] * 2, x.shape[1]), torch.full((y.shape[0], 2), 3.0)


def _split_chunk_cat(x, y):
    left, right = torch.split(x, [x.shape[1] - 2, 2], dim=1)
    top, bottom = x.chunk(2, dim=0)
    joined = torch.cat([x, y], dim=0).transpose(0, 1)
    return left * 2, right + 1, top.sum(0), bottom.sum(0), joined, torch.stack([x, x], 1).view(x.shape[0] * 2, -1)


def _slices_and_pads(x):
    return x[: x.shape[0] // 2] * 2, x[-3:] + 1, F.pad(x, (1, 2)), x.narrow(0, 1, x.shape[0] - 2).cumsum(0), x.flatten()


def _sizes_returned(x):
    return x.shape, x.size(1), x.shape[1:], torch.Size([x.shape[0], 3]), x.numel(), x.shape[0] > 4, list(x.shape)


CASES = [
    (_causal_softmax, lambda s: (torch.randn(*s),)),
    (_causal_triu, lambda s: (torch.randn(*s),)),
    (_attention, lambda s: tuple(torch.randn(*s) for _ in range(3))),
    (_heads, lambda s: (torch.randn(s[0], s[1], 2 * s[2]),)),
    (_shape_arithmetic, lambda s: (torch.randn(*s),)),
    (_expand_and_factories, lambda s: (torch.randn(s[0], s[2]), torch.randn(s[1]))),
    (_split_chunk_cat, lambda s: (torch.randn(s[0], s[2]), torch.randn(s[1], s[2]))),
    (_slices_and_pads, lambda s: (torch.randn(s[1] + 2, s[2]),)),  # rows // 2 >= 2, rows > 3
    (_sizes_returned, lambda s: (torch.randn(*s),)),
]
# Distinct sizes >= 2 within each call (equal ones would share a symbol, 1s would be constants).
SHAPES = [(3, 5, 4), (6, 7, 8), (2, 9, 4), (5, 3, 6), (7, 4, 9)]


@pytest.mark.parametrize("fn, make", CASES, ids=[fn.__name__.strip("_") for fn, _ in CASES])
def test_one_compilation_serves_every_size(fn, make):
    torch.manual_seed(0)
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for shape in SHAPES:
        inputs = make(shape)
        assert_same_result(jitted(*inputs), fn(*inputs))
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (1, len(SHAPES) - 1)


def test_modules_keep_static_parameter_shapes():
    torch.manual_seed(0)
    module = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).eval()
    jitted = dtcompile.jit(module, cache=SYMBOLIC)
    for batch, seq in ((3, 5), (6, 2), (2, 9)):
        x = torch.randn(batch, seq, 8)
        assert_same_tensor(jitted(x), module(x))
    assert dtcompile.cache_misses(jitted) == 1
    recorded = dtcompile.last_traces(jitted)[0]
    x_proxy, *params = recorded.inputs
    assert [is_symbolic(s) for s in x_proxy.shape] == [True, True, False]  # 8: layer_norm's normalized shape
    assert [tuple(p.shape) for p in params] == [tuple(p.shape) for p in module.parameters()]
    assert not any(is_symbolic(s) for p in params for s in (*p.shape, *p.stride()))
    prologue = dtcompile.last_prologue(jitted).source
    assert ".shape != (16, 8)" in prologue and ".shape != (8, 16)" in prologue
    assert "f32[16, 8]" in str(dtcompile.last_traces(jitted)[-1])


@torch.enable_grad()
def test_training_under_symbolic_values_gives_eager_gradients():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
    eager = copy.deepcopy(module)
    jitted = dtcompile.jit(module, cache=SYMBOLIC)
    for batch, seq in ((5, 4), (3, 7), (2, 2), (6, 3)):
        x = torch.randn(batch, seq, 6)
        x_jit, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = jitted(x_jit), eager(x_eager)
        assert_same_tensor(out.detach(), expected.detach())
        cotangent = torch.randn_like(expected)
        out.backward(cotangent)
        expected.backward(cotangent)
        assert_same_tensor(x_jit.grad, x_eager.grad)
        for p, q in zip(module.parameters(), eager.parameters()):
            assert_same_tensor(p.grad, q.grad)
    assert dtcompile.cache_misses(jitted) == 1
    titles = [t.title for t in dtcompile.last_traces(jitted)]
    assert titles.count("forward, with its sizes computed in the trace") == 1
    assert titles.count("backward, with its sizes computed in the trace") == 1


@torch.enable_grad()
def test_training_a_function_of_sizes_gives_eager_gradients():
    def fn(x, w):
        pairs = x.view(x.shape[0], 2, -1) * w
        causal = torch.ones(x.shape[0], x.shape[0]).tril()
        return (causal @ pairs.reshape(-1, x.shape[1]).tanh()).sum(), x.shape

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for rows, cols in ((3, 4), (5, 6), (2, 8), (4, 10)):
        x, w = torch.randn(rows, cols), torch.randn(cols // 2)
        ours = [t.clone().requires_grad_() for t in (x, w)]
        theirs = [t.clone().requires_grad_() for t in (x, w)]
        (loss, shape), (expected, expected_shape) = jitted(*ours), fn(*theirs)
        assert_same_tensor(loss.detach(), expected.detach())
        assert type(shape) is torch.Size and shape == expected_shape
        loss.backward()
        expected.backward()
        for a, b in zip(ours, theirs):
            assert_same_tensor(a.grad, b.grad)
    assert dtcompile.cache_misses(jitted) == 1


# ---------------------------------------------------------------------------------------
# Guards


def _calls(jitted, fn, shapes) -> list[int]:
    """Call with a tensor of each shape, check against eager; the misses after each call."""
    misses = []
    for shape in shapes:
        x = torch.randn(*shape)
        assert_same_result(jitted(x), fn(x))
        misses.append(dtcompile.cache_misses(jitted))
    return misses


def test_a_rank_change_is_a_miss():
    def fn(x):
        return x * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(3, 4), (5, 6), (3, 4, 5), (6, 7, 8), (2, 3)]) == [1, 1, 2, 2, 2]
    assert "v1.dim() != 3" in dtcompile.last_prologue(jitted).source


def test_sizes_0_and_1_are_constants():
    def fn(x):
        return x.sum(0) + 1

    # Traced with a 1: that dim is the constant 1, so any other size is a miss.
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(1, 4), (1, 7)]) == [1, 1]
    assert re.search(r"if size\d+\[0\] != 1: return None", dtcompile.last_prologue(jitted).source)
    assert _calls(jitted, fn, [(3, 4), (5, 7), (1, 9)]) == [2, 2, 2]
    # Traced with sizes >= 2: a call passing 1 (or 0) breaks the symbol's range.
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(3, 4), (1, 4), (0, 4), (5, 6), (1, 6)]) == [1, 2, 3, 3, 3]
    entry = dtcompile.last_prologue(jitted).source
    assert re.search(r"if size\d+\[0\] != 0: return None", entry)


def test_duck_sizing_equal_sizes_share_a_symbol():
    def fn(x):
        return x * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    # Traced with two equal sizes: one symbol, so unequal sizes are another entry.
    assert _calls(jitted, fn, [(4, 4), (6, 6)]) == [1, 1]
    duck = dtcompile.last_prologue(jitted).source
    assert _calls(jitted, fn, [(4, 5), (7, 7), (3, 8)]) == [2, 2, 2]
    general = dtcompile.last_prologue(jitted).source
    assert re.search(r"if size\d+\[1\] != s\d+: return None", duck)
    assert not re.search(r"if size\d+\[1\] != s\d+: return None", general)


def test_a_view_that_splits_a_dim_guards_divisibility():
    def fn(x):
        return x.view(x.shape[0], 2, -1) * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(3, 4), (5, 8), (2, 6), (3, 10)]) == [1, 1, 1, 1]
    prologue = dtcompile.last_prologue(jitted)
    assert re.search(r"% 2\) == 0", prologue.source)  # the ShapeEnv's divisibility guard, checked
    # An odd size is rejected by the prologue; tracing it fails as eager does.
    odd = torch.randn(3, 5)
    assert prologue.fn(None, (odd,), {}) is None
    assert prologue.fn(None, (torch.randn(3, 12),), {}) is not None
    with pytest.raises(RuntimeError):
        fn(odd)
    with pytest.raises(RuntimeError):
        jitted(odd)
    assert dtcompile.cache_misses(jitted) == 1
    # (3, 2) makes the split dim 1, which torch specializes: a new entry, still eager's values.
    assert _calls(jitted, fn, [(3, 2), (5, 2), (4, 12)]) == [2, 2, 2]


def test_a_branch_on_a_size_is_guarded():
    def fn(x):
        return x * 2 if x.shape[0] > 4 else x - 1

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(6, 3), (9, 4), (3, 4), (2, 5), (5, 5), (4, 2)]) == [1, 1, 2, 2, 2, 2]


def test_the_prologue_binds_sizes_and_checks_them():
    def fn(x, y):
        return x.view(x.shape[0], 2, -1) + y

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    x, y = torch.randn(3, 8), torch.randn(1, 4)
    assert_same_tensor(jitted(x, y), fn(x, y))
    prologue = dtcompile.last_prologue(jitted)
    source = prologue.source
    # Each symbol bound once, where it first occurs: x's two sizes and y's second.
    bound = re.findall(r"    (s\d+) = size\d+\[(\d)\]\n", source)
    assert [dim for _, dim in bound] == ["0", "1", "1"]
    assert re.search(r"if size\d+\[0\] != 1: return None", source)  # y's 1: a constant
    assert re.search(r"% 2\) == 0", source)  # x.shape[1] splits in two
    assert re.search(rf"\({bound[1][0]} // 2\) == {bound[2][0]}", source)  # ... into halves as wide as y
    assert re.search(r"if s\d+ < 2: return None", source)  # the symbols' ranges
    assert re.search(rf"if stride\d+\[0\] != {bound[1][0]}: return None", source)  # row-major strides
    for x, y in ((torch.randn(5, 6), torch.randn(1, 3)), (torch.randn(2, 10), torch.randn(1, 5))):
        assert_same_tensor(jitted(x, y), fn(x, y))
    assert dtcompile.cache_misses(jitted) == 1
    # Halves that do not match y: the prologue rejects the call, and tracing it fails as eager does.
    x, y = torch.randn(5, 6), torch.randn(1, 4)
    assert prologue.fn(None, (x, y), {}) is None
    with pytest.raises(RuntimeError):
        fn(x, y)
    with pytest.raises(RuntimeError):
        jitted(x, y)


def test_compiling_adds_no_guard_of_its_own():
    def fn(x):
        return x * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(3, 4), (5, 2), (2, 9)]) == [1, 1, 1]
    source = dtcompile.last_prologue(jitted).source
    assert "%" not in source and "not (" not in source
    assert not re.search(r"size\d+\[\d\] != s", source)  # no equal sizes assumed
    checks = [line for line in source.splitlines() if re.search(r"\bs\d+\b", line) and "return None" in line]
    assert checks and all(re.search(r"if (s\d+ < 2|stride\d+\[0\] != s\d+): return None", c) for c in checks), checks


def test_a_storage_offset_the_program_reads_is_guarded():
    # The input's storage offset is a symbol too (torch gives it one whenever the sizes are
    # symbolic, duck-sized: here the same symbol as y's size, 3); a program that reads it
    # must not serve a call with another offset.
    def fn(x, y):
        return y.new_zeros(x.storage_offset()), x * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for offset in (3, 4, 5):
        x, y = torch.randn(10)[offset:], torch.randn(3)
        assert_same_result(jitted(x, y), fn(x, y))


# ---------------------------------------------------------------------------------------
# Strides


@pytest.mark.parametrize(
    "fn",
    [
        torch.ones_like,
        lambda x: torch.empty_like(x).fill_(1.0) + x,
        lambda x: x.transpose(0, 1),
        lambda x: x.transpose(1, 2) * 2,
        lambda x: x.permute(2, 0, 1).contiguous(),
        lambda x: x.transpose(0, 1).reshape(x.shape[1], -1),
        lambda x: x.mT @ x,
        lambda x: x.new_ones(x.shape[2], x.shape[0]).t(),
    ],
    ids=["ones_like", "empty_like", "transpose", "transpose-mul", "contiguous", "reshape", "mT-matmul", "new_ones-t"],
)
def test_outputs_have_eager_strides(fn):
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for shape in ((3, 4, 5), (5, 6, 7), (2, 3, 4)):
        x = torch.randn(*shape).permute(1, 2, 0)  # not row-major
        assert_same_result(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 1
    # The strides' relations to the sizes are guarded: a row-major input is another entry.
    for shape in ((4, 5, 3), (6, 7, 5)):
        x = torch.randn(*shape)
        assert_same_result(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 2


def test_a_size_only_a_stride_holds_is_computed():
    # A column slice of a wider tensor: its row stride is a symbol of its own, which no
    # tensor's shape holds.
    def fn(x):
        return x.new_zeros(x.stride(0)) + 1, x.stride(), x.t() * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for wide, cols in (((4, 10), 3), ((5, 12), 7), ((3, 9), 2)):
        x = torch.randn(*wide)[:, :cols]
        assert_same_result(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 1


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
