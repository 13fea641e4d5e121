"""Single process: autograd around a compiled training call where eager's rules are fine
grained: what autograd saves (and so checks and refuses), a second backward, and
torch.func's gradient transforms."""

import copy

import pytest
import torch

import dtcompile
from dtcompile.testing.compare import assert_same

CACHES = ["constant values", "symbolic values"]


def _run(fn, cache, x, w, between=None):
    """``fn(x, w).sum().backward()``, eager or compiled (``cache`` None: eager), with
    ``between`` run after the call: w's gradient, or the error raised."""
    called = fn if cache is None else dtcompile.jit(fn, cache=cache)
    try:
        y = called(x, w)
        if between is not None:
            between(x)
        y.sum().backward()
        return w.grad.clone()
    except RuntimeError as error:
        return error


_WRITES_BEFORE_THE_SAVE = {
    "x[:, 0].mul_(2); x * w": lambda x, w: (x[:, 0].mul_(2), x * w)[1],
    "x[:, :2] = 0; x @ w": lambda x, w: (x.__setitem__((slice(None), slice(0, 2)), 0.0), x @ w.unsqueeze(1))[1],
    "x.t().mul_(2); x * w": lambda x, w: (x.t().mul_(2), x * w)[1],
    "s = x.sum(); x[0].zero_(); x * w + s": lambda x, w: (s := x.sum(), x[0].zero_(), x * w + s)[2],
}


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", list(_WRITES_BEFORE_THE_SAVE))
def test_an_input_written_through_a_view_before_autograd_saves_it_is_eagers(name, cache):
    # Refused before: any read of the input (the view op itself) counted as its saving.
    fn = _WRITES_BEFORE_THE_SAVE[name]
    results = []
    for run_cache in (None, cache):
        torch.manual_seed(0)
        x, w = torch.randn(3, 4), torch.randn(4, requires_grad=True)
        results.append((_run(fn, run_cache, x, w), x))
    (expected, x_eager), (got, x_compiled) = results
    assert torch.equal(got, expected) and torch.equal(x_compiled, x_eager)


def _saves_the_input(x, w):
    return x * w


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
def test_an_inference_tensor_autograd_would_save_raises_eagers_error(cache):
    # An AttributeError-like RuntimeError from reading the input's version before.
    with torch.inference_mode():
        x = torch.randn(3, 4)
    w = torch.randn(4, requires_grad=True)
    expected = _run(_saves_the_input, None, x, w)
    got = _run(_saves_the_input, cache, x, w)
    assert isinstance(expected, RuntimeError) and type(got) is RuntimeError and str(got) == str(expected)


_MADE_UNDER_INFERENCE_MODE = {
    "a slice": lambda c, w: (c[:, :3] * w).sum(),
    "a transposed slice": lambda c, w: (c.t()[:3].t() * w).sum(),
    "a view, second": lambda c, w: (w * c.view(4, 5)[:, :3]).sum(),
    "an unsqueezed row": lambda c, w: (c[0, :3].unsqueeze(0) * w).sum(),
}


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("use", list(_MADE_UNDER_INFERENCE_MODE))
def test_a_view_of_an_inference_tensor_made_inside_raises_eagers_error_when_saved(use, cache):
    # A view (outside the mode) of a tensor made under inference mode inside the call is an
    # inference tensor, which autograd refuses to save: the compiled call ran and gave
    # gradients, where eager raises.
    def fn(x, w):
        with torch.inference_mode():
            c = x * 2
        return _MADE_UNDER_INFERENCE_MODE[use](c, w)

    x, w = torch.randn(5, 4), torch.randn(3, requires_grad=True)
    expected = _run(fn, None, x, w)
    for _ in range(2):
        got = _run(fn, cache, x, w)
        assert isinstance(expected, RuntimeError) and type(got) is RuntimeError and str(got) == str(expected)


