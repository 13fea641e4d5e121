"""Effects of a call that reach past it, in one process: eager's results or a clear error.

Each case was silently wrong or crashed before: autocast's cast cache kept a proxy,
``backward()`` inside lost its gradients, hooks and ``retain_grad`` on the call's tensors,
Python attributes set on tensors, tensors turned into text, storage reads, inference
tensors, and torch ops that take no symbolic sizes."""

import copy
import io
import logging
import pickle

import pytest
import torch

import dtcompile
from dtcompile.core import TracingError

CACHES = ["constant values", "symbolic values"]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("how", ["function", "module", "second jitted"])
def test_eager_calls_after_a_compiled_call_in_one_autocast_region(cache, how):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    jitted = dtcompile.jit(lin if how == "module" else (lambda a: lin(a)), cache=cache)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = lin(x)
        compiled = jitted(x)
        if how == "second jitted":
            after = dtcompile.jit(lambda a: lin(a) * 2, cache=cache)(x) / 2
        else:
            after = lin(x)  # autocast's cache of the weight's cast must hold no proxy
    assert compiled.dtype == after.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, expected, rtol=0, atol=0)
    torch.testing.assert_close(after, expected, rtol=0, atol=0)


def _step(a, w):
    loss = (a * w).sum()
    loss.backward()
    return loss.detach()


def _step_autograd(a, w):
    loss = (a * w).sum()
    torch.autograd.backward(loss)
    return loss


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("fn", [_step, _step_autograd])
def test_backward_inside_the_call_is_refused(cache, fn):
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(TracingError, match="accumulates gradients"):
        dtcompile.jit(fn, cache=cache)(torch.arange(3.0), w)
    assert w.grad is None


@pytest.mark.parametrize("cache", CACHES)
def test_autograd_grad_inside_the_call_still_works(cache):
    def penalty(w):
        y = (w * w).sum()
        (g,) = torch.autograd.grad(y, w, create_graph=True)
        return g.sum()

    w = torch.arange(3.0, requires_grad=True)
    torch.testing.assert_close(dtcompile.jit(penalty, cache=cache)(w), penalty(w))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", ["leaf", "non-leaf", "module parameter"])
def test_a_hook_registered_on_a_tensor_of_the_call_is_refused(cache, kind):
    if kind == "module parameter":

        class Hooked(torch.nn.Linear):
            def forward(self, x):
                self.weight.register_hook(lambda g: g * 10)
                return super().forward(x)

        fn, args = Hooked(3, 3), (torch.ones(2, 3),)
    else:
        w = torch.ones(3, requires_grad=True)
        fn, args = (lambda a: (a.register_hook(lambda g: g * 10), (a * 2).sum())[1]), (w if kind == "leaf" else w * 1,)
    with pytest.raises(TracingError, match="register_hook on .*a tensor the call received"):
        dtcompile.jit(fn, cache=cache)(*args)


@pytest.mark.parametrize("cache", CACHES)
def test_a_hook_on_a_tensor_made_inside_acts_as_in_eager(cache):
    def f(a):
        y = a * 2
        y.register_hook(lambda g: g * 10)
        return (y * y).sum()

    grads = []
    for fn in (f, dtcompile.jit(f, cache=cache)):
        w = torch.arange(3.0, requires_grad=True)
        fn(w).backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("cache", CACHES)
def test_retain_grad_on_an_output_or_a_received_non_leaf_is_refused(cache):
    def returned(a):
        y = a * 2
        y.retain_grad()
        return y, (y * y).sum()

    with pytest.raises(TracingError, match="retain_grad"):
        dtcompile.jit(returned, cache=cache)(torch.ones(2, requires_grad=True))
    with pytest.raises(TracingError, match="retain_grad.*not a leaf"):
        dtcompile.jit(lambda a: (a.retain_grad(), a.sum())[1], cache=cache)(torch.ones(2, requires_grad=True) * 2)


@pytest.mark.parametrize("cache", CACHES)
def test_retain_grad_on_an_intermediate_or_a_leaf_changes_nothing(cache):
    def f(a):
        a.retain_grad()
        y = a * 2
        y.retain_grad()
        return (y * y).sum()

    w = torch.arange(3.0, requires_grad=True)
    dtcompile.jit(f, cache=cache)(w).backward()
    torch.testing.assert_close(w.grad, 8 * torch.arange(3.0))


