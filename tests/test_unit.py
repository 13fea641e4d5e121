"""Single-process unit tests: no process group, plain tensors and modules.

Everything compiled here is compared with eager PyTorch: values, shapes, strides, the
containers around outputs, and how inputs alias outputs.
"""

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

import dtcompile
from dtcompile.capture import capture_call
from dtcompile.core import InputPath, NoProvenance, Trace, TraceError, verify
from dtcompile.transforms import cse, dce, remove_identity_views


@pytest.fixture(autouse=True)
def no_grad():
    # Training is not compiled yet; tests that need grad mode turn it on themselves.
    with torch.no_grad():
        yield


def assert_same_tensor(got, expected):
    assert type(got) is type(expected)
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert got.stride() == expected.stride()
    torch.testing.assert_close(got, expected)


def assert_same_result(got, expected):
    """Same containers (types and keys), same constants, same tensors."""
    assert type(got) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert_same_tensor(got, expected)
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert_same_result(g, e)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            assert_same_result(got[key], expected[key])
    else:
        assert got == expected


def traced(fn, *args, **kwargs):
    """The trace of ``fn(*args, **kwargs)`` as recorded, before any pass."""
    return capture_call(fn, args, kwargs).trace


def op_names(trace) -> list[str]:
    return [b.symbol.name for b in trace.bound_symbols]


# ---------------------------------------------------------------------------------------
# Functions and modules match eager


def _attention_like(x, w):
    scores = x @ w @ x.transpose(-1, -2) / 3.0
    return torch.softmax(scores, dim=-1) @ x


def _views_and_reductions(x, w):
    y = x.transpose(1, 2).contiguous().view(x.shape[0], -1)
    return y.sum(-1), y.mean(0, keepdim=True), x[:, 1:, ::2].permute(2, 0, 1), torch.cat([x, x * w[:1]], dim=1)


def _in_place_on_a_copy(x, w):
    y = x.clone()
    y.mul_(2).add_(w[0])
    y[:, 0] = -1.0
    return y, x.exp().clamp(max=3.0)


def _mixed_dtypes(x, w):
    idx = torch.arange(x.shape[1]) % 2
    return (x.to(torch.float64) * 2).sum(), torch.where(x > 0, x, w[0]), F.embedding(idx, w), idx


@pytest.mark.parametrize("fn", [_attention_like, _views_and_reductions, _in_place_on_a_copy, _mixed_dtypes])
def test_function_matches_eager(fn):
    torch.manual_seed(0)
    x, w = torch.randn(2, 4, 4), torch.randn(4, 4)
    jitted = dtcompile.jit(fn)
    assert_same_result(jitted(x, w), fn(x, w))
    assert_same_result(jitted(x, w), fn(x, w))
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (1, 1)


def test_module_matches_eager():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4)).eval()
    jitted = dtcompile.jit(module)
    x = torch.randn(3, 5, 8)
    assert_same_result(jitted(x), module(x))


def test_module_with_buffers_in_training_mode_matches_eager():
    # BatchNorm in training mode updates its running statistics: in-place writes to buffers.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).train()
    reference = copy.deepcopy(module)
    jitted = dtcompile.jit(module)
    for _ in range(2):
        x = torch.randn(5, 4)
        assert_same_result(jitted(x), reference(x))
        for name, buffer in reference.named_buffers():
            assert_same_result(module.get_buffer(name), buffer)
    assert dtcompile.cache_misses(jitted) == 1


@pytest.mark.parametrize("like", ["ones_like", "full_like", "zeros_like", "empty_like"])
def test_like_factories_keep_eager_strides(like):
    def fn(x):
        sliced = x[:, 1:].permute(1, 0)  # not contiguous: its like-tensors keep the permutation
        if like == "full_like":
            return torch.full_like(sliced, 3.0)
        return getattr(torch, like)(sliced)

    x = torch.randn(4, 6)
    got, expected = dtcompile.jit(fn)(x), fn(x)
    assert got.shape == expected.shape and got.stride() == expected.stride()
    assert not expected.is_contiguous()
    if like != "empty_like":
        torch.testing.assert_close(got, expected)


def test_nested_outputs_and_constants():
    def fn(x, y):
        return {"sum": (x + y, [x.sum(), None, "text"]), "count": 3, "pair": [(x * y,), 2.5]}

    x, y = torch.randn(3, 2), torch.randn(3, 2)
    assert_same_result(dtcompile.jit(fn)(x, y), fn(x, y))