_SIZES_ONLY = {
    "(x + w).sum()": lambda x, w: (x + w).sum(),
    "cat([x, w]).sin()": lambda x, w: torch.cat([x, w], 0).sin(),
    "(w.mean(0) + x.mean(0)).exp()": lambda x, w: (w.mean(0) + x.mean(0)).exp(),
}


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", list(_SIZES_ONLY))
def test_an_input_the_backward_needs_only_the_sizes_of_is_not_saved(name, cache):
    # Under symbolic values the forward saved the input for its sizes: refilled before the
    # backward, autograd's in-place error; made under inference_mode, refused at the call.
    fn = _SIZES_ONLY[name]

    def refill(x):
        with torch.no_grad():
            x.add_(1)

    torch.manual_seed(0)
    x, w = torch.randn(6, 4), torch.randn(6, 4, requires_grad=True)
    expected = _run(fn, None, x.clone(), w, refill)
    w.grad = None
    assert torch.equal(_run(fn, cache, x.clone(), w, refill), expected)
    with torch.inference_mode():
        x = torch.randn(6, 4)
    w.grad = None
    expected = _run(fn, None, x, w)
    w.grad = None
    assert torch.equal(_run(fn, cache, x, w), expected)


class _Features(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone, self.head = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)

    def forward(self, x):
        h = self.backbone(x)
        return self.head(h.tanh()), h, h[0]


# (None-safe hooks: torch calls a hook on an output of a node that got no gradient of its
# own with None, where eager's graph would not call it: README, "Status")
_ON_FEATURES = {
    "reversing hook": lambda h: h.register_hook(lambda g: None if g is None else -g),
    "zeroing hook": lambda h: h.register_hook(lambda g: None if g is None else g * 0),
    "retain_grad": lambda h: h.retain_grad(),
}
_LOSSES = {
    "head only": lambda y, h, h0: y.sum(),
    "head and features": lambda y, h, h0: y.sum() + h.sum(),
    "a view of the features": lambda y, h, h0: h0.sum(),
}


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("loss", list(_LOSSES))
@pytest.mark.parametrize("put", list(_ON_FEATURES))
def test_a_hook_on_an_output_others_were_computed_from_is_refused_at_backward(put, loss, cache):
    # The outputs are one node: a hook on ``h`` (a gradient reversal on returned features)
    # saw only h's own gradient, not what came back through ``head(h.tanh())``, and the
    # parameters' gradients differed from eager's, silently.
    torch.manual_seed(0)
    model, x = _Features(), torch.randn(5, 4)
    jitted = dtcompile.jit(copy.deepcopy(model), cache=cache)
    for _ in range(2):
        y, h, h0 = jitted(x)
        _ON_FEATURES[put](h)
        with pytest.raises(RuntimeError, match="other outputs of the call were computed from it"):
            _LOSSES[loss](y, h, h0).backward()


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("put", list(_ON_FEATURES))
def test_a_hook_on_an_output_runs_as_eager_where_no_gradient_comes_through_others(put, cache):
    # Only ``h``'s own gradient arrives (the head's output is unused): the hook sees what
    # eager's sees. A hook on the head's output, which nothing else was computed from, too
    # (the gradients accumulate over both backwards).
    torch.manual_seed(0)
    model, x = _Features(), torch.randn(5, 4)
    jitted = dtcompile.jit(copy.deepcopy(model), cache=cache)
    for _ in range(2):
        grads = []
        for called in (model, jitted):
            called.zero_grad(set_to_none=True)
            y, h, _ = called(x)
            _ON_FEATURES[put](h)
            (h.sum() * 2).backward()
            y, h, _ = called(x)
            _ON_FEATURES[put](y)
            (h.sum() + y.sum()).backward()
            grads.append([p.grad for p in called.parameters()])
        for eager, compiled in zip(*grads):
            assert (eager is None) == (compiled is None)
            assert eager is None or torch.equal(eager, compiled)


