"""Torch's extension points used inside a compiled call (probe AZ): eager's results, or a
clear refusal where a program cannot hold what the code does."""

import pytest
import torch
import torch.nn as nn

import dtcompile

CACHES = ["constant values", "symbolic values"]


@pytest.mark.parametrize("cache", CACHES)
def test_swap_tensors_of_arguments_is_refused(cache):
    def f(a, b):
        torch.utils.swap_tensors(a, b)
        return a * 2

    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    with pytest.raises(dtcompile.TracingError, match="swap_tensors"):
        dtcompile.jit(f, cache=cache)(a, b)
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [3.0, 4.0]


@pytest.mark.parametrize("cache", CACHES)
def test_swap_tensors_of_a_buffer_is_refused_even_where_caught(cache):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.zeros(3))

        def forward(self, x):
            try:
                torch.utils.swap_tensors(self.b, self.b + 1)
            except Exception:
                pass
            return x + self.b

    model = M()
    with pytest.raises(dtcompile.TracingError, match="swap_tensors"):
        dtcompile.jit(model, cache=cache)(torch.zeros(3))
    assert model.b.tolist() == [0.0, 0.0, 0.0]


def _cond(x, p):
    return torch.cond(p, lambda a: a.sin() * 2, lambda a: a.cos() * 3, (x,))


def _while(x):
    return torch._higher_order_ops.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 2), (torch.tensor(0), x))[1]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("which", ["cond", "while_loop"])
def test_torchs_compiler_inside_is_refused_and_eager_still_runs_after(which, cache):
    """torch.cond with a tensor predicate and while_loop run torch.compile in eager: refused
    before torch's compiler starts, so that nothing of the attempt stays in its caches."""
    x, p = torch.randn(3, 4), torch.tensor(True)
    fn, args = (_cond, (x, p)) if which == "cond" else (_while, (x,))
    expected = fn(*args)
    with pytest.raises(dtcompile.TracingError, match="torch.compile"):
        dtcompile.jit(fn, cache=cache)(*args)
    torch.testing.assert_close(fn(*args), expected)  # eager's, after the attempt


_LIB = torch.library.Library("dtc_probe_az", "DEF")
_LIB.define("pair(Tensor x) -> (Tensor, Tensor)")
_LIB.impl("pair", lambda x: (x.sin(), x.cos()), "CompositeExplicitAutograd")
torch.library.register_fake("dtc_probe_az::pair", lambda x: (torch.empty_like(x), torch.empty_like(x)), lib=_LIB)


def _pair_product(x):
    a, b = torch.ops.dtc_probe_az.pair(x)
    return a * b


@pytest.mark.parametrize("cache", CACHES)
def test_a_library_op_with_no_autograd_kernel_is_refused_where_a_gradient_flows(cache):
    """Eager's autograd fallback differentiates what its kernel runs; a compiled call would
    record it as one op with no gradient (x.grad silently None): refused instead."""
    with pytest.raises(dtcompile.TracingError, match="no autograd kernel"):
        dtcompile.jit(_pair_product, cache=cache)(torch.randn(3, 4, requires_grad=True))


@pytest.mark.parametrize("cache", CACHES)
def test_a_library_op_with_no_autograd_kernel_runs_without_gradients(cache):
    x = torch.randn(3, 4)
    jitted = dtcompile.jit(_pair_product, cache=cache)
    torch.testing.assert_close(jitted(x), _pair_product(x))
    with torch.no_grad():
        y = x.clone().requires_grad_()
        torch.testing.assert_close(jitted(y), _pair_product(x))


class _SetsItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        y = x @ (self.w * 1).t()
        with torch.no_grad():
            self.w.set_(self.w * 0.9)
        return y


class _Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).transpose(-1, -2)

    def right_inverse(self, A):
        return A.triu()


class _AssignsItsParametrizedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(3, 3)
        torch.nn.utils.parametrize.register_parametrization(self.l, "weight", _Symmetric())

    def forward(self, x):
        y = self.l(x)
        with torch.no_grad():
            self.l.weight = self.l.weight * 0.9  # (parametrize's setter: original.set_(...))
        return y


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("make", [_SetsItsWeight, _AssignsItsParametrizedWeight])
def test_a_parameter_pointed_at_other_memory_in_a_training_call_is_refused(make, cache):
    """Its gradient would be lost (torch.autograd.grad no longer counts it an input)."""
    with pytest.raises(dtcompile.TracingError, match="points a tensor that requires grad at other memory"):
        dtcompile.jit(make(), cache=cache)(torch.randn(2, 3))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("make", [_SetsItsWeight, _AssignsItsParametrizedWeight])