def test_outputs_alias_like_eager():
    """Returned views of inputs share the input's memory; equal computations returned twice
    are distinct tensors, as in eager (writing to one must not change the other)."""

    def fn(x):
        return x.view(x.shape), x.exp(), x.exp(), x.exp().view(-1)

    x = torch.randn(6)
    view, a, b, c = dtcompile.jit(fn)(x)
    assert view is not x and view.data_ptr() == x.data_ptr()
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    a.add_(1)
    torch.testing.assert_close(b, x.exp())
    torch.testing.assert_close(c, x.exp())


def test_in_place_update_of_an_input_matches_eager():
    def fn(x):
        x.mul_(2)
        return x.sin(), x

    x = torch.randn(5)
    x_eager = x.clone()
    got, expected = dtcompile.jit(fn)(x), fn(x_eager)
    torch.testing.assert_close(x, x_eager)
    assert got[1] is x
    assert_same_tensor(got[0], expected[0])


def test_kwargs():
    def fn(x, *, mask, scale=1.0):
        return torch.where(mask, x * scale, -x)

    jitted = dtcompile.jit(fn)
    x, mask = torch.randn(4, 3), torch.rand(4, 3) > 0.5
    assert_same_result(jitted(x, mask=mask), fn(x, mask=mask))
    assert_same_result(jitted(x, mask=mask, scale=2.0), fn(x, mask=mask, scale=2.0))
    assert_same_result(jitted(mask=mask, x=x), fn(mask=mask, x=x))  # x by keyword: another call
    assert dtcompile.cache_misses(jitted) == 3
    assert_same_result(jitted(x, mask=~mask, scale=2.0), fn(x, mask=~mask, scale=2.0))
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (3, 1)


def test_python_constants_are_guarded():
    def fn(x, n, mode, offset, flag):
        y = x * n if mode == "mul" else x + n
        if offset is not None:
            y = y + offset
        return y if flag is True else -y  # True and 1 differ here

    jitted = dtcompile.jit(fn)
    x = torch.randn(3)
    calls = [
        (2, "mul", None, True),
        (2, "mul", None, True),
        (3, "mul", None, True),
        (2, "add", None, True),
        (2, "mul", 0.5, True),
        (2, "mul", None, 1),
        (2.0, "mul", None, True),
        (3, "mul", None, True),
    ]
    misses = []
    for n, mode, offset, flag in calls:
        assert_same_tensor(jitted(x, n, mode, offset, flag), fn(x, n, mode, offset, flag))
        misses.append(dtcompile.cache_misses(jitted))
    # Each new value (and 1 vs True, 2.0 vs 2) is a miss; repeated calls are hits.
    assert misses == [1, 1, 2, 3, 4, 5, 6, 6]
    assert dtcompile.cache_hits(jitted) == 2


def test_signed_zero_constants_are_distinct():
    # -0.0 == 0.0 in Python, but they are different constants: 1 / (x * -0.0) is -inf.
    def fn(x, s):
        return 1 / (x * s)

    jitted = dtcompile.jit(fn)
    x = torch.ones(2)
    assert_same_tensor(jitted(x, 0.0), fn(x, 0.0))
    assert_same_tensor(jitted(x, -0.0), fn(x, -0.0))


def test_tensor_metadata_and_grad_mode_are_guarded():
    jitted = dtcompile.jit(lambda x: x.t() * 2)
    x = torch.randn(3, 4)
    for arg in (x, x.clone(), x[:, :2], x.t(), x.double(), x[:2]):
        assert_same_tensor(jitted(arg), arg.t() * 2)
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (5, 1)
    with torch.enable_grad():  # nothing requires grad: compiled, as a new entry
        assert_same_tensor(jitted(x), x.t() * 2)
    assert dtcompile.cache_misses(jitted) == 6


def test_no_caching_compiles_every_call():
    jitted = dtcompile.jit(lambda x: x + 1, cache="no caching")
    x = torch.randn(2)
    for _ in range(3):
        assert_same_tensor(jitted(x), x + 1)
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (3, 0)


# ---------------------------------------------------------------------------------------
# Provenance


def test_inputs_carry_their_path_into_the_call():
    def fn(x, pair, *, mask):
        return x + pair[0] * pair[1]["w"] + mask

    x = torch.randn(3)
    trace = traced(fn, x, (x, {"w": x}), mask=x)
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


