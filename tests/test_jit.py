"""Single process, no process group: jitted functions and modules against eager PyTorch.

Values, shapes, strides, the containers around outputs, how inputs alias outputs, the
guards, jitted modules, clear errors, and printed traces that run."""

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import assert_same_result, assert_same_tensor

import dtcompile


@pytest.fixture(autouse=True)
def no_grad():
    # Inference; the training tests (test_training_single.py) turn grad mode on.
    with torch.no_grad():
        yield


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


def _reshaped_slices(x):
    rows = x[:, :-1]  # one row: its row stride is the parent's, which a reshape recomputes
    return rows.view(rows.shape), rows.reshape(1, -1), rows.view(1, 1, -1), x.view(1, -1)[:, 1:].view(1, -1)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_reshapes_give_a_dim_of_size_one_eagers_stride(cache):
    # Eager's view of a [1, n-1] slice of a [1, n] tensor has strides (n-1, 1); the fake
    # mode's keeps (n, 1). The view was then taken for an identity and removed.
    jitted = dtcompile.jit(_reshaped_slices, cache=cache)
    for n in (4, 6, 9):
        x = torch.randn(1, n)
        got, expected = jitted(x), _reshaped_slices(x)
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.stride() == e.stride(), (n, g.stride(), e.stride())
            assert torch.equal(g, e)


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


def test_cache_options_and_executors_are_checked():
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


# ---------------------------------------------------------------------------------------
# What a program reads at run time, not at trace time (found in review)


def test_ops_on_closed_over_tensors_run_at_every_call():
    counter = torch.zeros(())
    template = torch.empty(3)
    scale = torch.tensor(2.0)

    def fn(x):
        counter.add_(1)
        return x * (scale * 1) + torch.randn_like(template)

    jitted = dtcompile.jit(fn)
    x = torch.ones(3)
    first, second = jitted(x), jitted(x)
    assert counter.item() == 2  # the in-place op ran at each call, not once at trace time
    assert not torch.equal(first, second)  # a random op draws anew at each call
    scale.fill_(3.0)
    torch.manual_seed(0)
    expected = fn(x)
    torch.manual_seed(0)
    torch.testing.assert_close(jitted(x), expected)  # the new value of the closed-over tensor
    assert dtcompile.cache_misses(jitted) == 1


def test_replaced_submodules_and_new_hooks_are_misses():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    assert_same_tensor(jitted(x), model(x))
    model[1] = nn.ReLU()  # a submodule of other code
    assert_same_tensor(jitted(x), model(x))
    handle = model[0].register_forward_hook(lambda module, args, out: out * 0)
    assert_same_tensor(jitted(x), model(x))
    handle.remove()
    assert_same_tensor(jitted(x), model(x))
    assert dtcompile.cache_misses(jitted) == 3  # ReLU, ReLU with the hook; without it is a hit


def test_dict_keys_are_guarded_in_order():
    jitted = dtcompile.jit(lambda d: torch.cat(list(d.values())))
    x, y = torch.ones(2), torch.zeros(2)
    assert_same_tensor(jitted({"a": x, "b": y}), torch.cat([x, y]))
    assert_same_tensor(jitted({"b": y, "a": x}), torch.cat([y, x]))
    assert dtcompile.cache_misses(jitted) == 2


