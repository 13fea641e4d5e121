"""What a later call must find as traced, beside its arguments: torch's global settings the
code reads, the class of each module and object it reads, the hooks of a module it
reaches. And what the traced code cannot do to its tensors or return. Each case gave a
stale or wrong result, or an internal error, with no TracingError."""

import collections
import contextlib
import copy
import dataclasses
import math
import types
import weakref

import numpy
import pytest
import torch
from torch import nn

import dtcompile
from dtcompile.capture.torch_settings import torch_settings

CACHES = ["constant values", "symbolic values"]


def _flag_reader(read):
    return lambda x: x * (2.0 if read() else 3.0)


_SETTINGS = {
    "deterministic algorithms": (
        torch.are_deterministic_algorithms_enabled,
        lambda on: torch.use_deterministic_algorithms(on),
    ),
    "float32 matmul precision": (
        lambda: torch.get_float32_matmul_precision() == "highest",
        lambda on: torch.set_float32_matmul_precision("highest" if on else "high"),
    ),
    "anomaly detection": (torch.is_anomaly_enabled, lambda on: torch.autograd.set_detect_anomaly(on)),
    "mkldnn": (lambda: torch.backends.mkldnn.enabled, lambda on: setattr(torch.backends.mkldnn, "enabled", on)),
    "quantized engine": (
        lambda: torch.backends.quantized.engine == "qnnpack",
        lambda on: setattr(torch.backends.quantized, "engine", "qnnpack" if on else "x86"),
    ),
    "opt_einsum strategy": (
        lambda: torch.backends.opt_einsum.strategy == "auto",
        lambda on: setattr(torch.backends.opt_einsum, "strategy", "auto" if on else "greedy"),
    ),
    # Tracing turns autocast's cache off (its entries would outlive the call): the code
    # asking torch is told the caller's flag, which is guarded.
    "autocast's cache": (lambda: torch.is_autocast_cache_enabled(), lambda on: torch.set_autocast_cache_enabled(on)),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("setting", list(_SETTINGS))
def test_torch_settings_the_code_reads_are_guarded(cache, setting):
    read, write = _SETTINGS[setting]
    before = read()
    fn = _flag_reader(read)
    jitted = dtcompile.jit(fn, cache=cache)
    x = torch.ones(2)
    try:
        for on in (before, not before, before):
            write(on)
            torch.testing.assert_close(jitted(x), fn(x))
    finally:
        write(before)


class Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class Config:
    def factor(self):
        return 2.0


class OtherConfig(Config):
    def factor(self):
        return 3.0


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.config = Config()

    def forward(self, x):
        return self.lin(x) * self.config.factor()


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("what", ["submodule", "config", "root"])
def test_a_class_swapped_after_compiling_is_seen(cache, what):
    torch.manual_seed(0)
    model = Holder()
    jitted = dtcompile.jit(model, cache=cache)
    x = torch.randn(2, 3)
    with torch.no_grad():
        jitted(x)
        if what == "submodule":
            model.lin.__class__ = Doubled
        elif what == "config":
            model.config.__class__ = OtherConfig
        else:
            model.__class__ = type("Tripled", (Holder,), {"forward": lambda self, x: Holder.forward(self, x) * 3})
        torch.testing.assert_close(jitted(x), model(x))


@pytest.mark.parametrize("cache", CACHES)
def test_hooks_of_a_module_the_function_reaches_are_guarded(cache):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())

    def loss(x):
        return model(x).square().mean()

    jitted = dtcompile.jit(loss, cache=cache)
    x = torch.randn(2, 3)
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), loss(x))
        handle = model[0].register_forward_hook(lambda m, a, out: out * 10)
        torch.testing.assert_close(jitted(x), loss(x))
        handle.remove()
        torch.testing.assert_close(jitted(x), loss(x))


def _unsqueezed(x):
    y = x * 2
    y.unsqueeze_(0)
    return y.shape[0] * y


def _transposed(x):
    y = x * 2
    y.t_()
    return y.contiguous()


def _summed_into(x):
    out = torch.empty(0)
    torch.sum(x, 0, out=out)
    return out


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("fn", [_unsqueezed, _transposed, _summed_into], ids=["unsqueeze_", "t_", "out= resized"])
def test_sizes_changed_in_place_are_refused(cache, fn):
    # The traced tensor kept its old sizes: code after the change read them (``contiguous()``
    # of a transposed tensor returned it as it was).
    fn(torch.ones(2, 3))
    with pytest.raises(dtcompile.TracingError, match="changes the sizes or strides of a traced tensor in place"):
        dtcompile.jit(fn, cache=cache)(torch.ones(2, 3))


@dataclasses.dataclass
class Info:
    rows: int


@pytest.mark.parametrize("cache", CACHES)
def test_sizes_in_a_returned_object_are_each_calls(cache):
    def fn(x):
        return x * 2, Info(x.shape[0]), types.SimpleNamespace(more=x.shape[0] + 1)

    jitted = dtcompile.jit(fn, cache=cache)
    for rows in (4, 5, 6):
        _, info, namespace = jitted(torch.ones(rows))
        assert (info.rows, namespace.more) == (rows, rows + 1)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda x: {x: 1}, "keyed by a tensor"),
        (lambda x: iter([x * 2]), "list_iterator"),
        (lambda x: zip([x * 2], [1]), "zip"),
        (lambda x: {"a": x * 2}.values(), "dict_values"),
        (lambda x: (i * x for i in range(2)), "generator"),
    ],
    ids=["dict keyed by a tensor", "iterator", "zip", "dict view", "generator"],
)
def test_results_the_compiled_call_cannot_rebuild_are_refused(cache, fn, match):
    # Each handed the caller traced stand-ins, or failed in the generated epilogue.
    with pytest.raises(dtcompile.TracingError, match=match):
        dtcompile.jit(fn, cache=cache)(torch.ones(3))


@pytest.mark.parametrize("cache", CACHES)
def test_a_failed_view_raises_eagers_runtime_error(cache):
    def fn(x):
        y = x.t()
        try:
            return y.view(-1)
        except RuntimeError:  # eager's error type (the trace's kernel raised a ValueError)
            return y.reshape(-1) + 1

    x = torch.arange(6.0).view(2, 3)
    torch.testing.assert_close(dtcompile.jit(fn, cache=cache)(x), fn(x))