def test_cse_is_skipped_when_the_trace_mutates():
    def fn(x):
        y = x.exp()
        y.add_(1)
        return y + x.exp()  # the second exp is not the mutated first one

    x = torch.randn(4)
    trace = traced(fn, x)
    merged = cse(trace)
    assert "skipped" in merged.title
    assert op_names(merged) == op_names(trace)
    assert_same_tensor(dtcompile.jit(fn)(x), fn(x))


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


# ---------------------------------------------------------------------------------------
# A jitted module is the module


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.ReLU())
        self.head = nn.Linear(8, 2)
        self.scale = 2.0
        self.register_buffer("offset", torch.ones(2))

    def forward(self, x):
        return self.head(self.body(x)) * self.scale + self.offset


def test_jitted_module_behaves_like_the_module():
    torch.manual_seed(0)
    net = _Net()
    jitted = dtcompile.jit(net)
    assert isinstance(jitted, _Net) and isinstance(jitted, nn.Module)
    assert [id(p) for p in jitted.parameters()] == [id(p) for p in net.parameters()]
    assert list(jitted.state_dict()) == list(net.state_dict())
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(jitted.state_dict().values(), net.state_dict().values()))
    assert jitted.head is net.head and jitted.body[0] is net.body[0]
    assert jitted.scale == 2.0
    jitted.tag = "shared"
    assert net.tag == "shared"
    jitted.eval()
    assert not net.training and not net.body[1].training
    x = torch.randn(3, 4)
    assert_same_tensor(jitted(x), net(x))