_TAKEN_AT_FEATURES = {
    "grad of the head and features at the features": lambda y, h: torch.autograd.grad(y.sum() + h.sum(), h),
    "grad of the head at the features": lambda y, h: torch.autograd.grad(y.sum(), h, allow_unused=True),
    "grad at the features and the head": lambda y, h: torch.autograd.grad(y.sum() + h.sum(), [h, y]),
    "backward with the features as inputs": lambda y, h: (y.sum() + h.sum()).backward(inputs=[h]),
}


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("taken", list(_TAKEN_AT_FEATURES))
def test_a_gradient_taken_at_an_output_others_were_computed_from_is_refused(taken, cache):
    # A saliency map at returned features (torch.autograd.grad of the head's output at
    # them): the outputs are one node, so autograd took the gradient that reached ``h``
    # directly, without what came back through the head: ones, or None, silently.
    torch.manual_seed(0)
    model, x = _Features(), torch.randn(5, 4)
    jitted = dtcompile.jit(copy.deepcopy(model), cache=cache)
    for _ in range(2):
        y, h, _ = jitted(x)
        with pytest.raises(RuntimeError, match="asked for the gradient of an output|keeps its gradient"):
            _TAKEN_AT_FEATURES[taken](y, h)


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
def test_gradients_taken_where_nothing_came_through_other_outputs_are_eager_s(cache):
    # At the parameters (the node runs), and at the features where the head's output got
    # no gradient: as eager's, and the hooks watching the head's output leave no trace.
    torch.manual_seed(0)
    model, x = _Features(), torch.randn(5, 4)
    jitted = dtcompile.jit(copy.deepcopy(model), cache=cache)
    for _ in range(2):
        results = []
        for called in (model, jitted):
            y, h, _ = called(x)
            at_params = torch.autograd.grad(y.sum() + h.sum(), list(called.parameters()))
            y, h, _ = called(x)
            at_features = torch.autograd.grad((h * h).sum(), h)
            results.append([*at_params, *at_features, called(x)[0].grad_fn is not None])
        for eager, compiled in zip(*results):
            assert eager == compiled if isinstance(eager, bool) else torch.equal(eager, compiled)


def _two_heads(x, w1, w2):
    return (x * w1).sum(), (x * w2).sum()


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
def test_a_second_backward_after_one_of_other_outputs_is_a_clear_error(cache):
    # Eager's graphs of the two are apart; the compiled call's outputs are one node, whose
    # saved values the first backward freed: autograd's message told to retain the graph.
    x, w1, w2 = torch.randn(3), torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    l1, l2 = _two_heads(x, w1, w2)
    l1.backward()
    l2.backward()
    jitted = dtcompile.jit(_two_heads, cache=cache)
    l1, l2 = jitted(x, w1, w2)
    l1.backward()
    with pytest.raises(RuntimeError, match="one autograd node.*torch.autograd.backward"):
        l2.backward()
    w1.grad = w2.grad = None
    torch.autograd.backward(list(jitted(x, w1, w2)))
    assert torch.equal(w1.grad, x) and torch.equal(w2.grad, x)
    l1, _ = jitted(x, w1, w2)
    l1.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):  # eager's, as eager
        l1.backward()


def _nothing_saved(x, w):
    return (x + w).sum()


def _scalar_saved(x, w):
    return (x + w * 0.5).sum() + w.sum() / 3.0  # (w * 0.5 saves the scalar; the program, nothing)


@pytest.mark.parametrize("cache", CACHES)
def test_a_second_backward_where_eagers_graph_saved_a_scalar_raises_as_eager(cache):
    # The program saved no tensor, so a second backward without retain_graph ran and
    # added the gradients again, where eager's freed the scalar its node saved and raised.
    x, w = torch.randn(6, 4), torch.randn(6, 4, requires_grad=True)
    for fn in (_scalar_saved, dtcompile.jit(_scalar_saved, cache=cache)):
        y = fn(x, w)
        y.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            y.backward()
        y = fn(x, w)
        y.backward(retain_graph=True)
        y.backward()  # (retained: runs, in both)


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
def test_a_graph_that_saves_nothing_can_be_differentiated_twice_as_in_eager(cache):
    x, w = torch.randn(6, 4), torch.randn(6, 4, requires_grad=True)
    y = dtcompile.jit(_nothing_saved, cache=cache)(x, w)
    y.backward()
    y.backward()
    assert torch.equal(w.grad, torch.full((6, 4), 2.0))