@pytest.mark.parametrize("name", ["meta", "memory", "fake"])
def test_a_tensor_attribute_named_like_a_traced_tensors_own_is_refused(name):
    x = torch.ones(2)
    setattr(x, name, 1)
    with pytest.raises(dtcompile.TracingError, match=f"holds the Python attribute '{name}'"):
        dtcompile.jit(lambda a: a * 2)(x)


class Scale:
    factor = 2.0

    def get(self):
        return self.factor


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("change", ["class constant", "method"])
def test_the_class_of_an_object_passed_in_is_guarded(cache, change):
    def fn(config, x):
        return x * config.get() * config.factor

    jitted = dtcompile.jit(fn, cache=cache)
    x = torch.ones(2)
    original = dict(vars(Scale))
    try:
        jitted(Scale(), x)
        if change == "class constant":
            Scale.factor = 5.0
        else:
            Scale.get = lambda self: 11.0
        torch.testing.assert_close(jitted(Scale(), x), fn(Scale(), x))
    finally:
        Scale.factor, Scale.get = original["factor"], original["get"]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("change", ["resize_", "data", "in a list"])
def test_metadata_of_a_closed_over_tensor_read_without_its_data_is_guarded(cache, change):
    held = [torch.ones(3)]
    t = held[0]

    def fn(x):
        return x.new_zeros(held[0].shape).to(held[0].dtype) + x.sum()

    jitted = dtcompile.jit(fn, cache=cache)
    x = torch.ones(3)
    jitted(x)
    if change == "resize_":
        t.resize_(5)
    elif change == "data":
        t.data = torch.ones(4, dtype=torch.float64)
    else:
        held[0] = torch.ones(6)
    expected, got = fn(x), jitted(x)
    assert (got.shape, got.dtype) == (expected.shape, expected.dtype)


@dataclasses.dataclass
class LayerConfig:
    fill: object
    note: float = dataclasses.field(default=1.0, compare=False)


_REPLACED = {
    "an int for a float": (LayerConfig(1), LayerConfig(1.0)),
    "a field not compared": (LayerConfig(1.0), LayerConfig(1.0, 5.0)),
    "a signed zero": (types.SimpleNamespace(fill=0.0, note=1.0), types.SimpleNamespace(fill=-0.0, note=1.0)),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("case", list(_REPLACED))
def test_an_object_in_a_container_replaced_by_an_equal_one_is_seen(cache, case):
    # Compared by ``==`` before: the new object's attributes were never guarded.
    before, after = _REPLACED[case]
    configs = [before]

    def fn(x):
        config = configs[0]
        return torch.full((2,), config.fill), x * config.note, x * math.copysign(1.0, config.fill)

    jitted = dtcompile.jit(fn, cache=cache)
    x = torch.ones(2)
    jitted(x)
    configs[0] = after
    expected, got = fn(x), jitted(x)
    assert got[0].dtype == expected[0].dtype
    torch.testing.assert_close(got, expected)


class WeightInfo:  # a plain object a parameter carries
    def __init__(self, scale):
        self.scale = scale


@pytest.mark.parametrize("cache", CACHES)
def test_what_a_parameters_python_attribute_holds_is_guarded(cache):
    torch.manual_seed(0)
    lin = nn.Linear(2, 2)
    lin.weight.info = WeightInfo(2.0)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x) * self.lin.weight.info.scale

    model = Scaled()
    jitted = dtcompile.jit(model, cache=cache)
    x = torch.randn(3, 2)
    with torch.no_grad():
        jitted(x)
        lin.weight.info.scale = 3.0
        torch.testing.assert_close(jitted(x), model(x))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn",
    [torch.linalg.cholesky, torch.linalg.inv, lambda a: torch.linalg.solve(a, torch.ones(2, 1))],
    ids=["cholesky", "inv", "solve"],
)
def test_checks_an_op_makes_of_its_results_stay_in_the_program(cache, fn):
    # ``_linalg_check_errors`` returns nothing: dead-code elimination dropped it, and the
    # compiled call returned garbage where eager raises.
    jitted = dtcompile.jit(fn, cache=cache)
    torch.testing.assert_close(jitted(torch.eye(2) * 4), fn(torch.eye(2) * 4))
    singular = torch.tensor([[-1.0, 0.0], [0.0, 0.0]])
    with pytest.raises(torch.linalg.LinAlgError):
        fn(singular)
    with pytest.raises(torch.linalg.LinAlgError):
        jitted(singular)


@pytest.mark.parametrize("cache", CACHES)
def test_a_size_read_from_data_that_the_backward_needs_is_refused_clearly(cache):
    # A plain RuntimeError from the passes before; eager's gradient needs the masked count.
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    with pytest.raises(dtcompile.TracingError, match="backward needs"):
        dtcompile.jit(lambda a: a[a > 0].sum(), cache=cache)(x)


@pytest.mark.parametrize("cache", CACHES)
def test_a_container_of_the_call_returned_is_the_callers_own(cache):
    # Rebuilt as a new container before: an append to the result missed the caller's list.
    def fn(items, table, pair, x):
        return items, table, pair, x * 2

    jitted = dtcompile.jit(fn, cache=cache)
    for n in (3, 4):
        items, table, pair = [torch.ones(n)], {"a": torch.ones(n)}, (torch.ones(n),)
        with torch.no_grad():
            out = jitted(items, table, pair, torch.ones(n))
        assert out[0] is items and out[1] is table and out[2] is pair and out[0][0] is items[0]


class Meta(type):
    k = 2.0


class WithMeta(metaclass=Meta):
    pass


class BaseA:
    k = 2.0


class BaseB:
    k = 5.0


class Derived(BaseA):
    pass


GLOBAL_K = 2.0


def _dynamic(x):
    return x * globals()["GLOBAL_K"]


def _evaluated(x):
    return x * eval("GLOBAL_K")


def _absolute(x):
    return x * dtcompile_test_scale()  # noqa: F821 (a builtin the test adds)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("case", ["metaclass attribute", "bases", "globals()", "eval", "builtin patched"])
def test_python_state_read_in_other_ways_is_guarded(cache, case):
    import builtins

    fns = {
        "metaclass attribute": lambda x: x * WithMeta.k,
        "bases": lambda x: x * Derived.k,
        "globals()": _dynamic,
        "eval": _evaluated,
        "builtin patched": _absolute,
    }
    fn = fns[case]
    builtins.dtcompile_test_scale = lambda: 2.0
    jitted = dtcompile.jit(fn, cache=cache)
    x = torch.ones(2)
    jitted(x)
    global GLOBAL_K
    builtins.dtcompile_test_scale = lambda: 2.0
    try:
        if case == "metaclass attribute":
            Meta.k = 3.0
        elif case == "bases":
            Derived.__bases__ = (BaseB,)
        elif case == "builtin patched":
            builtins.dtcompile_test_scale = lambda: 7.0
        else:
            GLOBAL_K = 3.0
        torch.testing.assert_close(jitted(x), fn(x))
    finally:
        Meta.k, GLOBAL_K = 2.0, 2.0
        del builtins.dtcompile_test_scale
        Derived.__bases__ = (BaseA,)