def test_a_parameter_pointed_at_other_memory_without_gradients_runs_as_eager(make, cache):
    torch.manual_seed(0)
    model = make()
    expected_model = make()
    expected_model.load_state_dict(model.state_dict())
    jitted = dtcompile.jit(model, cache=cache)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3)
            torch.testing.assert_close(jitted(x), expected_model(x))
            for got, expected in zip(model.parameters(), expected_model.parameters()):
                torch.testing.assert_close(got, expected)


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cache", CACHES)
def test_a_users_dispatch_mode_sees_the_programs_ops_not_tracings(cache):
    """A FlopCounterMode around the compiling call counted the traced (fake) ops and then
    the program's: twice eager's, or a symbolic expression under symbolic values."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    jitted = dtcompile.jit(model, cache=cache)
    for _ in range(2):
        x = torch.randn(2, 8)
        counts = []
        for fn in (model, jitted):
            with FlopCounterMode(display=False) as counter:
                fn(x).sum().backward()
            counts.append(counter.get_total_flops())
        assert counts[0] == counts[1] and type(counts[1]) is int
    jitted = dtcompile.jit(model, cache=cache)
    logs = [_OpLog(), _OpLog()]
    with torch.no_grad():
        for fn, log in zip((model, jitted), logs):
            with log:
                fn(torch.randn(2, 8))
    assert len(logs[1].ops) == len(logs[0].ops)


@torch.library.custom_op("dtc_probe_az::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_scaled.register_fake(lambda x: torch.empty_like(x))
GRAD_SCALE = 5.0
SETTINGS = {"k": 1.0}


def _setup(ctx, inputs, output):
    ctx.k = SETTINGS["k"]


_scaled.register_autograd(lambda ctx, g: g * GRAD_SCALE * ctx.k, setup_context=_setup)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("route", ["definition", "torch.ops"])
def test_what_a_custom_ops_registered_functions_read_is_guarded(route, cache):
    """A global its backward reads, a dict its setup_context reads, and its backward
    registered again: eager's gradients follow each change; the compiled ones kept the first
    compile's, however the op is called."""
    global GRAD_SCALE
    op = _scaled if route == "definition" else torch.ops.dtc_probe_az.scaled

    def f(x):
        return op(x) + 1

    jitted = dtcompile.jit(f, cache=cache)
    for scale, k, again in ((5.0, 1.0, False), (6.0, 1.0, False), (6.0, 3.0, False), (6.0, 3.0, True)):
        GRAD_SCALE, SETTINGS["k"] = scale, k
        if again:
            _scaled.register_autograd(lambda ctx, g: -g, setup_context=_setup)
        x = torch.randn(3)
        expected_x, got_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        f(expected_x).sum().backward()
        jitted(got_x).sum().backward()
        torch.testing.assert_close(got_x.grad, expected_x.grad)
    _scaled.register_autograd(lambda ctx, g: g * GRAD_SCALE * ctx.k, setup_context=_setup)


_LIB.define("halved(Tensor x) -> Tensor")
_LIB.impl("halved", lambda x: x / 2, "CPU")
torch.library.register_fake("dtc_probe_az::halved", lambda x: torch.empty_like(x), lib=_LIB)


def _halved_setup(ctx, inputs, output):
    ctx.k = SETTINGS["k"]


torch.library.register_autograd(
    "dtc_probe_az::halved", lambda ctx, g: g * GRAD_SCALE * ctx.k, setup_context=_halved_setup, lib=_LIB
)


@pytest.mark.parametrize("cache", CACHES)
def test_what_a_library_ops_registered_autograd_reads_is_guarded(cache):
    """``register_autograd`` of a ``Library`` op (not a ``custom_op``): torch holds its
    functions in the closure of a kernel only C++ holds. A global its backward reads and a
    dict its setup_context reads: the compiled gradients kept the first compile's."""
    global GRAD_SCALE

    def f(x):
        return torch.ops.dtc_probe_az.halved(x) * 3

    jitted = dtcompile.jit(f, cache=cache)
    try:
        for scale, k in ((5.0, 1.0), (6.0, 1.0), (6.0, 3.0), (6.0, 3.0)):
            GRAD_SCALE, SETTINGS["k"] = scale, k
            x = torch.randn(3)
            expected_x, got_x = x.clone().requires_grad_(), x.clone().requires_grad_()
            f(expected_x).sum().backward()
            jitted(got_x).sum().backward()
            torch.testing.assert_close(got_x.grad, expected_x.grad)
        assert dtcompile.cache_misses(jitted) == 3
    finally:
        GRAD_SCALE, SETTINGS["k"] = 5.0, 1.0