def _gradient_transform_inside(x, w):
    return torch.func.grad(lambda r: (r**3).sum())(x) * w


@pytest.mark.parametrize("cache", CACHES)
def test_torch_func_gradient_transforms_are_refused_saying_what_to_write(cache):
    # The refusal told to apply torch.func transforms inside the call, which this one does.
    x, w = torch.randn(3), torch.randn(3)
    with pytest.raises(dtcompile.TracingError, match="torch.func's transforms .* torch.autograd.grad"):
        dtcompile.jit(_gradient_transform_inside, cache=cache)(x, w)


def _squashed(x, w):
    return torch.tanh(x @ w).pow(2).sum()


@pytest.mark.parametrize("cache", CACHES)
def test_torch_func_around_a_compiled_call_is_refused_once_it_holds_a_training_entry(cache):
    # A warm entry's guards took the transform's wrapped tensor; its autograd Function then
    # raised torch's error about a Function the user never wrote.
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    jf = dtcompile.jit(_squashed, cache=cache)
    jf(x, w.clone().requires_grad_())
    with pytest.raises(dtcompile.TracingError, match="torch.func's transforms .*torch.func.grad around"):
        torch.func.grad(jf, argnums=1)(x, w)
    with pytest.raises(dtcompile.TracingError, match="torch.func's transforms"):
        torch.func.vmap(jf, (None, 0))(x, w.clone().requires_grad_()[None].expand(2, 3, 5))
    # Cold, vmap is refused while tracing, with the same advice.
    with pytest.raises(dtcompile.TracingError, match="torch.func's transforms .*BatchedTensorImpl"):
        torch.func.vmap(dtcompile.jit(_squashed, cache=cache), (0, None))(x[None].expand(2, 4, 3), w)


_BASE = torch.randn(4, 3, requires_grad=True)
_HELD = {"w": _BASE * 2}  # a non-leaf the call closes over: the traced code gets a leaf stand-in


def _grad_of_the_held(x):
    return torch.autograd.grad((x @ _HELD["w"]).sum(), [_HELD["w"]], retain_graph=True)[0]


def _grad_of_its_base(x):
    return torch.autograd.grad((x @ _HELD["w"]).sum(), [_BASE], allow_unused=True, materialize_grads=True)[0]


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
def test_autograd_grad_inside_with_respect_to_a_closed_over_non_leaf(cache):
    # Autograd was given the real tensor, in no traced graph: an error; with respect to its
    # base, zeros with allow_unused (eager's gradient runs through the graph outside).
    x = torch.randn(5, 4)
    assert torch.allclose(dtcompile.jit(_grad_of_the_held, cache=cache)(x), _grad_of_the_held(x))
    with pytest.raises(dtcompile.TracingError, match="reaches only through a tensor it closes over"):
        dtcompile.jit(_grad_of_its_base, cache=cache)(x)


class _ClampsItsScale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.scale = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        with torch.no_grad():
            self.scale[:2].clamp_(min=0)
        return self.lin(x) * self.scale


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
def test_a_parameter_written_through_a_view_under_no_grad_before_its_use_is_eagers(cache):
    # A view made under no_grad saves nothing: counted as the saving read, it was refused.
    torch.manual_seed(0)
    eager, x = _ClampsItsScale(), torch.randn(5, 4)
    compiled = copy.deepcopy(eager)
    eager(x).sum().backward()
    dtcompile.jit(compiled, cache=cache)(x).sum().backward()
    assert torch.equal(compiled.scale, eager.scale)
    for got, expected in zip(compiled.parameters(), eager.parameters()):
        assert torch.allclose(got.grad, expected.grad)


def _gather_sum(x, idx):
    return x.gather(1, idx).sum()