def _set_on_input(a):
    a.tag = "seen"
    return a * 2


def _set_on_output(a):
    y = a * 2
    y.note = 5
    return y


def _rebind_carried(a):
    a.count = a.count + 1
    return a * a.count


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("fn", [_set_on_input, _set_on_output, _rebind_carried])
def test_python_attributes_set_on_tensors_are_refused(cache, fn):
    x = torch.ones(2)
    x.count = 1
    with pytest.raises(TracingError, match="attribute '(tag|note|count)'"):
        dtcompile.jit(fn, cache=cache)(x)
    assert vars(x) == {"count": 1}


@pytest.mark.parametrize("cache", CACHES)
def test_python_attributes_read_from_tensors_still_work(cache):
    x = torch.ones(2)
    x.count = 3
    torch.testing.assert_close(dtcompile.jit(lambda a: a * a.count, cache=cache)(x), x * 3)


_log = logging.getLogger("tests.call_effects")


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn",
    [
        lambda a: str(a),
        lambda a: (repr(a * 2), a)[1],
        lambda a: f"{a.sum():.2f}",
        lambda a: (print(a), a)[1],
        lambda a: (_log.warning("a is %s", a), a)[1],  # logging catches the error: still refused
    ],
    ids=["str", "repr", "format", "print", "logging"],
)
def test_a_tensor_turned_into_text_is_refused(cache, fn, capsys):
    with pytest.raises(TracingError, match="into text"):
        dtcompile.jit(fn, cache=cache)(torch.ones(2))


@pytest.mark.parametrize("cache", CACHES)
def test_logging_that_prints_no_tensor_is_not_a_side_effect(cache):
    def f(a):
        _log.debug("shape %s", tuple(a.shape))  # fills the logger's cache of enabled levels
        return a * 2

    torch.testing.assert_close(dtcompile.jit(f, cache=cache)(torch.ones(2)), torch.full((2,), 2.0))


@pytest.mark.parametrize("cache", CACHES)
def test_storage_reads_are_refused(cache):
    with pytest.raises(TracingError, match="untyped_storage"):
        dtcompile.jit(lambda a: a.untyped_storage().nbytes(), cache=cache)(torch.arange(10.0)[:3])


_W = torch.ones(3)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda a, b: a + a._is_view(), r"_is_view\(\) of args\[0\]"),
        (lambda a, b: a + (a._base is None), r"\._base of args\[0\]"),
        (lambda a, b: b * a._version, r"\._version of args\[0\]"),
        (lambda a, b: a + a.is_shared(), r"is_shared\(\) of args\[0\]"),
        (lambda a, b: a + _W._version, "closes over"),
        (lambda a, b: a + a.is_set_to(b), "is_set_to"),
        (lambda a, b: torch.from_dlpack(a.__dlpack__()) + 1, "__dlpack__"),
        (lambda a, b: torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(a)) + 1, "to_dlpack"),
    ],
    ids=["_is_view", "_base", "_version", "is_shared", "closed-over _version", "is_set_to", "__dlpack__", "to_dlpack"],
)
def test_what_the_callers_tensor_is_beside_its_metadata_is_refused(cache, fn, match):
    base = torch.arange(6.0)
    a = base[:3]
    a.add_(1)  # a view, written once: eager's answers differ from a fresh tensor's
    with pytest.raises(TracingError, match=match):
        dtcompile.jit(fn, cache=cache)(a, base[:3])


def _saved(a):
    buffer = io.BytesIO()
    torch.save(a, buffer)
    return a + len(buffer.getvalue())


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn, match",
    [
        (_saved, "pickled"),
        (lambda a: a + len(pickle.dumps(a)), "pickled"),
        (lambda a: copy.deepcopy(a) + 1, "deepcopy"),
        (lambda a: torch.tensor([a[0], a[1]]) + 1, "torch.tensor"),
        (lambda a: torch.as_tensor([a[0] * 2]), "torch.as_tensor"),
        (lambda a: a.to_sparse().to_dense() + 1, "to_sparse"),
        (lambda a: a.clone().share_memory_() + 1, "share_memory_"),
    ],
    ids=["torch.save", "pickle", "deepcopy", "torch.tensor of a list", "as_tensor", "to_sparse", "share_memory_"],
)
def test_what_a_traced_tensor_cannot_hand_over_is_refused(cache, fn, match):
    # Each ran in eager and crashed while tracing (an internal error, a segfault for DLPack).
    fn(torch.arange(3.0))
    with pytest.raises(TracingError, match=match):
        dtcompile.jit(fn, cache=cache)(torch.arange(3.0))


