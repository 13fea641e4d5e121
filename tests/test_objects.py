"""Single process: objects holding tensors as inputs (a KV cache), their in-place and
attribute updates, and ModelOutput results, against eager."""

import copy

import pytest
import torch
from support import assert_same_result, assert_same_tensor
from transformers.modeling_outputs import BaseModelOutputWithPast

import dtcompile
from dtcompile.capture import UnsupportedInputError
from dtcompile.core import InputPath


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


class Buffer:
    """A small KV-cache-like object: a preallocated buffer written in place, a tensor
    replaced by a new one at each call, and plain attributes."""

    def __init__(self, size: int):
        self.slots = torch.zeros(size, 4)
        self.history = None
        self.position = torch.tensor(0)
        self.initialized = False

    def append(self, x):
        if not self.initialized:
            self.history = x.new_zeros(0, x.shape[-1])
            self.initialized = True
        index = torch.arange(x.shape[0]) + self.position
        self.slots.index_copy_(0, index, x)
        self.position.add_(x.shape[0])
        self.history = torch.cat([self.history, x])
        return self.slots.sum(0)


class Holder:
    def __init__(self, buffer):
        self.buffer = buffer
        self.calls = 0


def step(x, buffer):
    return buffer.append(x) * 2


def run_both(fn, make_state, inputs, cache="constant values"):
    """Run ``fn`` eagerly and compiled over ``inputs`` on two copies of the state; returns
    (eager results, compiled results, eager state, compiled state, jitted)."""
    eager_state, compiled_state = make_state(), make_state()
    jitted = dtcompile.jit(fn, cache=cache)
    eager = [fn(x, eager_state) for x in inputs]
    compiled = [jitted(x, compiled_state) for x in inputs]
    return eager, compiled, eager_state, compiled_state, jitted


def assert_same_buffer(got: Buffer, expected: Buffer):
    assert got.initialized is expected.initialized
    for name in ("slots", "history", "position"):
        assert_same_tensor(getattr(got, name), getattr(expected, name))


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_object_state_follows_eager_over_calls(cache):
    inputs = [torch.randn(n, 4) for n in (2, 3, 3, 2)]
    eager, compiled, eager_state, compiled_state, jitted = run_both(step, lambda: Buffer(16), inputs, cache)
    for got, expected in zip(compiled, eager):
        assert_same_tensor(got, expected)
    assert_same_buffer(compiled_state, eager_state)
    # The history grows at every call: one entry per call with constant values; with
    # symbolic values one for the first call (it initializes) and one for the others.
    expected = len(inputs) if cache == "constant values" else 2
    assert dtcompile.cache_misses(jitted) == expected


def test_object_tensors_are_inputs_with_paths_into_the_object():
    jitted = dtcompile.jit(step)
    buffer = Buffer(8)
    jitted(torch.randn(2, 4), buffer)
    jitted(torch.randn(2, 4), buffer)  # initialized now: every tensor comes from the object
    paths = [p.provenance for p in dtcompile.last_traces(jitted)[0].inputs]
    assert InputPath("args").index(1).attr("slots") in paths
    assert "args[1].history" in [str(p) for p in paths]
    assert "args[1].position" in [str(p) for p in paths]


def test_nested_objects_and_the_object_returned():
    def fn(x, holder):
        holder.calls = holder.calls + 1
        return holder.buffer.append(x), holder

    inputs = [torch.randn(2, 4) for _ in range(3)]
    eager, compiled, eager_state, compiled_state, _ = run_both(fn, lambda: Holder(Buffer(8)), inputs)
    for (got, got_holder), (expected, _) in zip(compiled, eager):
        assert_same_tensor(got, expected)
        assert got_holder is compiled_state  # the caller's own object, not a copy
    assert compiled_state.calls == eager_state.calls == 3
    assert_same_buffer(compiled_state.buffer, eager_state.buffer)