@torch.enable_grad()
def test_check_eager_writes_back_only_what_the_call_wrote():
    # It copied every input and parameter back in place: their versions moved, and an
    # eager graph that saved one (an index), or two calls before one backward, failed.
    jitted = dtcompile.jit(_gather_sum, check="eager")
    idx = torch.tensor([[0], [2], [1]])
    x = torch.randn(3, 4, requires_grad=True)
    eager_loss = _gather_sum(x, idx)
    jitted(x.detach().clone().requires_grad_(), idx).backward()
    eager_loss.backward()
    assert idx._version == 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    checked = dtcompile.jit(model, check="eager")
    x = torch.randn(3, 4, requires_grad=True)
    versions = [p._version for p in model.parameters()]
    (checked(x).sum() + checked(x * 2).sum()).backward()
    assert [p._version for p in model.parameters()] == versions


def _sum_then_written_then_used(x, w):
    y = x.sum()  # autograd saves nothing of x here
    with torch.no_grad():
        x[1:].fill_(1)
    return y + (x * w).sum()


@pytest.mark.parametrize("cache", CACHES)
def test_an_input_used_by_an_op_saving_nothing_of_it_then_written_is_eagers(cache):
    # Any op autograd recorded counted as the saving read: refused as eager's error.
    results = []
    for run_cache in (None, cache):
        torch.manual_seed(0)
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
        fn = (
            _sum_then_written_then_used
            if run_cache is None
            else dtcompile.jit(_sum_then_written_then_used, cache=cache)
        )
        with torch.enable_grad():
            fn(x, w).backward()
        results.append((x.grad, w.grad))
    assert torch.allclose(results[1][0], results[0][0]) and torch.allclose(results[1][1], results[0][1])


class _AuxLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        return self.b(h) + x, h.pow(2).mean()


class _AuxLayers(torch.nn.Module):
    """Repeated layers (from the third on, replayed as one autograd node each), each
    returning an auxiliary loss besides its output."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(_AuxLayer() for _ in range(n))

    def forward(self, x):
        auxs = []
        for layer in self.layers:
            x, aux = layer(x)
            auxs.append(aux)
        return x, auxs


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("used", [(2,), (1, 3), (5,), (0, 4)])
def test_a_replayed_layers_parameter_only_unused_outputs_reach_gets_no_gradient(used, cache):
    # A layer's ``b`` reaches only its first output, which the loss does not use: eager
    # leaves its gradient None, and AdamW's weight decay then leaves it alone.
    torch.manual_seed(1)
    eager = _AuxLayers(6)
    compiled = copy.deepcopy(eager)
    x = torch.randn(3, 4)
    for model, call in ((eager, eager), (compiled, dtcompile.jit(compiled, cache=cache))):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        _, auxs = call(x)
        sum(auxs[i] for i in used).backward()
        optimizer.step()
    for (name, e), c in zip(eager.named_parameters(), compiled.parameters()):
        assert (e.grad is None) == (c.grad is None), name
        assert torch.equal(e, c), name
    unused = torch.autograd.grad  # with respect to an unused parameter: None, or eager's error
    _, auxs = dtcompile.jit(compiled, cache=cache)(x)
    assert unused(auxs[used[-1]], [compiled.layers[used[-1]].b.weight], allow_unused=True) == (None,)
    _, auxs = dtcompile.jit(compiled, cache=cache)(x)
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        unused(auxs[used[-1]], [compiled.layers[used[-1]].b.weight])


def _hooked_steps(compiled: bool, cache: str, how: str) -> tuple:
    """Two training calls of a function closing over parameters with hooks registered before
    compiling: the gradients, and what the hooks logged."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 3)
    w = torch.nn.Parameter(torch.ones(3))
    log = []
    if how == "changes the gradient":
        w.register_hook(lambda g: g * 2)
        linear.weight.register_hook(lambda g: g.clamp(-0.5, 0.5))
    elif how == "logs":
        w.register_hook(lambda g: log.append(g.norm()))
    else:  # a multi-grad hook (torch's, over several tensors)
        torch.autograd.graph.register_multi_grad_hook((w, linear.weight), lambda grads: log.append(len(grads)))

    def loss(x):
        return (linear(x * w) ** 2).sum()

    step = dtcompile.jit(loss, cache=cache) if compiled else loss
    for i in range(2):
        step(torch.ones(2, 3) * (i + 1)).backward()
    return w.grad, linear.weight.grad, log


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("how", ["changes the gradient", "logs", "multi-grad"])
def test_hooks_on_closed_over_parameters_run_as_eagers(how, cache):
    # They ran while the backward was traced too: a gradient changed twice, a log once more
    # (holding a traced value).
    eager, compiled = _hooked_steps(False, cache, how), _hooked_steps(True, cache, how)
    torch.testing.assert_close(compiled[:2], eager[:2])
    assert len(compiled[2]) == len(eager[2]) and all(type(x) is type(y) for x, y in zip(compiled[2], eager[2]))
    torch.testing.assert_close(compiled[2], eager[2])