class _Tied(nn.Module):
    """One module under two names, and one parameter in two modules."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(4, 4)
        self.again = self.encode
        self.decode = nn.Linear(4, 4, bias=False)
        self.decode.weight = self.encode.weight

    def forward(self, x):
        return self.decode(self.again(self.encode(x)))


def test_tied_modules_and_weights():
    torch.manual_seed(0)
    net = _Tied()
    originals = dict(net.named_parameters(remove_duplicate=False))
    jitted = dtcompile.jit(net)
    x = torch.randn(2, 4)
    assert_same_tensor(jitted(x), net(x))
    # Tracing leaves the module as it was: its own parameters, still tied.
    assert all(p is originals[n] for n, p in net.named_parameters(remove_duplicate=False))
    net.encode.weight.mul_(0.5)  # seen through both names by the next call
    assert_same_tensor(jitted(x), net(x))
    assert dtcompile.cache_misses(jitted) == 1
    trace = dtcompile.last_traces(jitted)[0]
    assert [str(p.provenance) for p in trace.inputs] == ["args[0]", "params['encode.weight']", "params['encode.bias']"]


def test_training_flag_change_is_a_miss():
    torch.manual_seed(0)
    net = _Net().eval()
    jitted = dtcompile.jit(net)
    x = torch.randn(3, 4)
    assert_same_tensor(jitted(x), net(x))
    jitted.train()
    torch.manual_seed(1)
    expected = net(x)  # dropout is on now
    torch.manual_seed(1)
    assert_same_tensor(jitted(x), expected)
    assert dtcompile.cache_misses(jitted) == 2
    net.body[1].eval()  # a submodule's flag alone changes what forward does
    assert_same_tensor(jitted(x), net(x))
    assert dtcompile.cache_misses(jitted) == 3
    jitted.eval()
    assert_same_tensor(jitted(x), net(x))
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (3, 1)


def test_in_place_parameter_updates_are_seen_without_recompiling():
    torch.manual_seed(0)
    net = _Net().eval()
    jitted = dtcompile.jit(net)
    x = torch.randn(3, 4)
    before = jitted(x)
    net.head.weight.mul_(-1.0)
    net.offset.fill_(5.0)
    net.body[0].bias.zero_()
    after = jitted(x)
    assert_same_tensor(after, net(x))
    assert not torch.allclose(before, after)
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (1, 1)


# ---------------------------------------------------------------------------------------
# Clear errors


def test_unsupported_argument_types_name_the_argument():
    jitted = dtcompile.jit(lambda x, *rest, **kw: x)
    x = torch.randn(2)
    with pytest.raises(dtcompile.UnsupportedInputError, match=r"args\[1\]\[1\]\['a'\] is a object"):
        jitted(x, [x, {"a": object()}])
    with pytest.raises(dtcompile.UnsupportedInputError, match=r"kwargs\['opts'\] is a set"):
        jitted(x, opts={1, 2})


def test_unsupported_tensor_subclass_and_layout():
    class Tagged(torch.Tensor):
        pass

    jitted = dtcompile.jit(lambda x, y: x + y)
    x = torch.randn(2, 2)
    with pytest.raises(dtcompile.UnsupportedInputError, match=r"args\[1\] is a Tagged"):
        jitted(x, x.as_subclass(Tagged))
    with pytest.raises(dtcompile.UnsupportedInputError, match=r"args\[0\] is a tensor with layout torch.sparse_coo"):
        jitted(x.to_sparse(), x)


@pytest.mark.parametrize("reads_data", [lambda x: x * x.sum().item(), lambda x: x if x.sum() > 0 else -x])
def test_reading_tensor_data_while_tracing_is_a_tracing_error(reads_data):
    with pytest.raises(dtcompile.TracingError, match="value at trace time"):
        dtcompile.jit(reads_data)(torch.randn(3))


def test_cache_options_and_executors_are_checked():
    with pytest.raises(NotImplementedError, match="symbolic values.*not implemented"):
        dtcompile.jit(lambda x: x, cache="symbolic values")
    with pytest.raises(ValueError, match="cache must be one of"):
        dtcompile.jit(lambda x: x, cache="sometimes")
    with pytest.raises(ValueError, match="unknown executor 'nvfuserr'"):
        dtcompile.jit(lambda x: x, executors=["torch", "nvfuserr"])
    with pytest.raises(TypeError, match="expects a function or an nn.Module"):
        dtcompile.jit(3)


@torch.enable_grad()
def test_a_training_call_gives_eager_gradients():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    jitted = dtcompile.jit(module)
    x = torch.randn(5, 3, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    jitted(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    module(x_eager).pow(2).sum().backward()
    for got, want in zip(expected, (p.grad for p in module.parameters())):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, x_eager.grad)


# ---------------------------------------------------------------------------------------
# Training: a forward and a backward program, compared with eager autograd


def _execution_traces(jitted) -> tuple[Trace, Trace]:
    """The forward and backward execution traces of the last (training) compilation."""
    runs = [t for t in dtcompile.last_traces(jitted) if t.title.startswith("execution trace")]
    assert [t.fn_name for t in runs] == ["forward", "backward"]
    return runs[0], runs[1]


def _saved_header(forward: Trace) -> tuple[int, str, list[str]]:
    """(count, MiB as printed, names) from the forward's "saved for the backward" line."""
    lines = [line for line in str(forward).splitlines() if line.startswith("# saved for the backward:")]
    assert len(lines) == 1, str(forward)
    match = re.fullmatch(
        r"# saved for the backward: (\d+) tensors? holding ([\d.]+) MiB beyond the inputs: (.*)", lines[0]
    )
    assert match, lines[0]
    names = [] if match[3] == "none" else match[3].split(", ")
    return int(match[1]), match[2], names


def _saved_by_the_forward(backward: Trace) -> list[str]:
    """The backward's inputs the forward saved (the others are cotangents)."""
    return [p.label for p in backward.inputs if backward.input_notes.get(p.label) == "saved by the forward"]