@pytest.mark.parametrize("cache", CACHES)
def test_views_and_versions_of_tensors_made_inside_are_eagers(cache):
    def f(a):
        m = a * 1
        v = m.t()
        before = v._version
        v.mul_(2)
        return m, v._is_view(), v._base is m, v._version - before, m._version

    expected = f(torch.ones(2, 3))
    got = dtcompile.jit(f, cache=cache)(torch.ones(2, 3))
    torch.testing.assert_close(got[0], expected[0])
    assert got[1:] == expected[1:] == (True, True, 1, 1)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("attribute", ["_version", "_base"])
def test_a_view_of_a_received_tensor_answers_as_the_callers(cache, attribute):
    # The view shares the caller's tensor's version counter, and its base is that tensor's base.
    with pytest.raises(TracingError, match=rf"\.{attribute} of args\[0\]"):
        dtcompile.jit(lambda a: (a.t() * 1, getattr(a.t(), attribute)), cache=cache)(torch.ones(2, 3)[:1])


@pytest.mark.parametrize("cache", CACHES)
def test_is_inference_is_the_call_tensors_and_guarded(cache):
    jitted = dtcompile.jit(lambda a: (a * 2, a.is_inference()), cache=cache)
    with torch.inference_mode():
        inference = torch.ones(2)
    normal = torch.ones(2)
    assert jitted(normal)[1] is False
    assert jitted(inference)[1] is True
    with torch.inference_mode():
        assert dtcompile.jit(lambda a: a.is_inference(), cache=cache)(normal) is False


def test_symbolic_sizes_torch_cannot_take_are_refused_by_name():
    generator = torch.Generator().manual_seed(0)

    def draw(a):
        return a + torch.rand(a.shape, generator=generator)

    with pytest.raises(TracingError, match="torch.rand cannot take symbolic sizes"):
        dtcompile.jit(draw, cache="symbolic values")(torch.zeros(2))
    expected = draw(torch.zeros(2))
    generator.manual_seed(0)
    torch.testing.assert_close(dtcompile.jit(draw)(torch.zeros(2)), expected)


@pytest.mark.parametrize("cache", CACHES)
def test_a_global_dict_keyed_by_a_parameter(cache):
    lin = torch.nn.Linear(4, 4)
    scales = {lin.weight: 2.0}

    def f(x):
        return lin(x) * scales.get(lin.weight, 1.0)

    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(dtcompile.jit(f, cache=cache)(x), f(x))


class _HoldsATuple(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.context = ({"scale": 1.0},)

    def forward(self, x):
        self.context[0]["scale"] = 2.0  # a side effect on a dict a tuple attribute holds
        return self.lin(x) * self.context[0]["scale"]


@pytest.mark.parametrize("cache", CACHES)
def test_a_change_to_a_dict_inside_a_tuple_attribute_is_refused_and_put_back(cache):
    model = _HoldsATuple()
    with torch.no_grad(), pytest.raises(TracingError, match=r"module attribute context\[0\]"):
        dtcompile.jit(model, cache=cache)(torch.randn(2, 8))
    assert model.context == ({"scale": 1.0},)


def _batch_norm_of_transposed(lin1, norm, lin2):
    def f(x):
        y = norm(lin1(x).transpose(1, 2))  # a transposed input: eager's kernel returns it row-major
        return lin2(y.transpose(1, 2)).view(-1, 8)  # a view that needs eager's strides

    return f


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("train", [True, False], ids=["train mode", "eval mode"])
def test_batch_norm_of_a_transposed_input_has_eager_strides(cache, grad, train):
    torch.manual_seed(0)
    modules = [torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8)]
    copies = [torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8)]
    for m, c in zip(modules, copies):
        c.load_state_dict(m.state_dict())
        m.train(train)
        c.train(train)
    x = torch.randn(2, 5, 8, requires_grad=grad)
    xc = x.detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        expected = _batch_norm_of_transposed(*modules)(x)
        got = dtcompile.jit(_batch_norm_of_transposed(*copies), cache=cache)(xc)
    torch.testing.assert_close(got, expected)
    assert got.stride() == expected.stride()
    if grad:
        expected.pow(2).sum().backward()
        got.pow(2).sum().backward()
        torch.testing.assert_close(xc.grad, x.grad)
        assert xc.grad.stride() == x.grad.stride()