@pytest.mark.parametrize("cache", CACHES)
def test_a_post_accumulate_hook_registered_on_a_closed_over_parameter_is_refused(cache):
    # Eager registers one more at each call; the compiled call registered it once, while tracing.
    w = torch.nn.Parameter(torch.ones(3))

    def loss(x):
        w.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(3))
        return (x * w).sum()

    with pytest.raises(dtcompile.TracingError, match="register_post_accumulate_grad_hook on a tensor the call closes"):
        dtcompile.jit(loss, cache=cache)(torch.ones(3))


_VIEW_WRITES = {
    "x[0].mul_(2)": lambda x: x[0].mul_(2),
    "x.t().add_(1)": lambda x: x.t().add_(1),
    "x.view(-1)[:2].zero_()": lambda x: x.view(-1)[:2].zero_(),
    "x[:, :1] = 0": lambda x: x.__setitem__((slice(None), slice(None, 1)), 0),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("write", sorted(_VIEW_WRITES))
def test_a_write_through_a_view_of_a_non_leaf_argument_is_a_clear_error(write, cache):
    # Eager runs it (the argument is no leaf); the trace's stand-in is one, so torch's error
    # spoke of a leaf the caller does not have.
    def fn(x, w):
        _VIEW_WRITES[write](x)
        return (x * w).sum()

    a = torch.randn(2, 2, requires_grad=True)
    with pytest.raises(
        dtcompile.TracingError, match="changes args\\[0\\] in place, a tensor that requires grad and is"
    ):
        dtcompile.jit(fn, cache=cache)(a * 1, torch.randn(2, 2))


class _RetainingMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        h = self.a(x)
        h.retain_grad()  # the input of the repeated linears, whose backward is replayed
        return self.c(self.b(h)) + h


@pytest.mark.parametrize("cache", CACHES)
def test_retain_grad_on_the_input_of_a_repeated_block(cache):
    # The retained gradient's hook ran in the block's backward template (a raw TraceError).
    torch.manual_seed(0)
    eager = _RetainingMLP()
    compiled = copy.deepcopy(eager)
    x = torch.randn(3, 4)
    eager(x).sum().backward()
    dtcompile.jit(compiled, cache=cache)(x).sum().backward()
    for (name, e), c in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(c.grad, e.grad, msg=name)


class _PenalizedLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        (g,) = torch.autograd.grad(h.pow(2).sum(), self.a.weight, create_graph=True)  # a penalty's gradient
        return self.b(h) + 0.1 * g.sum()


@pytest.mark.parametrize("cache", CACHES)
def test_a_gradient_made_with_create_graph_inside_repeated_layers(cache):
    # A replayed linear's recorded backward had no graph of its own: the second-order terms
    # through ``g`` were lost from every layer's gradients after the second.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(*(_PenalizedLayer() for _ in range(4)))
    compiled = copy.deepcopy(eager)
    x = torch.randn(3, 4, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    eager(x).pow(2).sum().backward()
    dtcompile.jit(compiled, cache=cache)(x2).pow(2).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    for (name, e), c in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(c.grad, e.grad, msg=name)


class _RetainingLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        h.retain_grad()  # (a debugging habit) on a linear's output, in each of repeated layers
        return torch.tanh(h) + x


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("layers", [1, 4])
def test_retain_grad_inside_repeated_layers(layers, cache):
    torch.manual_seed(0)
    eager = torch.nn.Sequential(*(_RetainingLayer() for _ in range(layers)))
    compiled = copy.deepcopy(eager)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        eager(x).pow(2).sum().backward()
        dtcompile.jit(compiled, cache=cache)(x).pow(2).sum().backward()
    for (name, e), c in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(c.grad, e.grad, msg=name)


class _TanhLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.a(x)) + x


class _InferenceBranch(torch.nn.Module):
    """Repeated layers, the last run under ``inference_mode`` on a view of the output of
    the replayed ones (whose fakes are made when first read)."""

    def __init__(self, view):
        super().__init__()
        self.layers = torch.nn.ModuleList(_TanhLayer() for _ in range(4))
        self.view = view

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = layer(x)
        with torch.inference_mode():
            y = self.layers[-1](self.view(x))
        return x + y.clone()


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("view", ["detach", "slice", "view", "t"])
def test_a_view_made_under_inference_mode_of_a_replayed_layers_output(view, grad, cache):
    # Raised "Cannot set version_counter for inference tensor": the replayed output's fake,
    # made when first read, was made under inference mode.
    views = {"detach": lambda x: x.detach(), "slice": lambda x: x[:], "view": lambda x: x.view(3, 4)}
    torch.manual_seed(0)
    eager = _InferenceBranch(views.get(view, lambda x: x.t().t())).requires_grad_(grad)
    compiled = copy.deepcopy(eager)
    x = torch.randn(3, 4)
    torch.testing.assert_close(dtcompile.jit(compiled, cache=cache)(x), eager(x))


class _HookScaledByBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 3.0))

    def forward(self, x):
        h = self.lin(x)
        scale = self.scale
        h.register_hook(lambda g: g * scale)  # closes over a tensor of the call
        return h.tanh()