def _eager_saved_bytes(fn, *inputs) -> int:
    """What eager autograd keeps alive for the backward beyond the inputs: each storage of a
    tensor it saves, once, except the inputs' own."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*inputs)
    inputs_storages = {t.untyped_storage().data_ptr() for t in inputs}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in inputs_storages)


def _grads_of(tensors) -> list:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def _assert_same_grads(got: list, expected: list):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert (g is None) == (e is None)
        if e is not None:
            assert_same_tensor(g, e)


@torch.enable_grad()
def test_training_mlp_with_layernorm_and_dropout_matches_eager_gradients():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Dropout(0.3), nn.Linear(8, 3)).eval()
    eager = copy.deepcopy(module)
    jitted = dtcompile.jit(module)
    for _ in range(2):  # a miss, then a hit with new data
        x = torch.randn(5, 6)
        cotangent = torch.randn(5, 3)
        x_jit, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = jitted(x_jit), eager(x_eager)
        assert_same_tensor(out.detach(), expected.detach())
        assert out.requires_grad and out.grad_fn is not None
        out.backward(cotangent)
        expected.backward(cotangent)
        _assert_same_grads(
            [x_jit.grad, *_grads_of(module.parameters())], [x_eager.grad, *_grads_of(eager.parameters())]
        )
        module.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (1, 1)
    # Dropout on: the compiled program draws the same random numbers as eager.
    module.train()
    eager.train()
    x = torch.randn(5, 6)
    torch.manual_seed(7)
    jitted(x).pow(2).sum().backward()
    torch.manual_seed(7)
    eager(x).pow(2).sum().backward()
    _assert_same_grads(_grads_of(module.parameters()), _grads_of(eager.parameters()))
    assert dtcompile.cache_misses(jitted) == 2


def _two_inputs_and_a_weight(x, y, w):
    return torch.tanh(x @ w) * y.sigmoid() + (y**2).sum(-1, keepdim=True)


@torch.enable_grad()
def test_autograd_grad_with_respect_to_inputs():
    torch.manual_seed(0)
    x, y, w = torch.randn(4, 3), torch.randn(4, 5), torch.randn(3, 5)
    jitted = dtcompile.jit(_two_inputs_and_a_weight)
    results = []
    for fn in (jitted, _two_inputs_and_a_weight):
        xs, ys, ws = (t.clone().requires_grad_() for t in (x, y, w))
        out = fn(xs, ys, ws)
        grads = torch.autograd.grad(out.pow(2).sum(), (xs, ys))
        assert ws.grad is None and xs.grad is None  # autograd.grad accumulates nothing
        results.append((out.detach(), *grads))
    for got, expected in zip(*results):
        assert_same_tensor(got, expected)
    # Only the weight needs a gradient: the same jitted function, another cache entry.
    ws = w.clone().requires_grad_()
    (grad_w,) = torch.autograd.grad(jitted(x, y, ws).sum(), ws)
    ws_eager = w.clone().requires_grad_()
    (expected_w,) = torch.autograd.grad(_two_inputs_and_a_weight(x, y, ws_eager).sum(), ws_eager)
    assert_same_tensor(grad_w, expected_w)
    assert dtcompile.cache_misses(jitted) == 2


def _three_outputs(x, w):
    h = x @ w
    return h.sin(), {"cos": h.cos()}, [h.exp(), h * 2]


@pytest.mark.parametrize(
    "loss",
    [
        lambda a, d, e: a.sum(),  # one output of several
        lambda a, d, e: (d["cos"] * e[1]).sum(),  # two, in containers
        lambda a, d, e: e[0].mean() + a.pow(2).sum(),
    ],
)
@torch.enable_grad()
def test_several_outputs_only_some_in_the_loss(loss):
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    jitted = dtcompile.jit(_three_outputs)
    results = []
    for fn in (jitted, _three_outputs):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        outs = fn(xs, ws)
        loss(*outs).backward()
        results.append((tree_map(torch.Tensor.detach, outs), xs.grad, ws.grad))
    assert_same_result(*results)


@torch.enable_grad()
def test_several_backward_calls_through_one_call_accumulate_like_eager():
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    jitted = dtcompile.jit(_three_outputs)
    grads = []
    for fn in (jitted, _three_outputs):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        a, d, e = fn(xs, ws)
        a.sum().backward(retain_graph=True)
        (e[0] * 3).sum().backward(retain_graph=True)
        d["cos"].sum().backward()
        grads.append((xs.grad, ws.grad))
    for got, expected in zip(*grads):
        assert_same_tensor(got, expected)


def _some_outputs_without_grad(x, w):
    h = x @ w
    return torch.tanh(h), h.argmax(-1), h.detach() * 2, torch.ones(3), h.sum() > 0


@torch.enable_grad()
def test_outputs_that_do_not_require_grad():
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    jitted = dtcompile.jit(_some_outputs_without_grad)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    got, expected = jitted(xs, ws), _some_outputs_without_grad(xe, we)
    assert [g.requires_grad for g in got] == [e.requires_grad for e in expected] == [True, False, False, False, False]
    assert [g.dtype for g in got] == [e.dtype for e in expected]
    assert_same_result(tuple(g.detach() for g in got), tuple(e.detach() for e in expected))
    for g in got[1:]:
        assert g.grad_fn is None
        with pytest.raises(RuntimeError, match="does not require grad"):
            g.float().sum().backward()
    got[0].sum().backward()
    expected[0].sum().backward()
    assert_same_tensor(xs.grad, xe.grad)
    assert_same_tensor(ws.grad, we.grad)
    # A call whose only output is not differentiable, though its input requires grad.
    argmax = dtcompile.jit(lambda x: (x * 2).argmax(-1))
    result = argmax(xs)
    assert_same_tensor(result, (xe * 2).argmax(-1))
    assert not result.requires_grad


def _sin_chain(x):
    return (torch.sin(x) * 2 + 1).neg()


@torch.enable_grad()
def test_the_forward_saves_only_what_the_backward_needs():
    # The backward of this chain needs only cos(x): the saved set is x, which the forward
    # received anyway; none of the intermediates is kept.
    jitted = dtcompile.jit(_sin_chain)
    x = torch.randn(64, 64, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    jitted(x).sum().backward()
    _sin_chain(x_eager).sum().backward()
    assert_same_tensor(x.grad, x_eager.grad)
    forward, backward = _execution_traces(jitted)
    assert _saved_by_the_forward(backward) == ["x"]
    count, mib, names = _saved_header(forward)
    assert (count, names) == (1, ["x"])
    assert float(mib) == 0.0 == _eager_saved_bytes(_sin_chain, x_eager)
    outputs, _ = tree_flatten(forward.output)
    assert [p.label for p in outputs][1:] == ["x"]  # the call's output, then the saved set


def _exp_of_matmul(x, w):
    return (x @ w).exp()


@torch.enable_grad()
def test_the_saved_set_header_names_the_saved_values_and_their_memory():
    # exp's backward reads its result (0.5 MiB here); mm's reads x and w, which are inputs.
    x, w = torch.randn(256, 32, requires_grad=True), torch.randn(32, 512, requires_grad=True)
    jitted = dtcompile.jit(_exp_of_matmul)
    (jitted(x, w) * 0.5).sum().backward()
    forward, backward = _execution_traces(jitted)
    count, mib, names = _saved_header(forward)
    saved = _saved_by_the_forward(backward)
    assert names == saved and count == len(saved) == 3
    assert {"x", "w"} < set(names)
    assert (
        mib
        == f"{_eager_saved_bytes(_exp_of_matmul, x.detach().requires_grad_(), w.detach().requires_grad_()) / 2**20:.3f}"
    )
    assert float(mib) == 0.5
    outputs, _ = tree_flatten(forward.output)
    assert [p.label for p in outputs][1:] == names
    # The header is part of the printed program only: the backward takes the saved values
    # in the same order, then one cotangent.
    assert [p.label for p in backward.inputs] == [*names, "cotangent0"]


def _double_backward(fn, x, w, penalty: bool):
    """A gradient penalty: the loss plus the squared norm of its gradient with respect to
    ``x``, which needs the backward's own backward (``create_graph=True``)."""
    loss = fn(x, w).sum() if not penalty else fn(x, w).pow(2).sum()
    (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + grad_x.pow(2).sum()).backward()


