"""Single process: provenance, the verifier and each pass, on small traces."""

import pytest
import torch
import torch.nn as nn
from support import assert_same_tensor, op_names, traced

import dtcompile
from dtcompile.capture import capture_call
from dtcompile.core import InputPath, NoProvenance, Trace, TraceError, verify
from dtcompile.transforms import (
    collapse_view_chains,
    cse,
    dce,
    fuse_linears,
    remove_identity_views,
    remove_redundant_copies,
    storage_bases,
)


@pytest.fixture(autouse=True)
def no_grad():
    # Inference; the training tests (test_training_single.py) turn grad mode on.
    with torch.no_grad():
        yield


# ---------------------------------------------------------------------------------------
# Provenance


def test_inputs_carry_their_path_into_the_call():
    def fn(x, pair, *, mask):
        return x + pair[0] * pair[1]["w"] + mask

    x = torch.randn(3)
    trace = traced(fn, x, (x.clone(), {"w": x.clone()}), mask=x.clone())
    paths = {p.label: p.provenance for p in trace.inputs}
    assert list(paths.values()) == [
        InputPath("args").index(0),
        InputPath("args").index(1).index(0),
        InputPath("args").index(1).index(1).key("w"),
        InputPath("kwargs").key("mask"),
    ]
    assert [str(p) for p in paths.values()] == ["args[0]", "args[1][0]", "args[1][1]['w']", "kwargs['mask']"]


def test_module_inputs_are_parameters_and_buffers():
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    trace = capture_call(module, (torch.randn(2, 4),), {}, module=module).trace
    expected = ["args[0]"] + [f"params['{n}']" for n, _ in module.named_parameters()]
    expected += [f"buffers['{n}']" for n, _ in module.named_buffers()]
    assert [str(p.provenance) for p in trace.inputs] == expected
    assert trace.inputs[1].provenance == InputPath("params").key("0.weight")


def test_intermediates_are_marked_without_provenance():
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    jitted = dtcompile.jit(module)
    jitted(torch.randn(3, 4))
    traces = dtcompile.last_traces(jitted)
    for trace in traces:
        input_labels = {p.label for p in trace.inputs}
        for bsym in trace.bound_symbols:
            for proxy in bsym.output_proxies():
                assert proxy.label not in input_labels
                assert isinstance(proxy.provenance, NoProvenance), proxy
                # The marker names the op that made the value.
                assert proxy.provenance.made_by == str(bsym.op)
    assert len(traces[-1].bound_symbols) > 0