@pytest.mark.parametrize("cache", CACHES)
def test_a_hook_closing_over_a_tensor_of_the_call(cache):
    # Refused as a change of that tensor's ``__dict__``: the stand-in's own attributes
    # (its fake, made when first read) were compared.
    def fn(x, w, a):
        h = x @ w
        h.register_hook(lambda g: g * a)
        return h.sin().sum()

    x, a = torch.randn(3, 4), torch.randn(3, 4)
    for compiled in (False, True):
        w = torch.ones(4, 4, requires_grad=True)
        (dtcompile.jit(fn, cache=cache) if compiled else fn)(x, w, a).backward()
        if not compiled:
            expected = w.grad
    torch.testing.assert_close(w.grad, expected)
    torch.manual_seed(0)
    eager = _HookScaledByBuffer()
    module = copy.deepcopy(eager)
    eager(x).sum().backward()
    dtcompile.jit(module, cache=cache)(x).sum().backward()
    torch.testing.assert_close(module.lin.weight.grad, eager.lin.weight.grad)


class _HandMadeCache(torch.nn.Module):
    """A KV cache kept as a list and a dict of tensors on the module, written in place."""

    def __init__(self):
        super().__init__()
        self.caches = [torch.zeros(3)]
        self.table = {"k": torch.zeros(3)}

    def forward(self, x):
        self.caches[0].add_(x)
        self.table["k"].add_(2 * x)
        return x * 2


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("how", ["module's list and dict", "inference mode", ".data"])
def test_check_eager_puts_back_what_no_version_counts(how, cache):
    # Written twice (eager's run, then the program's), with a false mismatch reported:
    # the state was put back only where a version counter had moved.
    x = torch.ones(3)
    if how == "module's list and dict":
        module = _HandMadeCache()
        dtcompile.jit(module, cache=cache, check="eager")(x)
        assert torch.equal(module.caches[0], x) and torch.equal(module.table["k"], 2 * x)
        return

    def fn(y, state):
        (state.data if how == ".data" else state).add_(y)  # (an inference tensor counts no version)
        return y * 2

    with torch.inference_mode() if how == "inference mode" else torch.no_grad():
        state = torch.zeros(3)
        dtcompile.jit(fn, cache=cache, check="eager")(x, state)
    assert torch.equal(state, x)