def test_in_place_updates_are_kept_in_order_and_never_merged():
    def fn(x, holder):
        slots = holder.buffer.slots
        slots.mul_(2)
        slots.add_(x)  # nobody reads the results: DCE must keep both
        slots.mul_(2)
        slots.add_(x)  # the same op as two lines up: CSE must not merge it
        return x + 1

    x = torch.randn(8, 4)
    eager, compiled, eager_state, compiled_state, _ = run_both(fn, lambda: Holder(Buffer(8)), [x, x])
    assert_same_tensor(compiled_state.buffer.slots, eager_state.buffer.slots)


def test_a_model_output_result_is_rebuilt():
    def fn(x, buffer):
        hidden = buffer.append(x)
        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=buffer)

    inputs = [torch.randn(2, 4) for _ in range(2)]
    eager, compiled, _, compiled_state, _ = run_both(fn, lambda: Buffer(8), inputs)
    for got, expected in zip(compiled, eager):
        assert type(got) is BaseModelOutputWithPast
        assert list(got.keys()) == list(expected.keys())
        assert_same_tensor(got.last_hidden_state, expected.last_hidden_state)
        assert got.past_key_values is compiled_state
        assert got[0] is got.last_hidden_state


def _filled_by_key(x):
    out = BaseModelOutputWithPast(last_hidden_state=x * 2)
    out["attentions"] = (x.mean(),)
    return out


def _filled_by_attribute(x):
    out = BaseModelOutputWithPast(last_hidden_state=x * 2)
    out.hidden_states = (x + 1, x - 1)
    return out


def _fields_given_out_of_order(x):
    return BaseModelOutputWithPast(attentions=(x.mean(),), last_hidden_state=x * 2)


@pytest.mark.parametrize("fn", [_filled_by_key, _filled_by_attribute, _fields_given_out_of_order])
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_a_model_output_filled_after_it_was_made_keeps_eager_s_key_order(fn, cache):
    # Rebuilt by its constructor, its keys came back in field order: out[0], to_tuple()
    # and iteration gave another tensor than eager's (a loss set after the logits).
    jitted = dtcompile.jit(fn, cache=cache)
    for n in (2, 3, 2):
        x = torch.randn(n, 4)
        expected, got = fn(x), jitted(x)
        assert list(got.keys()) == list(expected.keys())
        for a, b in zip(got.to_tuple(), expected.to_tuple()):
            assert_same_result(a, b)


def test_a_changed_object_guards_its_entry():
    jitted = dtcompile.jit(step)
    first, second = Buffer(8), Buffer(12)
    jitted(torch.randn(2, 4), first)
    jitted(torch.randn(2, 4), second)  # another slots size: another entry
    assert dtcompile.cache_misses(jitted) == 2
    second.extra = 1  # an attribute the trace did not see
    eager_buffer = copy.deepcopy(second)
    assert_same_result(jitted(torch.ones(2, 4), second), step(torch.ones(2, 4), eager_buffer))
    assert dtcompile.cache_misses(jitted) == 3


def test_changes_that_cannot_be_replayed_are_errors():
    def appends(x, state):
        state.items.append(x + 1)
        return x

    class State:
        def __init__(self):
            self.items = [torch.zeros(2)]

    with pytest.raises(dtcompile.TracingError, match=r"changed args\[1\]\.items .* in place"):
        dtcompile.jit(appends)(torch.randn(2), State())

    def deletes(x, buffer):
        del buffer.history
        return x

    with pytest.raises(dtcompile.TracingError, match="deleted args"):
        dtcompile.jit(deletes)(torch.randn(2), Buffer(4))

    def sets_again(x, buffer):  # (eager's moves it last; replayed as an assignment it kept its place)
        history = buffer.history
        del buffer.history
        buffer.history = history
        return x

    buffer = Buffer(4)
    names = list(vars(buffer))
    with pytest.raises(dtcompile.TracingError, match=r"deleted args\[1\]\.history"):
        dtcompile.jit(sets_again)(torch.randn(2), buffer)
    assert list(vars(buffer)) == names  # (put back as it was)