def test_a_tensor_the_function_closes_over_is_captured():
    weight = torch.randn(3, 3)

    def fn(x):
        return x @ weight

    jitted = dtcompile.jit(fn)
    x = torch.randn(2, 3)
    assert_same_tensor(jitted(x), fn(x))
    trace = dtcompile.last_traces(jitted)[0]
    assert [str(p.provenance) for p in trace.inputs] == ["args[0]", "captured[0]"]
    weight.add_(1.0)  # the program reads the tensor itself, not a copy
    assert_same_tensor(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 1


# ---------------------------------------------------------------------------------------
# The verifier and the passes


def _two_step_trace():
    return traced(lambda x: (x * 2).sin(), torch.randn(3))


def test_verifier_accepts_recorded_traces():
    verify(_two_step_trace())


def test_verifier_rejects_use_before_definition():
    trace = _two_step_trace()
    broken = trace.derive("swapped", list(reversed(trace.bound_symbols)))
    with pytest.raises(TraceError, match="before it is defined"):
        verify(broken)


def test_verifier_rejects_a_second_definition():
    trace = _two_step_trace()
    first = trace.bound_symbols[0]
    with pytest.raises(TraceError, match="redefines"):
        verify(trace.derive("doubled", [first, first, trace.bound_symbols[1]]))
    with pytest.raises(TraceError, match="defined twice"):
        verify(Trace("computation", [trace.inputs[0], trace.inputs[0]], [], ()))


def test_verifier_rejects_an_undefined_output():
    trace = _two_step_trace()
    with pytest.raises(TraceError, match="never defined"):
        verify(trace.derive("truncated", trace.bound_symbols[:1]))


def test_dce_removes_dead_ops():
    def fn(x):
        unused = x.exp().cos()  # noqa: F841
        return x.sin()

    trace = traced(fn, torch.randn(3))
    assert op_names(trace) == ["aten.exp.default", "aten.cos.default", "aten.sin.default"]
    assert op_names(dce(trace)) == ["aten.sin.default"]


def test_dce_keeps_in_place_and_random_ops():
    def fn(x, buffer):
        buffer.add_(1)  # nobody reads it afterwards, but the caller sees it
        torch.rand(3)  # drawing advances the generator, even if unused
        torch.randn_like(x).exp()
        return x.sin()

    trace = dce(traced(fn, torch.randn(3), torch.zeros(3)))
    names = op_names(trace)
    assert {"aten.add_.Tensor", "aten.rand.default", "aten.randn_like.default", "aten.sin.default"} <= set(names)
    assert "aten.exp.default" not in names


def test_dce_keeps_random_ops_in_compiled_programs():
    # Dropping an unused draw would shift every later draw: compare with eager's stream.
    def fn(x):
        torch.rand(4)
        return x + torch.rand(3)

    x = torch.zeros(3)
    torch.manual_seed(7)
    expected = fn(x)
    jitted = dtcompile.jit(fn)
    jitted(x)
    torch.manual_seed(7)
    assert_same_tensor(jitted(x), expected)


def test_cse_merges_duplicates():
    trace = traced(lambda x: x.exp() + x.exp() * x.t().t().sum(), torch.randn(3, 3))
    assert op_names(trace).count("aten.exp.default") == 2
    merged = cse(trace)
    verify(merged)
    assert op_names(merged).count("aten.exp.default") == 1
    assert op_names(merged).count("aten.t.default") == 2  # t(t(x)) is not a duplicate of t(x)


def test_cse_keeps_returned_duplicates_apart():
    trace = traced(lambda x: (x.exp(), x.exp(), x.sin() + x.sin()), torch.randn(3))
    merged = cse(trace)
    assert op_names(merged).count("aten.exp.default") == 2
    assert op_names(merged).count("aten.sin.default") == 1
    assert len({p.label for p in merged.output}) == 3


def test_cse_does_not_merge_across_a_mutation_of_what_it_would_reuse():
    def fn(x):
        y = x.exp()
        y.add_(1)
        return y + x.exp()  # the second exp is not the mutated first one

    x = torch.randn(4)
    trace = traced(fn, x)
    merged = cse(trace)
    assert op_names(merged) == op_names(trace)
    assert_same_tensor(dtcompile.jit(fn)(x), fn(x))

    def unrelated(x, z):
        z.add_(1)  # writes z only: the two exps of x are still one
        return x.exp() + x.exp() + z

    x, z = torch.randn(4), torch.randn(4)
    merged = cse(traced(unrelated, x, z.clone()))
    assert op_names(merged).count("aten.exp.default") == 1
    assert_same_tensor(dtcompile.jit(unrelated)(x, z.clone()), unrelated(x, z.clone()))


def test_identity_views_are_removed():
    def fn(x):
        return x.view(x.shape) * 2 + x.reshape(4, 5).view(-1).sum()

    trace = traced(fn, torch.randn(4, 5))
    assert op_names(trace).count("aten.view.default") == 3
    cleaned = remove_identity_views(trace)
    verify(cleaned)
    assert op_names(cleaned).count("aten.view.default") == 1  # view(-1) changes the shape


def test_returned_identity_views_stay_when_the_source_is_an_input_or_returned():
    x = torch.randn(4)
    # The caller must not get its own input back: the view of an input stays.
    assert op_names(remove_identity_views(traced(lambda x: x.view(4), x))) == ["aten.view.default"]

    def both(x):
        y = x * 2
        return y, y.view(4)

    # Nor one tensor twice: a view returned beside its source stays.
    kept = remove_identity_views(traced(both, x))
    assert op_names(kept) == ["aten.mul.Tensor", "aten.view.default"]
    assert len({p.label for p in kept.output}) == 2
    # A view of a fresh tensor, returned alone, is that tensor.
    assert op_names(remove_identity_views(traced(lambda x: (x * 2).view(4), x))) == ["aten.mul.Tensor"]


def test_storage_sharing_is_read_from_the_fake_tensors():
    # _unsafe_view has no alias annotation in its schema, but shares its input's memory.
    def fn(x, w):
        return x @ w, x.view(6, 4) @ w

    x, w = torch.randn(2, 3, 4), torch.randn(4, 5)
    trace = traced(fn, x, w)
    bases = storage_bases(trace)
    unsafe = [b for b in trace.bound_symbols if b.symbol.name == "aten._unsafe_view.default"]
    assert unsafe and bases[unsafe[0].output.label] == bases[unsafe[0].args[0].label]
    a, b = dtcompile.jit(fn)(x, w)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()  # as in eager


# ---------------------------------------------------------------------------------------
# Redundant views and copies, linear layers


def test_view_chains_of_a_row_major_tensor_become_one_view():
    def fn(x):
        y = x.view(2, 6).unsqueeze(0).view(3, 4)  # one view of x
        mask = x.sum(0).unsqueeze(0).unsqueeze(1).unsqueeze(2)  # one view of the sum
        return y * 2, mask

    x = torch.randn(3, 4)
    trace = traced(fn, x)
    collapsed = dce(collapse_view_chains(trace))
    verify(collapsed)
    assert op_names(collapsed).count("aten.view.default") == 2
    assert "aten.unsqueeze.default" not in op_names(collapsed)
    got, expected = dtcompile.jit(fn)(x), fn(x)
    for g, e in zip(got, expected):
        assert_same_tensor(g, e)


def test_view_chains_of_transposed_tensors_stay():
    def fn(x):
        return x.t().unsqueeze(0).reshape(12) * 1.5  # t() is not row-major: reshape copies

    x = torch.randn(3, 4)
    trace = traced(fn, x)
    assert op_names(collapse_view_chains(trace)) == op_names(trace)
    assert_same_tensor(dtcompile.jit(fn)(x), fn(x))


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize(
    "chain",
    [
        lambda x: x[None, :, None],
        lambda x: (x + 1).unsqueeze(0).unsqueeze(2),
        lambda x: x.view(0, 2, 2).unsqueeze(0),
        lambda x: x.reshape(-1, 2, 2)[None],
    ],
)
def test_view_chains_of_an_empty_tensor_keep_eagers_strides(chain, cache):
    # torch steps over a size 0 as over a size 1 where it lays a tensor out (``view``), but
    # not where a view keeps its base's strides: one view was not the chain.
    x = torch.randn(0, 4)
    got, expected = dtcompile.jit(chain, cache=cache)(x), chain(x)
    assert_same_tensor(got, expected)


def test_copies_that_change_nothing_are_removed():
    def fn(x, i):
        scaled = x * 1.0 / 1.0 - 0.0  # three copies of x
        same = scaled.to(torch.float32).clone()
        offset = i + 0  # an integer offset may differ between ranks: kept
        return same + 1, offset, x + 0.0  # + 0.0 turns -0.0 into 0.0: kept

    x, i = torch.tensor([-0.0, 1.0, 2.0]), torch.arange(3)
    trace = traced(fn, x, i)
    cleaned = dce(remove_redundant_copies(trace))
    verify(cleaned)
    assert op_names(cleaned) == ["aten.add.Tensor", "aten.add.Tensor", "aten.add.Tensor"]
    got, expected = dtcompile.jit(fn)(x, i), fn(x, i)
    for g, e in zip(got, expected):
        assert_same_tensor(g, e)
    assert torch.equal(got[2].signbit(), expected[2].signbit())


def test_copies_that_are_returned_or_written_stay():
    def returned(x):
        return x.clone(), x * 1.0  # the caller gets new tensors, as in eager

    x = torch.randn(3)
    assert op_names(remove_redundant_copies(traced(returned, x))) == op_names(traced(returned, x))
    a, b = dtcompile.jit(returned)(x)
    assert a.data_ptr() != x.data_ptr() and b.data_ptr() != x.data_ptr()

    def written(x):
        y = x.clone()
        y.add_(1)  # x must not change
        return y * 2

    kept = remove_redundant_copies(traced(written, x))
    assert "aten.clone.default" in op_names(kept)
    before = x.clone()
    assert_same_tensor(dtcompile.jit(written)(x), written(before.clone()))
    assert torch.equal(x, before)


@pytest.mark.parametrize("shape", [(5, 8), (2, 5, 8), (2, 3, 5, 8)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_layers_are_one_call(shape, bias):
    linear = nn.Linear(8, 6, bias=bias)
    x = torch.randn(*shape)
    jitted = dtcompile.jit(linear)
    got = jitted(x)
    assert_same_tensor(got, linear(x))
    assert torch.equal(got, linear(x))  # the same kernel on the same operands
    trace = dtcompile.last_traces(jitted)[-2]
    # aten::linear adds the bias of a 4-D input after its matmul: that stays decomposed.
    fused = not (bias and len(shape) == 4)
    assert ("aten.linear.default" in op_names(trace)) == fused
    if fused:
        assert "aten.mm.default" not in op_names(trace) and "aten.addmm.default" not in op_names(trace)


def test_linear_matching_leaves_a_matmul_read_elsewhere():
    def fn(x, w):
        y = x @ w.t()
        return y, y.view(-1)  # the mm result is read twice

    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    fused = fuse_linears(traced(fn, x, w))
    verify(fused)
    got, expected = dtcompile.jit(fn)(x, w), fn(x, w)
    for g, e in zip(got, expected):
        assert_same_tensor(g, e)


def test_a_linear_reads_its_input_where_the_matmul_did():
    def fn(x, w):
        y = torch.mm(x.view(6, 4), w.t())
        x.add_(1.0)  # written after the matmul, before the view back
        return y.view(2, 3, 5)

    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    jitted = dtcompile.jit(fn)
    got, expected = jitted(x.clone(), w), fn(x.clone(), w)
    assert torch.equal(got, expected)
    assert "aten.linear.default" in op_names(dtcompile.last_traces(jitted)[-2])


def test_the_type_check_finds_a_symbol_whose_outputs_lie():
    from dataclasses import replace

    from dtcompile.core.typecheck import TraceTypeError, check_types

    trace = traced(lambda x: (x * 2).sum(0), torch.randn(3, 4))
    check_types(trace)  # as recorded: every op gives what the trace says
    mul, total = trace.bound_symbols
    # A pass that rewired the sum to read the input sideways would leave (4,) claimed for
    # an op that gives (3,).
    broken = replace(total, args=(mul.output, 1))
    with pytest.raises(TraceTypeError, match=r"shape \(3,\), recorded \(4,\)"):
        check_types(trace.derive("broken", [mul, broken]))


def _attention(x, w):
    q = (x @ w).view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2)
    return torch.nn.functional.softmax(q @ q.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ q


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize(
    "fn, make",
    [
        (lambda x: (x * 2).exp().sum(-1, keepdim=True) + x.t().t(), lambda n: (torch.randn(n, 4),)),
        (_attention, lambda n: (torch.randn(2, n, 8), torch.randn(8, 8))),
        (
            lambda x, w: torch.nn.functional.linear(x, w).relu().reshape(-1),
            lambda n: (torch.randn(3, n, 4), torch.randn(5, 4)),
        ),
    ],
    ids=["pointwise-and-views", "attention", "linear"],
)
def test_compiled_programs_compute_what_the_interpreter_does(fn, make, cache):
    from torch.utils._pytree import tree_flatten

    from dtcompile.core.interpret import interpret
    from dtcompile.core.symbolic import is_symbolic

    jitted = dtcompile.jit(fn, cache=cache)
    for n in (3, 5):
        args = make(n)
        got = jitted(*args)
        # The recorded trace (sizes as SymInts under symbolic values: runnable once they are
        # computed in the trace) and each pass's, against what the executors' program gave.
        traces = dtcompile.last_traces(jitted)[:-1]
        runnable = [t for t in traces if not any(map(is_symbolic, tree_flatten([b.args for b in t.bound_symbols])[0]))]
        assert len(runnable) >= len(traces) - 1
        for trace in runnable:
            (expected,) = interpret(trace, *args)
            torch.testing.assert_close(got, expected, msg=lambda m, t=trace: f"{t.title}: {m}")


def test_op_classes_are_read_from_the_schemas():
    from dtcompile.core.op_classes import group_argument, is_collective, is_wait, makes_view

    aten, functional = torch.ops.aten, torch.ops._c10d_functional
    views = [aten.view.default, aten.reshape.default, aten.transpose.int, aten.slice.Tensor, aten.split.Tensor]
    assert all(map(makes_view, views))
    assert not any(map(makes_view, [aten.add_.Tensor, aten.mul.Tensor, aten.copy_.default, aten.clone.default]))
    assert is_collective(functional.all_reduce.default) and not is_collective(functional.wait_tensor.default)
    assert is_wait(functional.wait_tensor.default) and not is_collective(aten.add.Tensor)
    assert group_argument(functional.all_reduce.default) == 2
    assert group_argument(functional.reduce_scatter_tensor.default) == 3