@pytest.mark.parametrize("penalty", [False, True], ids=["cotangent without grad", "cotangent with grad"])
@torch.enable_grad()
def test_double_backward_through_a_compiled_step_is_an_error(penalty):
    # Eager computes second derivatives here; the compiled backward is not differentiable,
    # so the call must fail, whether or not the incoming cotangent requires grad, rather
    # than give gradients without the penalty's second-order part.
    torch.manual_seed(0)
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    _double_backward(_exp_of_matmul, x, w, penalty)  # eager works
    x.grad = w.grad = None
    with pytest.raises(RuntimeError, match="create_graph|double backward|differentiate twice"):
        _double_backward(dtcompile.jit(_exp_of_matmul), x, w, penalty)


# ---------------------------------------------------------------------------------------
# Printed traces are runnable Python


def test_printed_traces_run_and_match_eager():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.SiLU(), nn.Dropout(0.1), nn.Linear(8, 6)).eval()

    def fn(x, scale):
        h = module(x.transpose(0, 1).reshape(4, 6))
        return torch.softmax(h * scale, dim=-1), h.sum(0), torch.ones_like(h[:, ::2].t())

    jitted = dtcompile.jit(fn)
    x = torch.randn(6, 4)
    expected = fn(x, 0.5)
    assert_same_result(jitted(x, 0.5), expected)
    inputs = dtcompile.last_prologue(jitted).fn(None, (x, 0.5), {})
    for trace in dtcompile.last_traces(jitted):
        namespace = {}
        exec(str(trace), namespace)
        assert_same_result(namespace["computation"](*inputs), expected)
