"""What a later call must find as traced, beside its arguments: torch's global settings the
code reads, the class of each module and object it reads, the hooks of a module it
reaches. And what the traced code cannot do to its tensors or return. Each case gave a
stale or wrong result, or an internal error, with no TracingError."""

import dataclasses
import types

import pytest
import torch
from torch import nn

import dtcompile

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