@pytest.mark.parametrize("cache", CACHES)
def test_a_torch_compiled_module_called_inside_with_its_training_flag_switched(cache):
    """Its training flag is a property (its module's): read as such, not as a dict entry,
    which made a false "changed the training flag" refusal and left a stale entry."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    compiled = torch.compile(model, backend="eager")

    def outer(x):
        return compiled(x).pow(2).sum()

    jitted = dtcompile.jit(outer, cache=cache)
    for training in (True, True, False, False, True):
        compiled.train(training)
        x = torch.randn(2, 4)
        torch.manual_seed(1)
        expected = model(x).pow(2).sum()
        torch.manual_seed(1)
        torch.testing.assert_close(jitted(x), expected)
        assert "training" not in vars(compiled) and model.training is training


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("first", [False, True])
def test_distributions_argument_validation_switched_after_compiling(first, cache):
    from torch.distributions import Distribution, Normal

    def f(mu, scale):
        return Normal(mu, scale).log_prob(mu)

    saved = Distribution._validate_args
    try:
        Distribution.set_default_validate_args(first)
        jitted = dtcompile.jit(f, cache=cache)
        jitted(torch.randn(3), torch.ones(3))
        Distribution.set_default_validate_args(not first)
        mu, scale = torch.randn(3), torch.tensor([1.0, -1.0, 1.0])
        if first:  # validation off now: both return NaN where the scale is negative
            torch.testing.assert_close(jitted(mu, scale), f(mu, scale), equal_nan=True)
        else:
            with pytest.raises(ValueError):
                f(mu, scale)
            with pytest.raises(ValueError):
                jitted(mu, scale)
    finally:
        Distribution.set_default_validate_args(saved)


@pytest.mark.parametrize("cache", CACHES)
def test_a_hook_writing_an_argument_object_is_refused_without_a_misleading_advice(cache):
    class Stats:
        pass

    def f(x, w, stats):
        h = x * w

        def hook(g):
            stats.norm = g.norm()

        h.register_hook(hook)
        return h.tanh().sum()

    w = torch.randn(3, requires_grad=True)
    with pytest.raises(dtcompile.TracingError, match="tensor hook") as refusal:
        dtcompile.jit(f, cache=cache)(torch.randn(3), w, Stats()).backward()
    assert "outside its inputs" not in str(refusal.value) and "pass the object in the call" not in str(refusal.value)


class _SinWithJvp(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def jvp(ctx, tangent):
        return tangent * ctx.saved_tensors[0].cos()


@pytest.mark.parametrize("cache", CACHES)
def test_forward_ad_through_a_functions_jvp_is_refused_saying_so(cache):
    import torch.autograd.forward_ad as forward_ad

    def f(x, t):
        with forward_ad.dual_level():
            y = _SinWithJvp.apply(forward_ad.make_dual(x, t)) * 2
            primal, tangent = forward_ad.unpack_dual(y)
            return primal.clone(), tangent.clone()

    with pytest.raises(dtcompile.TracingError, match="forward-mode AD.*torch.func.jvp"):
        dtcompile.jit(f, cache=cache)(torch.randn(3), torch.randn(3))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_of_a_one_row_slice_takes_eagers_kernel(bias, cache):
    """``x[:, 0:1]`` has strides (32, 16, 1): eager's matmul takes ``bmm`` where torch's
    Python form folds it into ``mm`` (bits apart); traced as eager's."""
    torch.manual_seed(0)
    fns = [
        lambda x, w, b: torch.nn.functional.linear(x[:, 0:1], w, b if bias else None),
        lambda x, w, b: x[:, 1:2] @ w.t(),
        lambda x, w, b: torch.matmul(x[:, 0:1], w.t()) + 1,
    ]
    for fn in fns:
        jitted = dtcompile.jit(fn, cache=cache)
        for seed in range(6):
            torch.manual_seed(seed)
            x, w, b = torch.randn(1, 2, 16), torch.randn(8, 16), torch.randn(8)
            assert torch.equal(jitted(x, w, b), fn(x, w, b))


_LIB.define("bucket(Tensor x) -> Tensor")
_LIB.impl("bucket", lambda x: (x > 0).long(), "CompositeExplicitAutograd")
torch.library.register_fake("dtc_probe_az::bucket", lambda x: torch.empty_like(x, dtype=torch.long), lib=_LIB)


@pytest.mark.parametrize("cache", CACHES)
def test_a_library_op_with_only_integer_outputs_runs_with_gradients(cache):
    """No gradient can flow back through an integer mask: not refused (only ops with
    floating outputs are)."""

    def f(x):
        return x * torch.ops.dtc_probe_az.bucket(x)

    x = torch.randn(5)
    expected_x, got_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    f(expected_x).sum().backward()
    dtcompile.jit(f, cache=cache)(got_x).sum().backward()
    torch.testing.assert_close(got_x.grad, expected_x.grad)