def test_a_new_object_holding_tensors_is_made_anew_after_each_call():
    def makes(x, buffer):
        fresh = Buffer(4)
        fresh.slots = x + 1
        return fresh

    jitted = dtcompile.jit(makes)
    x = torch.randn(4, 4)
    first, second, expected = jitted(x, Buffer(4)), jitted(x, Buffer(4)), makes(x, Buffer(4))
    assert type(second) is Buffer and second is not first
    assert vars(second).keys() == vars(expected).keys()
    for name, value in vars(expected).items():
        assert_same_result(vars(second)[name], value)


def test_object_updates_in_a_call_that_needs_gradients_are_an_error():
    def fn(x, buffer):
        buffer.history = x * 2
        return x.sum()

    with torch.enable_grad(), pytest.raises(dtcompile.TracingError, match="needs gradients"):
        dtcompile.jit(fn)(torch.randn(2, 4, requires_grad=True), Buffer(4))


def test_timed_call_splits_a_call_into_its_parts():
    jitted = dtcompile.jit(step, cache="symbolic values")  # the growing history: one entry
    buffer = Buffer(16)
    jitted(torch.randn(2, 4), buffer)
    jitted(torch.randn(3, 4), buffer)  # not 2 rows: duck sizing would tie x's rows to the history's
    eager_buffer = copy.deepcopy(buffer)
    x = torch.randn(2, 4)
    result, times = dtcompile.timed_call(jitted, x, buffer)
    assert_same_tensor(result, step(x, eager_buffer))
    assert_same_buffer(buffer, eager_buffer)
    assert times.guards > 0 and times.computation > 0 and times.epilogue > 0
    with pytest.raises(RuntimeError, match="no compiled entry"):
        dtcompile.timed_call(jitted, torch.randn(2, 4, dtype=torch.float64), buffer)  # never compiled


def test_objects_traced_apart_are_guarded_apart():
    class State:
        def __init__(self):
            self.t = torch.zeros(2)

    def fn(x, a, b):
        a.t = a.t + x
        b.t = b.t + x
        return x * 2

    jitted, x = dtcompile.jit(fn), torch.ones(2)
    jitted(x, State(), State())
    eager_state, compiled_state = State(), State()
    fn(x, eager_state, eager_state)
    jitted(x, compiled_state, compiled_state)  # one object twice: not the entry for two
    assert_same_tensor(compiled_state.t, eager_state.t)
    assert dtcompile.cache_misses(jitted) == 2


def test_container_subclasses_are_not_taken_apart():
    class Mapping(dict):
        pass

    with pytest.raises(dtcompile.UnsupportedInputError, match=r"args\[0\] is a Mapping"):
        dtcompile.jit(lambda d: d["a"] * 2)(Mapping(a=torch.ones(2)))


def test_an_object_a_module_holds_must_not_keep_traced_tensors():
    class State:
        def __init__(self):
            self.t = torch.zeros(2)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.state = State()

        def forward(self, x):
            self.state.t = self.state.t + x
            return self.state.t * 2

    model = Model()
    jitted = dtcompile.jit(model)
    for _ in range(2):  # the state is put back: the second call fails the same way
        with pytest.raises(dtcompile.TracingError, match="changed the module attribute state"):
            jitted(torch.ones(2))
        assert type(model.state.t) is torch.Tensor and torch.equal(model.state.t, torch.zeros(2))


class Layer:
    """One layer of a KV-cache-like list: alike objects, checked column by column."""

    def __init__(self, size: int = 4, dtype=torch.float32):
        self.keys = torch.zeros(size, 2, dtype=dtype)
        self.length = 0
        self.name = "layer"


def write_layers(x, layers):
    out = x
    for layer in layers:
        layer.keys[layer.length] = out
        out = out + layer.keys.sum(0) * layer.length
    return out