@pytest.mark.parametrize("cache", CACHES)
def test_forward_mode_ad_through_a_call_with_gradients_is_refused_clearly(cache):
    # torch's error spoke of a jvp the user's Function lacks: dtcompile's own Function.
    import torch.autograd.forward_ad as fwAD

    w = torch.randn(3, 3, requires_grad=True)
    jf = dtcompile.jit(lambda x: (x @ w).tanh(), cache=cache)
    with fwAD.dual_level(), pytest.raises(dtcompile.TracingError, match="forward-mode AD"):
        jf(fwAD.make_dual(torch.randn(2, 3), torch.randn(2, 3)))


def _sign_of_scaled(x):
    return (x * 2.0).sgn()


def _sign_in_place(x):
    y = x * 1.0
    y.sgn_()
    return y


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("fn", [_sign_of_scaled, _sign_in_place])
def test_a_backward_through_a_memoryless_zero_gradient_compiles(fn, cache):
    # sgn's gradient of a real input is torch's memory-less zero tensor; tracing ran mul's
    # backward on it for real, to know its value while tracing, and the process died (SIGSEGV).
    x = torch.randn(4, 3, requires_grad=True)
    expected = torch.autograd.grad(fn(x).sum(), x)
    assert_same(torch.autograd.grad(dtcompile.jit(fn, cache=cache)(x).sum(), x), expected)


class _NormFirst(torch.nn.Module):
    """torch's RMSNorm on the call's input (its saved tensors come from several ops), then
    dropout: what a checkpointed transformer block starts with."""

    def __init__(self):
        super().__init__()
        self.norm, self.a, self.b = torch.nn.RMSNorm(4), torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(self.norm(x)))))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("around", ["the module", "a function calling it"])
def test_a_checkpoint_around_a_compiled_call_gives_eagers_gradients(cache, around):
    """``checkpoint(dtcompile.jit(block), x, use_reentrant=False)`` (torchtitan's order):
    the checkpoint's recompute ran the block on the real inputs while the backward was
    traced (a raw error under TP, a compile per step here), and dropout inside was refused
    as a compiled checkpoint's. The call now saves what it saves itself."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    eager = _NormFirst()
    model = copy.deepcopy(eager)
    jitted = dtcompile.jit(model, cache=cache)

    def wrapped(block):
        return block if around == "the module" else (lambda x: block(x) * 2)

    for step in range(3):
        x = torch.randn(step + 2, 4, requires_grad=True)
        grads = []
        for block in (eager, jitted):
            torch.manual_seed(step)
            inputs = x.detach().clone().requires_grad_()
            checkpoint(wrapped(block), inputs, use_reentrant=False).pow(2).sum().backward()
            grads.append([inputs.grad] + [p.grad for p in (eager if block is eager else model).parameters()])
        for got, expected in zip(grads[1], grads[0]):
            assert_same(got, expected)
    assert dtcompile.cache_misses(jitted) == (1 if cache == "symbolic values" else 3)


@torch.enable_grad()
@pytest.mark.parametrize("cache", CACHES)
def test_a_training_call_under_allow_mutation_on_saved_tensors_is_refused(cache):
    # Eager clones a saved tensor written after the call; the compiled step's own saves are
    # not seen by that context: its backward raised autograd's raw in-place error.
    jitted = dtcompile.jit(lambda x, w: (x * w).sin().sum(), cache=cache)
    x, w = torch.randn(4), torch.randn(4, requires_grad=True)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        with pytest.raises(dtcompile.TracingError, match="allow_mutation_on_saved_tensors"):
            jitted(x, w)
    jitted(x, w).backward()  # outside it, the call runs
    torch.testing.assert_close(w.grad, x * (x * w).cos(), rtol=0, atol=0)