KERNEL_CALLS = [0]
REPEATS = {"r": 2}


@torch.library.custom_op("dtc_probe_az::counted", mutates_args=())
def _counted(x: torch.Tensor) -> torch.Tensor:
    KERNEL_CALLS[0] += 1  # (state of the kernel's own: the program runs it at each call)
    return x + 1


_counted.register_fake(lambda x: torch.empty_like(x))
_LIB.define("repeated(Tensor x) -> Tensor")
_LIB.impl("repeated", lambda x: x.repeat(REPEATS["r"]), "CompositeExplicitAutograd")
torch.library.register_fake("dtc_probe_az::repeated", lambda x: x.new_empty(x.shape[0] * REPEATS["r"]))


@pytest.mark.parametrize("cache", CACHES)
def test_a_custom_ops_kernel_state_compiles_once(cache):
    """Its kernel runs as one op of the program: what it reads is not guarded (it compiled
    at every call when it was)."""
    jitted = dtcompile.jit(lambda x: torch.ops.dtc_probe_az.counted(x) * 2, cache=cache)
    for _ in range(4):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), (x + 1) * 2)
    assert dtcompile.cache_misses(jitted) == 1


@pytest.mark.parametrize("cache", CACHES)
def test_what_a_library_ops_fake_reads_is_guarded(cache):
    """The fake sizes the output (torch wraps it when registered without a library):
    the program's sizes must follow it."""

    def f(x):
        y = torch.ops.dtc_probe_az.repeated(x)
        return y.sum() / y.shape[0], torch.zeros(y.shape[0])

    jitted = dtcompile.jit(f, cache=cache)
    try:
        for r in (2, 3, 3):
            REPEATS["r"] = r
            x = torch.arange(4.0)
            expected, got = f(x), jitted(x)
            torch.testing.assert_close(got[0], expected[0])
            assert got[1].shape == expected[1].shape
    finally:
        REPEATS["r"] = 2


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("layout", ["last dims", "every other", "one row", "transposed"])
def test_matmul_of_strided_operands_is_eagers_bit_for_bit(layout, cache):
    """Eager's C++ matmul folds an operand into ``view`` and ``mm`` by a test of its leading
    dims only, which torch's Python form (what tracing runs) decides otherwise for slices:
    values and gradients must be eager's bits."""

    def make(shape, seed, grad=True):
        generator = torch.Generator().manual_seed(seed)
        big = torch.randn(*shape[:-1], 2 * shape[-1], generator=generator)
        x = {
            "last dims": big[..., : shape[-1]],
            "every other": big[..., ::2],
            "one row": big[..., : shape[-1]][:, 0:1],
            "transposed": big[..., : shape[-1]].transpose(0, 1),
        }[layout]
        w = torch.randn(5, x.shape[-1], generator=generator)
        return x.detach().requires_grad_(grad), w.requires_grad_(grad)

    for fn in (lambda x, w: torch.nn.functional.linear(x, w), lambda x, w: torch.matmul(x, w.t()) * 2):
        jitted = dtcompile.jit(fn, cache=cache)
        for shape in ((2, 3, 8), (3, 4, 2, 8)):
            (x, w), (x2, w2) = make(shape, 1, grad=False), make(shape, 1, grad=False)
            assert torch.equal(jitted(x2, w2), fn(x, w))  # (a weight that needs a gradient always folds)
            (x, w), (x2, w2) = make(shape, 0), make(shape, 0)
            expected, got = fn(x, w), jitted(x2, w2)
            assert torch.equal(got, expected) and got.stride() == expected.stride()
            expected.sum().backward()
            got.sum().backward()
            assert torch.equal(x2.grad, x.grad) and torch.equal(w2.grad, w.grad)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_torch_compiled_function_inside_runs_as_written(fullgraph, cache):
    """Compiling sets torch.compile's stance to eager: the function runs as written and is
    traced (with fullgraph, dynamo raised that it compiled no frame, and kept that), and
    eager's calls after are eager's."""
    compiled = torch.compile(lambda x: x.sin() * 2, backend="eager", fullgraph=fullgraph)

    def f(x):
        return compiled(x) + 1

    jitted = dtcompile.jit(f, cache=cache)
    for n in (4, 6):
        x = torch.randn(n)
        torch.testing.assert_close(jitted(x), x.sin() * 2 + 1)
        torch.testing.assert_close(f(x), x.sin() * 2 + 1)