@pytest.mark.parametrize(
    "change",
    [
        "none",
        "int attribute",
        "str attribute",
        "tensor shape",
        "tensor dtype",
        "tensor strides",
        "tensor replaced by None",
        "attribute added",
        "another class",
        "one object twice",
    ],
)
def test_alike_objects_in_a_list_are_each_guarded(change):
    class Other(Layer):
        pass

    def make():
        return [Layer() for _ in range(3)]

    jitted = dtcompile.jit(write_layers)
    x = torch.ones(2)
    jitted(x, make())
    eager_layers, compiled_layers = make(), make()
    for layers in (eager_layers, compiled_layers):
        last = layers[-1]
        if change == "int attribute":
            last.length = 1
        elif change == "str attribute":
            last.name = "other"
        elif change == "tensor shape":
            last.keys = torch.zeros(5, 2)
        elif change == "tensor dtype":
            last.keys = torch.zeros(4, 2, dtype=torch.float64)
        elif change == "tensor strides":
            last.keys = torch.zeros(2, 4).t()
        elif change == "tensor replaced by None":
            last.keys = None
        elif change == "attribute added":
            last.extra = 1
        elif change == "another class":
            layers[-1] = Other()
        elif change == "one object twice":
            layers[-1] = layers[0]
    try:
        expected = write_layers(x, eager_layers)
    except (TypeError, AttributeError) as error:  # None has no item assignment
        with pytest.raises(type(error)):
            jitted(x, compiled_layers)
        return
    assert_same_result(jitted(x, compiled_layers), expected)
    for got, want in zip(compiled_layers, eager_layers):
        assert_same_tensor(got.keys, want.keys)
    # "str attribute" is read by no op: the trace does not depend on it, but is guarded all the same.
    assert dtcompile.cache_misses(jitted) == (1 if change == "none" else 2)


def _scales_and_counts(x, cfg):
    cfg.count = cfg.count + 1
    cfg.last = x * cfg.scale
    return x * cfg.scale


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_a_simple_namespace_argument_is_taken_apart_like_any_object(cache):
    import types

    jitted = dtcompile.jit(_scales_and_counts, cache=cache)
    got, expected = types.SimpleNamespace(scale=2.0, count=0), types.SimpleNamespace(scale=2.0, count=0)
    for scale in (2.0, 3.0, 3.0):
        got.scale = expected.scale = scale
        assert_same_result(jitted(torch.ones(2), got), _scales_and_counts(torch.ones(2), expected))
        assert got.count == expected.count
        assert_same_tensor(got.last, expected.last)


class _Settings:
    def __init__(self):
        self.scale = 1.0
        self.table = torch.ones(2)


SETTINGS = _Settings()


def _set_then_read_global(x, settings):
    settings.scale = 2.0
    return x * SETTINGS.scale


def _identity_of_the_global(x, settings):
    return x * 2 if settings is SETTINGS else x