@pytest.mark.parametrize("cache", CACHES)
def test_numbers_read_from_data_turned_into_text_are_their_values(cache):
    jitted = dtcompile.jit(lambda a: f"{a.sum().item()}/{a.max().item():.1f}/{bool((a > 1).all())}", cache=cache)
    for value in (1.0, 3.0, 1.0):
        x = torch.full((2,), value)
        assert jitted(x) == f"{x.sum().item()}/{x.max().item():.1f}/{bool((x > 1).all())}"


_CLOSED = torch.ones(3, requires_grad=True)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("method", ["register_hook", "retain_grad of a non-leaf"])
def test_hooks_on_a_closed_over_tensor_are_refused(cache, method):
    closed = _CLOSED * 2 if method == "retain_grad of a non-leaf" else _CLOSED

    def f(a):
        if method == "register_hook":
            closed.register_hook(lambda g: g * 10)
        else:
            closed.retain_grad()
        return (a * closed).sum()

    with pytest.raises(TracingError, match="closes over"):
        dtcompile.jit(f, cache=cache)(torch.ones(3))
    assert not _CLOSED._backward_hooks


@pytest.mark.parametrize("cache", CACHES)
def test_an_attribute_of_a_closed_over_tensor_changed_is_refused_and_put_back(cache):
    closed = torch.ones(3)
    closed.calls = 0

    def f(a):
        closed.calls += 1
        return a * closed.calls

    with pytest.raises(TracingError, match="__dict__"):
        dtcompile.jit(f, cache=cache)(torch.ones(3))
    assert closed.calls == 0


@pytest.mark.parametrize("cache", CACHES)
def test_nbytes(cache):
    f = lambda a: a[:1] * a.nbytes  # noqa: E731
    torch.testing.assert_close(dtcompile.jit(f, cache=cache)(torch.ones(5)), f(torch.ones(5)))


@pytest.mark.parametrize("cache", CACHES)
def test_library_code_reading_grad_of_the_calls_tensors_is_refused(cache):
    def clip(params):
        return torch.nn.utils.clip_grad_norm_(params, 1.0)

    p = torch.arange(6.0, requires_grad=True)
    p.grad = torch.full((6,), 3.0)
    with pytest.raises(TracingError, match=r"reads \.grad"):
        dtcompile.jit(clip, cache=cache)([p])
    torch.testing.assert_close(p.grad, torch.full((6,), 3.0))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_step_reading_grad_of_closed_over_parameters(cache, set_to_none):
    weights = []
    for jitted in (False, True):
        torch.manual_seed(0)
        lin = torch.nn.Linear(3, 3)
        params = list(lin.parameters())

        def step(params=params):
            with torch.no_grad():
                for p in params:
                    p.add_(p.grad, alpha=-0.1)

        fn = dtcompile.jit(step, cache=cache) if jitted else step
        for i in range(3):
            lin(torch.ones(2, 3) * (i + 1)).pow(2).sum().backward()
            fn()  # a new .grad after set_to_none: guarded, so read anew
            lin.zero_grad(set_to_none=set_to_none)
        weights.append(lin.weight.detach().clone())
    torch.testing.assert_close(weights[1], weights[0])


@pytest.mark.parametrize("cache", CACHES)
def test_is_leaf_and_grad_fn_of_a_received_tensor(cache):
    by_leaf = dtcompile.jit(lambda x: x * 2 if x.is_leaf else x * 3, cache=cache)
    a = torch.randn(3, requires_grad=True)
    for x, factor in ((a * 1, 3), (a, 2), (a * 1, 3)):  # leafness is guarded
        torch.testing.assert_close(by_leaf(x), x * factor)
    with pytest.raises(TracingError, match="grad_fn of args"):
        dtcompile.jit(lambda x: x * 2 if x.grad_fn is None else x * 3, cache=cache)(a * 1)


class _Registry(dict):
    def __init__(self):
        super().__init__()
        self.calls = 0