@pytest.mark.parametrize("cache", CACHES)
def test_a_tensor_made_under_inference_mode_inside_and_returned_is_refused(cache):
    def fn(x):
        with torch.inference_mode():
            total = x.sum()
        return x * 2, total  # eager's total is an inference tensor (in-place on it raises)

    assert fn(torch.ones(3))[1].is_inference()
    with pytest.raises(dtcompile.TracingError, match="inference_mode"):
        dtcompile.jit(fn, cache=cache)(torch.ones(3))
    with torch.inference_mode():  # around the call: every output is one, as in eager
        assert dtcompile.jit(fn, cache=cache)(torch.ones(3))[1].is_inference()


def _views_under_inference_mode(x, keys):
    with torch.inference_mode():  # a view of a normal tensor is a normal one, as in eager
        keys.add_(1)
        view = keys.transpose(1, 2)
    return (view * x.sum()).sum(1), view


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("grad", [False, True])
def test_a_view_taken_under_inference_mode_inside_is_eager_s(cache, grad):
    """It raised torch's "Cannot set version_counter for inference tensor": the view's proxy
    (or the fake its input made when first read there) was made an inference tensor."""
    keys, expected_keys = torch.zeros(1, 3, 4), torch.zeros(1, 3, 4)
    x = torch.randn(1, 1, 4)
    with torch.set_grad_enabled(grad):
        expected = _views_under_inference_mode(x, expected_keys)
        got = dtcompile.jit(_views_under_inference_mode, cache=cache)(x, keys)
    for want, have in zip(expected, got):
        assert torch.equal(have, want) and have.stride() == want.stride()
        assert have.is_inference() == want.is_inference()
    assert torch.equal(keys, expected_keys)


@pytest.mark.parametrize("cache", CACHES)
def test_detach_in_place_of_a_view_raises_eagers_error(cache):
    def fn(x):
        x.detach_()
        return x * 2

    with pytest.raises(RuntimeError, match="Can't detach views in-place"):
        fn(torch.ones(2, 3)[0])
    with pytest.raises(RuntimeError, match="Can't detach views in-place"):
        dtcompile.jit(fn, cache=cache)(torch.ones(2, 3)[0])


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda x: x * 0 + x.detach()._version, r"\._version of args\[0\]"),
        (lambda x: x * 0 + x.data._version, r"\._version of args\[0\]"),
        (lambda x: x * 0 + x[0].is_shared(), r"is_shared\(\) of args\[0\]"),
        (lambda x: x * 0 + x._typed_storage().size(), "untyped_storage"),
    ],
    ids=["detach()._version", ".data._version", "a view's is_shared()", "_typed_storage()"],
)
def test_reads_of_the_callers_tensor_through_what_shares_its_memory_are_refused(cache, fn, match):
    x = torch.ones(2, 3)
    x.add_(1)
    with pytest.raises(dtcompile.TracingError, match=match):
        dtcompile.jit(fn, cache=cache)(x)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "read",
    [len, lambda t: t.dim_order()[0], lambda t: t.nbytes, lambda t: t.itemsize],
    ids=["len", "dim_order", "nbytes", "itemsize"],
)
def test_more_metadata_of_a_closed_over_tensor_is_guarded(cache, read):
    held = torch.ones(2, 3)

    def fn(x):
        return x * read(held)

    jitted = dtcompile.jit(fn, cache=cache)
    x = torch.ones(2)
    jitted(x)
    held.data = torch.ones(3, 2, dtype=torch.float64).t()  # other sizes, strides and dtype, same object
    torch.testing.assert_close(jitted(x), fn(x))


@pytest.mark.parametrize("cache", CACHES)
def test_a_torch_setting_left_changed_by_the_call_is_refused_and_put_back(cache):
    def fn(x):
        torch.use_deterministic_algorithms(True)
        return x * 2

    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(dtcompile.TracingError, match="torch's settings"):
        dtcompile.jit(fn, cache=cache)(torch.ones(2))
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("cache", CACHES)
def test_autocast_s_cache_flag_set_by_the_call_is_refused_and_put_back(cache):
    def fn(x):
        torch.set_autocast_cache_enabled(False)
        return x * 2

    assert torch.is_autocast_cache_enabled()
    with pytest.raises(dtcompile.TracingError, match="torch's settings"):
        dtcompile.jit(fn, cache=cache)(torch.ones(2))
    assert torch.is_autocast_cache_enabled() and torch.is_autocast_cache_enabled is torch._C.is_autocast_cache_enabled


@pytest.mark.parametrize("cache", CACHES)
def test_blocks_told_apart_by_a_setting_their_parent_toggles(cache):
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x) * (2.0 if torch.is_warn_always_enabled() else 1.0)

    class Parent(nn.Module):
        def __init__(self, kernels: bool):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(3))
            self.kernels = kernels

        def forward(self, x):
            for index, layer in enumerate(self.layers):
                if self.kernels:  # a setting the matmul's kernel reads when it runs
                    torch.set_float32_matmul_precision("high" if index == 1 else "highest")
                torch.set_warn_always(index == 1)
                x = layer(x)
            torch.set_float32_matmul_precision("highest")
            torch.set_warn_always(False)
            return x

    torch.manual_seed(0)
    model, x = Parent(kernels=False), torch.randn(3, 2)
    with torch.no_grad():
        torch.testing.assert_close(dtcompile.jit(model, cache=cache)(x), model(x), rtol=0, atol=0)
        model.kernels = True
        with pytest.raises(dtcompile.TracingError, match="the float32 matmul precision"):
            dtcompile.jit(model, cache=cache)(x)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn",
    [
        lambda x: collections.defaultdict(int, {x + 1: 1}),
        lambda x: {(1, x + 1): 2},
        lambda x: collections.OrderedDict([(x + 1, 1)]),
        lambda x: (lambda t: (weakref.ref(t), t))(x + 1),
        lambda x: ValueError(x + 1),
    ],
    ids=["defaultdict", "tuple key", "OrderedDict", "weakref", "exception"],
)
def test_results_holding_traced_values_out_of_reach_are_refused(cache, fn):
    # Each handed the caller a traced stand-in, or crashed in the generated epilogue.
    with pytest.raises(dtcompile.TracingError):
        dtcompile.jit(fn, cache=cache)(torch.ones(3))