class _HoldsSettings(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.settings = SETTINGS

    def forward(self, x, settings):
        settings.scale = 3.0
        return x * self.settings.scale


@pytest.mark.parametrize("fn", [_set_then_read_global, _identity_of_the_global, _HoldsSettings()])
def test_an_object_of_the_call_also_reached_another_way_is_refused(fn):
    """The traced code gets a stand-in for the call's object: reached another way too (a
    global, a module's attribute), the two would be different objects while tracing."""
    with pytest.raises(dtcompile.TracingError, match=r"args\[1\] is also reached as"):
        dtcompile.jit(fn)(torch.ones(2), SETTINGS)
    assert SETTINGS.scale == 1.0  # nothing done


def test_copying_an_object_after_compiling_compiles_nothing_new():
    """``copy.deepcopy`` (and pickle) add ``__slotnames__`` to a class at the first copy of
    an instance: the class's names are guarded by their number, so the next call missed."""

    class Scaled:
        def __init__(self):
            self.k = torch.tensor(2.0)

        def apply(self, x):
            return x * self.k

    def fn(x, obj):
        return obj.apply(x)

    jitted, obj, x = dtcompile.jit(fn), Scaled(), torch.randn(3)
    jitted(x, obj)
    copy.deepcopy(obj)
    assert_same_tensor(jitted(x, obj), fn(x, obj))
    assert dtcompile.cache_misses(jitted) == 1


class _SlotAndDict:
    __slots__ = ("t", "__dict__")

    def __init__(self, t):
        self.t = t  # in a slot
        self.k = 3  # in the __dict__


class _DictBase:
    def __init__(self, t):
        self.t = t


class _SlotOnTop(_DictBase):
    __slots__ = ("scale",)

    def __init__(self, t):
        super().__init__(t)
        self.scale = 2.0


def _reads_slots(c):
    return c.t * getattr(c, "k", 1) * getattr(c, "scale", 1.0)


@pytest.mark.parametrize("make", [_SlotAndDict, _SlotOnTop])
def test_an_argument_object_holding_values_in_slots_is_refused_naming_it(make):
    # Taken apart by its __dict__, its stand-in lacked the slots: an AttributeError, or
    # getattr's default silently.
    with pytest.raises(UnsupportedInputError, match=r"args\[0\] is a .*none in __slots__"):
        dtcompile.jit(_reads_slots)(make(torch.ones(2)))


def _policy(x, w):
    h = x @ w
    return torch.distributions.Normal(h, h.exp())


def _categorical(x, w):
    return torch.distributions.Categorical(logits=x @ w)


def _squashed(x, w):
    base = torch.distributions.Normal(x @ w, torch.ones(3))
    return torch.distributions.TransformedDistribution(base, [torch.distributions.transforms.TanhTransform()])


def _multivariate(x, w):
    return torch.distributions.MultivariateNormal(x @ w, scale_tril=torch.eye(3))


@torch.enable_grad()
@pytest.mark.parametrize("fn", [_policy, _categorical, _squashed, _multivariate])
def test_a_distribution_returned_is_made_anew_with_eager_s_values_and_gradients(fn):
    # An RL policy's head returns a distribution: it was refused (a torch object). Its
    # state is its attributes; its argument checks are data branches, checked at each call.
    jitted = dtcompile.jit(fn)
    for seed in range(3):
        torch.manual_seed(seed)
        x, w = torch.randn(4, 3), torch.randn(3, 3)
        we, wc = w.clone().requires_grad_(), w.clone().requires_grad_()
        expected, got = fn(x, we), jitted(x, wc)
        assert type(got) is type(expected) and got.batch_shape == expected.batch_shape
        value = torch.zeros(4, dtype=torch.long) if fn is _categorical else torch.rand(4, 3) * 1.8 - 0.9
        torch.testing.assert_close(got.log_prob(value), expected.log_prob(value), rtol=0, atol=0)
        expected.log_prob(value).sum().backward()
        got.log_prob(value).sum().backward()
        torch.testing.assert_close(wc.grad, we.grad, rtol=0, atol=0)


def test_a_distribution_s_argument_check_runs_at_each_call():
    jitted = dtcompile.jit(lambda x, s: torch.distributions.Normal(x, s, validate_args=True))
    jitted(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="Expected parameter scale"):
        jitted(torch.zeros(3), -torch.ones(3))


def _a_key_that_is_no_field(x):
    out = BaseModelOutputWithPast(last_hidden_state=x * 2)
    out["custom"] = x + 1
    return out


def _a_field_set_to_none_after(x):
    out = BaseModelOutputWithPast(last_hidden_state=x * 2, attentions=(x.sum(),))
    out.last_hidden_state = None  # (its key stays, its attribute is None)
    return out


@pytest.mark.parametrize("fn", [_a_key_that_is_no_field, _a_field_set_to_none_after])
def test_a_model_output_whose_items_and_attributes_differ_is_refused(fn):
    # Made anew by its constructor: a raw TypeError (no such argument), or the attribute
    # set to None came back as the tensor, silently.
    fn(torch.ones(2))  # (eager runs)
    with pytest.raises(dtcompile.TracingError, match="is no field or not its attribute"):
        dtcompile.jit(fn)(torch.ones(2))