def test_jitted_modules_copy_and_pickle():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    jitted(x)
    teacher = copy.deepcopy(jitted)
    teacher.eval()
    assert isinstance(teacher, nn.Sequential) and teacher.training is False and jitted.training is True
    assert teacher[0].weight is not model[0].weight
    assert_same_tensor(teacher(x), model.eval()(x))
    buffer = io.BytesIO()
    torch.save(jitted, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_same_tensor(loaded.eval()(x), model.eval()(x))
    assert dtcompile.cache_misses(loaded) == 1


def test_a_jitted_method_closes_over_its_object():
    class Scaler:
        def __init__(self, factor):
            self.factor = factor

        @dtcompile.jit
        def apply(self, x):
            return x * self.factor

    a, b = Scaler(2.0), Scaler(3.0)
    x = torch.ones(3)
    assert_same_tensor(a.apply(x), x * 2.0)
    assert_same_tensor(b.apply(x), x * 3.0)
    assert a.apply is a.apply  # one compiled function per object


def test_generators_and_dtypes_are_arguments():
    generator = torch.Generator().manual_seed(0)
    jitted = dtcompile.jit(lambda x: x + torch.randn(3, generator=generator))
    first = jitted(torch.zeros(3))
    generator.manual_seed(0)
    assert torch.equal(jitted(torch.zeros(3)), first)  # the same generator, read at each call
    cast = dtcompile.jit(lambda x, dtype: x.to(dtype))
    assert cast(torch.ones(2), torch.float16).dtype is torch.float16
    assert cast(torch.ones(2), torch.bfloat16).dtype is torch.bfloat16
    assert dtcompile.cache_misses(cast) == 2


def test_the_prologue_returns_the_computations_inputs_in_order():
    from dtcompile.capture import capture_call
    from dtcompile.jit.prologue import build_prologue

    def fn(x, y):
        return x * 2 + y

    x, y = torch.randn(3), torch.randn(3)
    captured = capture_call(fn, (x, y), {})
    labels = [p.label for p in captured.trace.inputs]
    prologue = build_prologue(
        captured.inputs, torch.is_grad_enabled(), captured.global_state, [], None, input_labels=labels
    )
    assert prologue.fn(None, (x, y), {}) == (x, y)
    with pytest.raises(AssertionError, match="the computation takes"):
        build_prologue(
            captured.inputs, torch.is_grad_enabled(), captured.global_state, [], None, input_labels=labels[::-1]
        )


def test_slices_and_ellipsis_are_guarded_constants():
    def fn(x, index):
        return x[index] * 2

    jitted = dtcompile.jit(fn)
    x = torch.arange(24.0).reshape(4, 6)
    for index in (slice(1, 3), slice(None, None, 2), slice(1, 3), Ellipsis, (Ellipsis, slice(0, 2)), slice(1, 3)):
        assert torch.equal(jitted(x, index), fn(x, index))
    assert dtcompile.cache_misses(jitted) == 4  # one per distinct index
    with pytest.raises(dtcompile.UnsupportedInputError, match="args.1. is a slice"):
        dtcompile.jit(fn)(x, slice(torch.tensor(1), 3))  # a slice of tensors is not a constant


@pytest.mark.parametrize("grad", [False, True])
def test_parameters_can_be_swapped_after_compiling(grad):
    """The fake mode kept weak references to the parameters it made fakes of, and torch
    refuses to swap a tensor anything refers to weakly: ``swap_tensors`` raised, and so
    did ``module.to()`` under ``set_swap_module_params_on_conversion(True)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    with torch.set_grad_enabled(grad):
        jitted(x)
        torch.utils.swap_tensors(model[0].weight, nn.Parameter(torch.randn(4, 4)))
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
        previous = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to(torch.float64)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(previous)
        torch.testing.assert_close(jitted(x.double()), model(x.double()), rtol=0, atol=0)


_IDLE_DROPOUTS = {
    "eval": lambda x: F.dropout(x, 0.5, training=False),
    "p 0 in training": lambda x: F.dropout(x, 0.0, training=True),
    "in place, eval": lambda x: F.dropout(x, 0.3, False, True),
    "module in eval": nn.Dropout(0.5).eval(),
    "torch.dropout": lambda x: torch.dropout(x, p=0.2, train=False),
}


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("name", list(_IDLE_DROPOUTS))
def test_a_dropout_that_drops_nothing_returns_its_input_itself(name, cache):
    """Eager's kernel returns the input itself; the compiled call returned a copy (torch's
    decomposition clones), so writes through it missed the input, and a strided input's
    copy had other strides."""
    fn = _IDLE_DROPOUTS[name]
    jitted = dtcompile.jit(fn, cache=cache)
    for x in (torch.randn(3, 4), torch.randn(5, 6)[1:, ::2]):
        assert fn(x) is x
        assert jitted(x) is x
    with torch.enable_grad():
        x = torch.randn(3, 4, requires_grad=True)
        jitted(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 4))


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_adaptive_average_pooling_to_one_of_a_channels_last_input(cache):
    """Eager's kernel restrides its mean in place (``as_strided_``, dims of size 1 only):
    refused as a change of a traced tensor's sizes or strides."""
    pool = nn.AdaptiveAvgPool2d(1)
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    assert_same_tensor(dtcompile.jit(pool, cache=cache)(x), pool(x))


class _TakesModule(torch.nn.Module):
    def forward(self, x, module=1.0):
        return x * module


class _PassesModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _TakesModule()

    def forward(self, x, module=1.0, fn=2.0):
        return self.inner(x, module=module) * fn


def _takes_self(t, self=1.0, cls=2.0):
    return t * self + cls


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_keyword_arguments_named_as_dtcompiles_own_parameters(cache):
    # ``module=`` to a submodule met the ``module`` of the wrapper patched over
    # nn.Module.__call__, ``self=`` that of the jitted function's __call__: a TypeError.
    model = _PassesModule()
    assert torch.equal(dtcompile.jit(model, cache=cache)(torch.ones(2), module=3.0, fn=0.5), torch.full((2,), 1.5))
    assert torch.equal(dtcompile.jit(_takes_self, cache=cache)(torch.ones(2), self=3.0, cls=1.0), torch.full((2,), 4.0))


def _repoint_a_detached_alias(x, y):
    z = x.detach()
    z.set_(y)
    return z * 1


def _repoint_a_whole_slice_then_write(x, y):
    z = x[:]
    z.set_(y)
    z.add_(1)
    return y * 2, x + 0


def _repoint_a_view_then_write_the_source(x, y):
    z = x.view_as(x)
    z.set_(y)
    w = z * 3
    y.mul_(2)
    return w, z + 0


@pytest.mark.parametrize(
    "fn", [_repoint_a_detached_alias, _repoint_a_whole_slice_then_write, _repoint_a_view_then_write_the_source]
)
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_set_on_an_alias_of_an_argument_leaves_the_argument(fn, cache):
    # The alias is an identity view, which the passes removed: set_ then re-pointed the
    # caller's own x at y's memory, silently.
    jitted = dtcompile.jit(fn, cache=cache)
    for n in (3, 3, 4):
        xe, ye = torch.zeros(n), torch.arange(n) + 1.0
        xc, yc = xe.clone(), ye.clone()
        assert_same_result(jitted(xc, yc), fn(xe, ye))
        assert torch.equal(xc, xe) and torch.equal(yc, ye)
        xc.add_(100)  # not y's memory
        assert torch.equal(yc, ye)


_SCRATCH = torch.zeros(3)


def _adds_to_its_default(x, scratch=_SCRATCH):
    scratch.add_(1)
    return x * 2


def test_a_default_argument_also_passed_is_refused_naming_both_ways():
    # The message spoke of a lookup in a table the code never made.
    with pytest.raises(dtcompile.TracingError, match="a default argument, a global, a table"):
        dtcompile.jit(_adds_to_its_default)(_SCRATCH)