class _CountsInARegistry(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.registry = _Registry()

    def forward(self, x):
        self.registry.calls += 1  # an attribute of a dict subclass the module holds
        return self.lin(x)


@pytest.mark.parametrize("cache", CACHES)
def test_an_attribute_of_a_held_dict_subclass_changed_is_refused_and_put_back(cache):
    model = _CountsInARegistry()
    with torch.no_grad(), pytest.raises(TracingError, match="registry.__dict__"):
        dtcompile.jit(model, cache=cache)(torch.ones(2, 3))
    assert model.registry.calls == 0


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("optimizer", ["SGD momentum", "Adam", "AdamW foreach", "SGD"])
@pytest.mark.parametrize("stepped", [False, True], ids=["no state yet", "state made eagerly"])
def test_an_optimizer_step_inside_the_call_is_refused_and_put_back(cache, optimizer, stepped):
    """Before its step runs: torch.optim takes torch.compile's paths while traced (Adam's
    bias corrections in float32 tensors), and its state would hold traced tensors."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = {
        "SGD momentum": lambda: torch.optim.SGD([w], lr=0.1, momentum=0.9),
        "Adam": lambda: torch.optim.Adam([w], foreach=False),
        "AdamW foreach": lambda: torch.optim.AdamW([w], foreach=True),
        "SGD": lambda: torch.optim.SGD([w], lr=0.1),
    }[optimizer]()
    w.grad = torch.ones(3)
    if stepped:
        opt.step()
    state, before = copy.deepcopy(opt.state_dict()), w.detach().clone()
    with pytest.raises(TracingError, match=r"step\(\), an optimizer step inside the call"):
        dtcompile.jit(lambda: opt.step(), cache=cache)()
    after = opt.state_dict()  # no traced tensor left in it, nothing stepped
    assert after["param_groups"] == state["param_groups"] and after["state"].keys() == state["state"].keys()
    for key, values in state["state"].items():
        for name, value in values.items():
            assert type(after["state"][key][name]) is torch.Tensor and torch.equal(after["state"][key][name], value)
    torch.testing.assert_close(w.detach(), before, rtol=0, atol=0)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("how", ["assigned", "zero_grad"])
def test_grad_assigned_on_a_closed_over_tensor_is_refused(cache, how):
    lin = torch.nn.Linear(3, 3)
    lin(torch.ones(1, 3)).sum().backward()

    def f(a):
        if how == "assigned":
            lin.weight.grad = a * 2
        else:
            lin.zero_grad()
        return a * 2

    with pytest.raises(TracingError, match="Tensor.grad is assigned on a tensor the call closes over"):
        dtcompile.jit(f, cache=cache)(torch.ones(3, 3))
    assert isinstance(lin.weight.grad, torch.Tensor) and type(lin.weight.grad) is torch.Tensor


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("stats", [False, True], ids=["no running stats", "running stats"])
def test_functional_batch_norm_of_a_transposed_input_has_eager_strides(cache, stats):
    def f(a):
        mean, var = (torch.zeros(4), torch.ones(4)) if stats else (None, None)
        return torch.nn.functional.batch_norm(a, mean, var, training=True).view(-1)

    x = torch.randn(4, 6).t()
    torch.testing.assert_close(dtcompile.jit(f, cache=cache)(x), f(x))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("made", ["with tensors", "with a traced list", "with a number read from data", "no tensor"])
def test_a_module_made_inside_the_call_is_refused(cache, made):
    def make(x):
        if made == "with tensors":
            return torch.nn.Linear(3, 3)
        if made == "with a traced list":
            module = torch.nn.Identity()
            module.cache = [x * 2]
            return module
        if made == "with a number read from data":
            return torch.nn.LeakyReLU(negative_slope=x.sum().item())
        return torch.nn.Sequential(torch.nn.Identity(), torch.nn.ReLU())  # (eager's is new at every call)

    with pytest.raises(TracingError, match="module made inside the call"):
        dtcompile.jit(make, cache=cache)(torch.ones(3))
    existing = torch.nn.ReLU()
    assert dtcompile.jit(lambda x: (existing, x * 2), cache=cache)(torch.ones(3))[0] is existing


def test_the_jitted_class_called_makes_a_module_of_the_class():
    model = torch.nn.Linear(3, 2)
    jitted = dtcompile.jit(model)
    made = type(jitted)(3, 2)
    assert type(made) is torch.nn.Linear and type(jitted).__name__ == "Linear"
    for copied in (copy.copy(made), copy.deepcopy(made), pickle.loads(pickle.dumps(made))):
        assert type(copied) is torch.nn.Linear
        torch.testing.assert_close(copied(torch.ones(3)), made(torch.ones(3)))