def test_a_symbolic_size_in_a_numpy_array_returned_is_refused():
    # An object array of the first call's symbol, returned at every call.
    with pytest.raises(dtcompile.TracingError, match="ndarray"):
        dtcompile.jit(lambda x: numpy.array([x.shape[0], 1], dtype=object), cache="symbolic values")(torch.ones(3))


@pytest.mark.parametrize(
    "fn",
    [lambda x: torch.Tensor([x[0], x[1]]), lambda x: x.new_tensor([x[0]]), lambda x: torch.FloatTensor([x[0]])],
    ids=["torch.Tensor", "new_tensor", "FloatTensor"],
)
def test_data_read_outside_torchs_ops_is_refused_clearly(fn):
    with pytest.raises(dtcompile.TracingError, match="reads a tensor's data outside torch's ops"):
        dtcompile.jit(fn)(torch.ones(3))


class _Scaled(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 10 if func is torch.tanh else out


@pytest.mark.parametrize("cache", CACHES)
def test_a_torch_function_mode_around_the_call_acts_once(cache):
    # What the mode did is traced into the program: it acted again on the program's ops.
    def fn(x, w):
        return torch.tanh(x * w).sum()

    jitted = dtcompile.jit(fn, cache=cache)
    results = []
    for f in (fn, jitted, jitted):
        w = torch.ones(3, requires_grad=True)
        with _Scaled():
            loss = f(torch.ones(3), w)
            loss.backward()
        results.append((loss.detach(), w.grad))
    for got in results[1:]:
        torch.testing.assert_close(got, results[0])


@pytest.mark.parametrize("cache", CACHES)
def test_an_object_returned_twice_is_one_object(cache):
    def fn(x):
        namespace, items = types.SimpleNamespace(y=x * 2), [x + 1]
        return namespace, namespace, items, {"again": items}

    out = dtcompile.jit(fn, cache=cache)(torch.ones(2))
    assert out[0] is out[1] and out[2] is out[3]["again"]


GLOBAL_TENSOR = torch.ones(2)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("how", ["a dict attribute changed in place", "a global tensor's attribute"])
def test_tensors_python_attributes_changed_after_compiling_are_seen(cache, how):
    x = torch.ones(2)
    x.table = {"k": 2.0}
    GLOBAL_TENSOR.k = 2.0

    def fn(a):
        return a * (a.table["k"] if how.startswith("a dict") else GLOBAL_TENSOR.k)

    jitted = dtcompile.jit(fn, cache=cache)
    jitted(x)
    if how.startswith("a dict"):
        x.table["k"] = 3.0
    else:
        GLOBAL_TENSOR.k = 3.0
    torch.testing.assert_close(jitted(x), fn(x))


@pytest.mark.parametrize("cache", CACHES)
def test_an_input_objects_list_holding_a_size_changes_by_call(cache):
    # Its items (a torch.Size is a tuple) were taken for a dict's pairs: an IndexError.
    class Holder:
        pass

    def fn(holder, x):
        holder.sizes = [x.shape]
        return x * 2

    jitted = dtcompile.jit(fn, cache=cache)
    for n in (3, 5):
        holder = Holder()
        jitted(holder, torch.ones(n))
        assert holder.sizes == [torch.Size([n])]


class _KeysLayer:
    def __init__(self, keys):
        self.keys = keys


class _KeysCache:
    def __init__(self, *keys):
        self.layers = [_KeysLayer(k) for k in keys]


class _Identities(nn.Module):
    """Code that asks whether a call's tensor is the module's, or another of the call's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x, cache=None):
        out = x + (100 if x is self.b else 1) + (10 if x is self.lin.weight else 2)
        if cache is not None:
            for i, layer in enumerate(cache.layers):
                out = out + (1000 * (i + 1) if layer.keys is x else 3) + (7 if layer.keys is self.b else 5)
        return out


def _identity_calls(m):
    """Calls whose tensors are each other's or the module's, in several ways."""
    fresh = lambda: torch.ones(4)  # noqa: E731
    x = fresh()
    return [
        ((fresh(),), lambda: (fresh(),)),
        ((m.b,), lambda: (m.b,)),
        ((fresh(), _KeysCache(fresh(), fresh())), lambda: (fresh(), _KeysCache(fresh(), fresh()))),
        ((x, _KeysCache(fresh(), x)), lambda: ((y := fresh()), _KeysCache(fresh(), y))),
        ((fresh(), _KeysCache(m.b, fresh())), lambda: (fresh(), _KeysCache(m.b, fresh()))),
        ((m.b, _KeysCache(fresh(), m.b)), lambda: (m.b, _KeysCache(fresh(), m.b))),
    ]


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("first", range(6))
def test_a_calls_tensors_that_are_the_modules_or_each_others_are_guarded_by_identity(cache, first):
    """Traced with one pattern of identities (an argument that is the module's buffer, a
    cache's tensor that is the argument or the buffer), then called with each other
    pattern: eager's result each time (a new entry where the identities differ)."""
    m = _Identities()
    jitted = dtcompile.jit(m, cache=cache)
    calls = _identity_calls(m)
    order = [calls[first]] + calls
    with torch.no_grad():
        for _, make in order:
            args = make()
            torch.testing.assert_close(jitted(*args), m(*args), rtol=0, atol=0)


class _State:
    def __init__(self):
        self.keys = torch.zeros(2)


class _ReachedOtherwise(nn.Module):
    """Objects and tensors the module holds outside its tables: code may ask whether the
    call's are those (an input object that is the module's attribute, a tensor in its list)."""

    def __init__(self):
        super().__init__()
        self.state = _State()
        self.ts = [torch.zeros(2), torch.ones(2)]

    def forward(self, x, c=None):
        out = x + (100 if x is self.ts[1] else 1)
        return out if c is None else out + (10 if c is self.state else 2)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("aliased", ["object", "tensor"])
def test_a_call_passing_what_the_module_holds_after_a_distinct_call_is_refused_as_at_first(cache, aliased):
    """Traced with objects apart from the module's, then called with the module's own
    attribute object or a tensor of its list: not the stale entry (it answered ``is`` as
    traced) but the refusal a first call gets, naming the other path."""
    m = _ReachedOtherwise()
    jitted = dtcompile.jit(m, cache=cache)
    with torch.no_grad():
        torch.testing.assert_close(jitted(torch.ones(2), _State()), m(torch.ones(2), _State()))
        with pytest.raises(dtcompile.TracingError, match="also reached as|holds args"):
            jitted(*_aliased(m, aliased))
        fresh = _ReachedOtherwise()
        with pytest.raises(dtcompile.TracingError, match="also reached as|holds args"):
            dtcompile.jit(fresh, cache=cache)(*_aliased(fresh, aliased))


def _aliased(m, kind):
    return (torch.ones(2), m.state) if kind == "object" else (m.ts[1], _State())


class _Doubling(nn.Module):
    def forward(self, w):
        return w * 2.0


@pytest.mark.parametrize("cache", CACHES)
def test_parametrize_cached_region_leaves_no_proxy_and_bakes_in_no_entry(cache):
    """``parametrize.cached()``: an entry made while tracing (a proxy) outlived the call
    (the next eager call was given it), and one made by an eager call before would be read
    by the program at every call, outside the region too."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    parametrize.register_parametrization(model, "weight", _Doubling())
    jitted = dtcompile.jit(model, cache=cache)
    x = torch.ones(2, 3)
    with torch.no_grad():
        with parametrize.cached():
            expected = model(x)  # an entry of the eager call's
            torch.testing.assert_close(jitted(x), expected)
            torch.testing.assert_close(model(x), expected)  # eager's entry, not a proxy
            torch.testing.assert_close(jitted(torch.ones(5, 3)), model(torch.ones(5, 3)))  # compiles again
        model.parametrizations.weight.original.add_(1.0)  # outside the region: computed anew
        torch.testing.assert_close(jitted(x), model(x))


@pytest.mark.parametrize("when", ["before compiling", "after compiling"])
def test_a_backend_s_own_float32_precision_set(when):
    """Set through torch's per-backend API, torch refuses to summarize the matmul
    precision, which the prologue asked at every call: every compiled call raised."""
    matmul = torch.backends.mkldnn.matmul
    if getattr(matmul, "fp32_precision", None) is None:
        pytest.skip("this torch has no per-backend float32 precision")
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    try:
        with torch.no_grad():
            if when == "after compiling":
                jitted(x)
            matmul.fp32_precision = "tf32"
            torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
            matmul.fp32_precision = "none"
            torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
    finally:
        matmul.fp32_precision = "none"
    torch.get_float32_matmul_precision()  # (torch's summary, given again)


@pytest.mark.parametrize("read", ["initial_seed", "get_rng_state"])
def test_reading_the_generator_s_seed_or_state_is_refused(read):
    """The value read while tracing was held by the program (``x + torch.initial_seed()``
    kept the first seed after ``manual_seed``)."""

    def fn(x):
        value = getattr(torch, read)()  # (looked up at the call, as ``torch.initial_seed()``)
        return x + float(value.sum() if read == "get_rng_state" else value)

    with pytest.raises(dtcompile.TracingError, match=f"torch.{read}"):
        dtcompile.jit(fn)(torch.ones(2))


def _scaling_hook(module, args, *rest):  # called with (kwargs, output) or (output,); a pre hook: (kwargs,) or ()
    if rest and isinstance(rest[-1], torch.Tensor):
        return rest[-1] * (2 if len(rest) == 2 else 3)
    return ((args[0] * 5,), rest[0]) if rest else (args[0] * 7,)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", ["forward hook", "forward pre hook"])
def test_a_hook_s_with_kwargs_flag_set_after_compiling(kind, cache):
    """The flag tables (``_forward_hooks_with_kwargs``) were not guarded: the hook kept
    being called the way it was traced."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    register = model[1].register_forward_hook if kind == "forward hook" else model[1].register_forward_pre_hook
    handle = register(_scaling_hook)
    flags = vars(model[1])["_forward_hooks_with_kwargs" if kind == "forward hook" else "_forward_pre_hooks_with_kwargs"]
    jitted = dtcompile.jit(model, cache=cache)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
        flags[handle.id] = True
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
        del flags[handle.id]
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
    assert dtcompile.cache_misses(jitted) == 2


@pytest.mark.parametrize("cache", CACHES)
def test_the_math_attention_s_half_precision_reduction_between_calls_compiles_anew(cache):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    jitted = dtcompile.jit(fn, cache=cache)
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    with sdpa_kernel(SDPBackend.MATH):
        torch.testing.assert_close(jitted(q), fn(q), rtol=0, atol=0)
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(not allowed)
        try:
            torch.testing.assert_close(jitted(q), fn(q), rtol=0, atol=0)
        finally:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
    assert dtcompile.cache_misses(jitted) == 2


def test_every_attention_flag_is_one_of_torch_s_settings_and_is_put_back():
    from dtcompile.capture.torch_settings import _SDPA_FLAGS, put_settings_back

    for getter, setter in _SDPA_FLAGS:
        before, value = torch_settings(), getattr(torch._C, getter)()
        getattr(torch._C, setter)(list(reversed(value)) if isinstance(value, list) else not value)
        assert torch_settings() != before, getter
        put_settings_back(before)
        assert torch_settings() == before and getattr(torch._C, getter)() == value, getter


@contextlib.contextmanager
def _kernel_setting(name):
    """A setting a kernel reads when it runs, changed and put back."""
    if name == "mkldnn":
        with torch.backends.mkldnn.flags(enabled=not torch.backends.mkldnn.enabled):
            yield
        return
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1 if threads > 1 else 2) if name == "threads" else torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", ["mkldnn", "threads", "deterministic"])
def test_an_op_run_under_a_kernel_setting_changed_inside_the_call_is_refused(cache, name):
    """The program runs every op under the caller's settings: one changed inside (and put
    back) would be baked in for tracing but not for the kernels (a convolution's mkldnn
    path, a reduction's threads, ``torch.empty``'s fill under deterministic algorithms)."""

    def fn(x):
        with _kernel_setting(name):
            return torch.nn.functional.conv1d(x, x[:1]).sum() + torch.empty(2).numel()

    before = torch_settings()
    with pytest.raises(dtcompile.TracingError, match="ran under torch's settings the traced code changed"):
        dtcompile.jit(fn, cache=cache)(torch.ones(1, 1, 4))
    assert torch_settings() == before
    with _kernel_setting(name):  # set around the call: compiled under it, and eager's
        x = torch.ones(1, 1, 4)
        expected = torch.nn.functional.conv1d(x, x[:1]).sum() + 2
        got = dtcompile.jit(lambda x: torch.nn.functional.conv1d(x, x[:1]).sum() + 2, cache=cache)(x)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_attention_kernels_chosen_inside_the_call_are_eager_s_or_refused(cache, mode):
    """``sdpa_kernel`` inside the call: without grad the kernel chosen is what tracing
    records; under inference mode the attention is recorded whole and would pick its kernel
    when it runs, under the caller's flags: refused."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q):
        with sdpa_kernel([SDPBackend.MATH]):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    q = torch.randn(1, 1, 3, 8, dtype=torch.bfloat16)
    with getattr(torch, mode)():
        if mode == "inference_mode":
            with pytest.raises(dtcompile.TracingError, match="the attention kernels allowed"):
                dtcompile.jit(fn, cache=cache)(q)
        else:
            assert torch.equal(dtcompile.jit(fn, cache=cache)(q), fn(q))


_MODE_SCALE = 2.0


class _ScalesAdds(torch.overrides.TorchFunctionMode):
    def __init__(self, k=1.0):
        super().__init__()
        self.k = k

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * _MODE_SCALE * self.k if func is torch.Tensor.add else out


class _NegatesAdds(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return -out if func is torch.Tensor.add else out


def _adds(x):
    return x.add(1) * 3


@pytest.mark.parametrize("cache", CACHES)
def test_which_function_mode_is_around_the_call_and_what_it_reads_are_guarded(cache):
    """The program holds what the modes did while tracing; only their number was guarded:
    another mode, its attribute or a global its ``__torch_function__`` reads gave the first's."""
    global _MODE_SCALE
    jitted = dtcompile.jit(_adds, cache=cache)
    try:
        for mode, scale in [
            (lambda: _ScalesAdds(1.0), 2.0),
            (lambda: _ScalesAdds(1.0), 2.0),
            (_NegatesAdds, 2.0),
            (lambda: _ScalesAdds(1.0), 3.0),
            (lambda: _ScalesAdds(5.0), 3.0),
        ]:
            _MODE_SCALE = scale
            x = torch.ones(2)
            with mode():
                got, expected = jitted(x), _adds(x)
            assert torch.equal(got, expected)
        assert dtcompile.cache_misses(jitted) == 4  # (each ``with`` makes a new mode: alike, a hit)
    finally:
        _MODE_SCALE = 2.0


_PACK_SCALE = 1.0


def _scaled_pack(t):
    return t * _PACK_SCALE


def _times_w(x, w):
    return (x * w).sum()


@pytest.mark.parametrize("cache", CACHES)
def test_what_saved_tensors_hooks_read_is_guarded(cache):
    global _PACK_SCALE
    jitted = dtcompile.jit(_times_w, cache=cache)
    try:
        for scale in (1.0, 2.0, 3.0):
            _PACK_SCALE = scale
            grads = []
            for fn in (_times_w, jitted):
                w = torch.ones(3, requires_grad=True)
                with torch.autograd.graph.saved_tensors_hooks(_scaled_pack, lambda t: t):
                    fn(torch.ones(3), w).backward()
                grads.append(w.grad)
            assert torch.equal(grads[0], grads[1])
    finally:
        _PACK_SCALE = 1.0


class _CountsOps(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_a_function_mode_counting_the_ops_is_refused():
    """It would count them once, while tracing (the guard on its state then turned down
    the fresh entry: an internal error). The count is not eager's: the mode also sees
    torch calls dtcompile makes while compiling."""
    with _CountsOps():
        with pytest.raises(dtcompile.TracingError, match="torch function mode _CountsOps"):
            dtcompile.jit(_adds)(torch.ones(2))


_ADDED_TO_A_REACHED_MODULE = {
    "a layer appended": lambda net: net.append(nn.Sigmoid()),
    "a parameter registered": lambda net: net[0].register_parameter("extra", nn.Parameter(torch.ones(3))),
    "a buffer registered": lambda net: net[0].register_buffer("extra", torch.full((3,), 2.0)),
    "an adapter set": lambda net: setattr(net[0], "adapter", nn.Linear(3, 3)),
}


class _Adapted(nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        for extra in (getattr(self, "extra", None), getattr(self, "adapter", None)):
            y = y + (extra(x) if isinstance(extra, nn.Module) else 0 if extra is None else extra)
        return y


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("change", list(_ADDED_TO_A_REACHED_MODULE))
def test_an_entry_added_to_a_module_the_function_reaches_is_seen(change, cache):
    # A global model a loss function calls: its existing entries were guarded one by one,
    # but one added under a new name (``append``, ``register_parameter``) was not seen.
    torch.manual_seed(0)
    net = nn.Sequential(_Adapted(3, 3), nn.Tanh())

    def loss(x):
        return net(x).sum() + sum(p.square().sum() for p in net.parameters())

    jitted = dtcompile.jit(loss, cache=cache)
    x = torch.randn(2, 3)
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), loss(x), rtol=0, atol=0)
        _ADDED_TO_A_REACHED_MODULE[change](net)
        torch.testing.assert_close(jitted(x), loss(x), rtol=0, atol=0)


def _step(model, x, scale=1.0):
    return model(x).square().mean() * scale


@pytest.mark.parametrize("cache", CACHES)
def test_a_module_passed_as_an_argument_is_that_module(cache):
    # ``train_step(model, batch)``: refused (a Module was no input); now the very module,
    # guarded by identity (another module compiles anew), its state as one the code reaches.
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    second = copy.deepcopy(first)
    with torch.no_grad():
        second[0].weight.mul_(2)
    jitted = dtcompile.jit(_step, cache=cache)
    for model in (first, first, second, first, second):
        x = torch.randn(5, 3)
        reference = copy.deepcopy(model)
        expected, got = _step(reference, x), jitted(model, x)
        expected.backward()
        got.backward()
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        model.zero_grad()
    assert dtcompile.cache_misses(jitted) == 2
    first.append(nn.Sigmoid())  # its state, as a reached module's
    x = torch.randn(5, 3)
    with torch.no_grad():
        torch.testing.assert_close(jitted(first, x), _step(first, x), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:dtcompile. tracing")
@pytest.mark.parametrize("cache", CACHES)
def test_a_lazy_module_s_first_call_runs_eagerly_and_the_next_compiles(cache):
    # Its parameters are uninitialized until its first call (which removes its hook): the
    # compiled module raised UnsupportedInputError at every call.
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    reference = copy.deepcopy(model)
    jitted = dtcompile.jit(model, cache=cache)
    for n in (3, 3, 5):
        x = torch.randn(n, 5)
        torch.manual_seed(1)  # (the first call draws the initial weights)
        got = jitted(x)
        torch.manual_seed(1)
        torch.testing.assert_close(got, reference(x), rtol=0, atol=0)
    assert dtcompile.cache_misses(jitted) >= 1


class _KeepsATransposedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 3)

    def forward(self, x):
        self.wt = self.lin.weight.t()
        return self.lin(x)


@pytest.mark.parametrize("cache", CACHES)
def test_a_view_made_without_grad_whose_base_is_written_is_read_as_eager(cache):
    # Autograd refuses to say whether such a view is a leaf: reading it, the guards raised
    # its error at every call (eager's code never asks).
    torch.manual_seed(0)
    model = _KeepsATransposedWeight()
    jitted = dtcompile.jit(model, cache=cache)
    x = torch.ones(2, 2)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(jitted(x), model.lin(x), rtol=0, atol=0)
            model.lin.weight.add_(1)  # an optimizer's step
        assert torch.equal(model.wt, model.lin.weight.t())
    weight = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        view = weight[:2]
        weight.add_(1)
        assert torch.equal(dtcompile.jit(lambda v: v * 2, cache=cache)(view), view * 2)


class _Steps(nn.Module):
    """Applies its steps in the order its table iterates: the order is part of the result."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def forward(self, x):
        for name in self.steps:
            x = x * 2.0 if name == "mul" else x + 1.0
        return x


@pytest.mark.parametrize("kind", ["dict", "OrderedDict", "set"])
def test_a_table_reordered_in_place_is_seen(kind):
    """The same keys, iterated in another order after a change in place (``pop`` then set
    again, ``move_to_end``, a set emptied and refilled): ``==`` holds, the result differs."""
    if kind == "set":
        steps = {1, 9}
        names = {1: "mul", 9: "add"}
        module = _Steps(steps)
        module.forward = lambda x: [x := (x * 2.0 if names[k] == "mul" else x + 1.0) for k in module.steps][-1]
    else:
        steps = dict(mul=2.0, add=1.0) if kind == "dict" else collections.OrderedDict(mul=2.0, add=1.0)
        module = _Steps(steps)
    jitted = dtcompile.jit(module)
    x = torch.ones(3)
    assert torch.equal(jitted(x), module.forward(x))
    if kind == "dict":
        steps["mul"] = steps.pop("mul")
    elif kind == "OrderedDict":
        steps.move_to_end("mul")
    else:
        steps.clear()
        steps.update([9])
        steps.add(1)
        assert list(steps) == [9, 1]
    assert torch.equal(jitted(x), module.forward(x))


def test_layers_whose_sets_iterate_apart_are_not_alike():
    """Blocks holding equal sets that iterate in another order (``{1, 9}``, ``{9, 1}``) run
    their steps in another order: each its own."""

    class Block(nn.Module):
        def __init__(self, order):
            super().__init__()
            self.lin, self.order = nn.Linear(4, 4), order

        def forward(self, x):
            y = self.lin(x)
            for k in self.order:
                y = y * 2 if k == 1 else y + 9
            return y * 0.01

    torch.manual_seed(0)
    blocks = nn.Sequential(*(Block({1, 9} if i != 2 else {9, 1}) for i in range(4)))
    assert [list(b.order) for b in blocks][1:3] == [[1, 9], [9, 1]]
    x = torch.ones(1, 4)
    with torch.no_grad():
        assert torch.equal(dtcompile.jit(blocks)(x), blocks(x))


@pytest.mark.parametrize("holder", ["object", "module", "class"])
def test_attributes_iterated_in_order_and_reordered_are_seen(holder):
    """``vars(cfg).items()`` meets the attributes in the order they were set: one deleted and
    set again (the same values) changes the result."""

    class Cfg:
        pass

    cfg = Cfg if holder == "class" else Cfg()
    cfg.mul, cfg.add = 2.0, 1.0

    class Steps(nn.Module):
        def forward(self, x):
            table = vars(self) if holder == "module" else vars(cfg)
            for key, value in list(table.items()):
                if key in ("mul", "add"):
                    x = x * value if key == "mul" else x + value
            return x

    module = Steps()
    if holder == "module":
        module.mul, module.add = 2.0, 1.0
    target = module if holder == "module" else cfg
    jitted = dtcompile.jit(module)
    x = torch.ones(3)
    assert torch.equal(jitted(x), module(x))
    delattr(target, "mul")
    target.mul = 2.0
    assert torch.equal(jitted(x), module(x)) and module(x)[0].item() == 4.0


@pytest.mark.parametrize("table", ["parameter", "buffer"])
def test_a_parameter_or_buffer_registered_again_comes_last_as_in_eager(table):
    """``del m.w1; m.w1 = w`` keeps the values and moves ``w1`` after ``w2`` in
    ``parameters()``: code packing them in order (``x * 10 + p``) gives another result."""

    class Packs(nn.Module):
        def __init__(self):
            super().__init__()
            for i, value in ((1, 1.0), (2, 2.0)):
                if table == "parameter":
                    setattr(self, f"t{i}", nn.Parameter(torch.full((2,), value), requires_grad=False))
                else:
                    self.register_buffer(f"t{i}", torch.full((2,), value))

        def forward(self, x):
            for t in self.parameters() if table == "parameter" else self.buffers():
                x = x * 10 + t
            return x

    module = Packs()
    jitted = dtcompile.jit(module)
    x = torch.ones(2)
    assert torch.equal(jitted(x), module(x))
    moved = module.t1
    del module.t1
    if table == "parameter":
        module.t1 = moved
    else:
        module.register_buffer("t1", moved)
    assert torch.equal(jitted(x), module(x)) and module(x)[0].item() == 121.0


def test_a_refused_call_puts_an_objects_attributes_back_in_order():
    """``del cfg.a; cfg.a = 1.0`` inside the call (refused: it changes an object the module
    holds) leaves ``cfg`` as it was, its attributes' order too: the next call is refused again."""

    class Cfg:
        def __init__(self):
            self.a, self.b = 1.0, 2.0

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = Cfg()

        def forward(self, x):
            del self.cfg.a
            self.cfg.a = 1.0
            return x + 1

    module = Holder()
    jitted = dtcompile.jit(module)
    for _ in range(2):
        with pytest.raises(dtcompile.TracingError, match="changed the module attribute cfg"):
            jitted(torch.zeros(1))
        assert list(vars(module.cfg)) == ["a", "b"]


@pytest.mark.parametrize("reads", ["vars", "__dict__"])
def test_an_attribute_the_forward_assigns_and_reads_through_vars_stays_guarded(reads):
    """``for k, v in vars(self).items()`` reads ``a`` with no load of the name, then the
    forward assigns it: the next call reads the new value, as eager's does."""

    class Sums(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = 1.0, 2.0

        def forward(self, x):
            table = vars(self) if reads == "vars" else self.__dict__
            for key, value in list(table.items()):
                if key in ("a", "b"):
                    x = x * 10 + value
            self.a = 4.0
            return x

    module, reference = Sums(), Sums()
    jitted = dtcompile.jit(module)
    for _ in range(3):
        x = torch.zeros(1, dtype=torch.float64)
        assert torch.equal(jitted(x), reference(x))


class _Reinserts(nn.Module):
    """Its forward deletes an entry of one of its tables and sets it again (a value moves
    last: ``parameters()``, ``buffers()`` and ``vars()`` then list it last)."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.a, self.b = how, 1.0, 2.0
        self.lin = nn.Linear(2, 2)
        self.register_buffer("buf", torch.ones(2))
        self.register_buffer("other", torch.zeros(2))
        self.t, self.u = torch.full((2,), 5.0), torch.full((2,), 6.0)

    def forward(self, x):
        if self.how == "number":
            value = self.a
            del self.a
            self.a = value
        elif self.how == "new number":
            del self.a
            self.a = 7.0
        elif self.how == "parameter":
            weight = self.lin.weight
            del self.lin.weight
            self.lin.weight = weight
        elif self.how == "buffer":
            buf = self.buf
            del self.buf
            self.register_buffer("buf", buf)
        elif self.how == "tensor":
            t = self.t
            del self.t
            self.t = t
        return self.lin(x) + self.buf + self.t


def _tables(module: nn.Module) -> list:
    return [
        list(vars(module)),
        list(vars(module.lin)),
        [n for n, _ in module.named_parameters()],
        list(module._buffers),
    ]


@pytest.mark.parametrize("how", ["number", "new number", "parameter", "buffer", "tensor"])
def test_an_entry_the_forward_deletes_and_sets_again_moves_last_as_in_eager(how):
    """The epilogue set such an entry where it was (or, its value unchanged, not at all):
    code iterating the module's attributes, parameters or buffers after the call met
    eager's old order."""
    torch.manual_seed(0)
    module = _Reinserts(how)
    reference = copy.deepcopy(module)
    jitted = dtcompile.jit(module)
    x = torch.ones(2)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(jitted(x), reference(x))
            assert _tables(module) == _tables(reference)


def test_an_entry_moved_last_keeps_its_object():
    """A container the forward deletes and sets again is the same object after each call
    (not one the epilogue rebuilds), as are the tensors it holds."""

    class Moves(nn.Module):
        def __init__(self):
            super().__init__()
            self.log, self.scale, self.t = [torch.ones(2)], 2.0, torch.zeros(2)

        def forward(self, x):
            log = self.log
            del self.log
            self.log = log
            return x * 2

    module = Moves()
    log, tensor = module.log, module.log[0]
    jitted = dtcompile.jit(module)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(jitted(torch.ones(2)), torch.full((2,), 2.0))
            assert list(vars(module))[-1] == "log" and module.log is log and module.log[0] is tensor


def test_entries_the_caller_reorders_between_calls_stay_as_eager_leaves_them():
    """The forward moves ``a`` last; the caller moves ``b`` last between calls (no guard
    sees the order of a namespace the forward assigns to): only ``a`` is moved again."""

    class Moves(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = 1.0, 2.0, 3.0

        def forward(self, x):
            del self.a
            self.a = 5.0
            return x + 1

    module, reference = Moves(), Moves()
    jitted = dtcompile.jit(module)
    for step in range(4):
        if step == 2:
            for m in (module, reference):
                b = m.b
                del m.b
                m.b = b
        assert torch.equal(jitted(torch.ones(1)), reference(torch.ones(1)))
        assert list(vars(module))[-3:] == list(vars(reference))[-3:]


def test_entries_deleted_and_set_again_where_they_were_last_move_at_each_call():
    """Deleting and setting again the last entries leaves the order traced unchanged; at a
    call where the other entry's trace moved ``a`` after them, eager's moves them last."""

    class Moves(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.d, self.b, self.c = 1, 0, 2, 3

        def forward(self, x):
            if x.shape[0] == 1:
                del self.b
                self.b = 2
                del self.c
                self.c = 3
                self.d = 7
            else:
                del self.a
                self.a = 1
            return x + 1

    module, reference = Moves(), Moves()
    jitted = dtcompile.jit(module)
    for n in (1, 2, 1, 2, 1):
        assert torch.equal(jitted(torch.ones(n)), reference(torch.ones(n)))
        assert list(vars(module))[-4:] == list(vars(reference))[-4:]


def test_an_entry_the_forward_resets_to_the_object_it_held_is_reset_at_each_call():
    """``del self.mode; self.mode = None`` traced while ``mode`` held None: the caller's
    ``mode = "warm"`` between calls was kept (read back at run time), where eager's is None."""

    class Resets(nn.Module):
        def __init__(self):
            super().__init__()
            self.mode, self.b = None, 1.0

        def forward(self, x):
            del self.mode
            self.mode = None
            return x + 1

    module, reference = Resets(), Resets()
    jitted = dtcompile.jit(module)
    for step in range(4):
        if step % 2:
            module.mode = reference.mode = "warm"
        assert torch.equal(jitted(torch.ones(1)), reference(torch.ones(1)))
        assert module.mode is None and list(vars(module))[-2:] == list(vars(reference))[-2:]


def test_a_tensor_attribute_whose_name_holds_a_dot():
    """``setattr(self, "scale.v", t)``: its name split at the dot named a submodule that does
    not exist (a raw KeyError while building the prologue)."""

    class Dotted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            setattr(self, "scale.v", torch.ones(3) * 2)

        def forward(self, x):
            return self.lin(x) * getattr(self, "scale.v")

    torch.manual_seed(0)
    module = Dotted()
    jitted = dtcompile.jit(module)
    x = torch.randn(2, 3)
    with torch.no_grad():
        for value in (2.0, 2.0, 5.0):
            setattr(module, "scale.v", torch.full((3,), value))
            assert torch.equal(jitted(x), module(x))
