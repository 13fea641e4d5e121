"""Single process: Python values a program reads from globals, closure cells, helper
functions, Python modules and module attributes are guarded like arguments. A change
compiles a new entry (a cache miss) and gives eager's result; calling again with the
same values hits."""

import enum
import functools
import sys
import types
from dataclasses import dataclass

import numpy
import pytest
import torch
import torch.nn.functional as F

import dtcompile
from dtcompile.capture.python_reads import value_key


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def assert_same_tensor(got, expected):
    """Eager's type, dtype, shape, strides and values (NaN where eager has NaN)."""
    assert type(got) is type(expected)
    assert (got.dtype, got.shape, got.stride()) == (expected.dtype, expected.shape, expected.stride())
    torch.testing.assert_close(got, expected, equal_nan=True)


def counts(jitted):
    return dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)


G = None  # the global the functions below read; each test sets it and puts it back


@pytest.fixture(autouse=True)
def restore_g():
    yield
    global G
    G = None


def by_float(x):
    return x.float() / G


def by_int_or_float(x):
    return x * G  # an int tensor times an int stays int, times a float becomes float


def by_flag(x):
    return x + 1 if G else x - 1


def by_mode(x):
    return x * 2 if G == "double" else x / 2


def by_tuple(x):
    return x * G[0] + G[1]


@pytest.mark.parametrize(
    "fn, values, dtype",
    [
        (by_float, [2.0, 3.0, 3.0, 2.0, 0.0, -0.0, float("nan"), float("nan")], torch.float32),
        (by_int_or_float, [2, 3, 2.0, 2, True], torch.int64),
        (by_flag, [True, False, 1, 0, True], torch.float32),
        (by_mode, ["double", "half", "double"], torch.float32),
        (by_tuple, [(2, 3), (2.0, 3), (2, 3), (2, 4), (2, 3.0)], torch.int64),
    ],
)
def test_a_global_scalar_is_guarded_by_type_and_value(fn, values, dtype):
    global G
    jf = dtcompile.jit(fn)
    x = torch.arange(1, 5).to(dtype)
    seen = []
    for value in values:
        G = value
        key = value_key(value)
        if key not in seen:
            seen.append(key)
        assert_same_tensor(jf(x), fn(x))
        assert dtcompile.cache_misses(jf) == len(seen), (value, counts(jf))
    assert sum(counts(jf)) == len(values)


def test_a_global_in_a_module_forward():
    global G

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * G

    model = Scale()
    jm = dtcompile.jit(model)
    x = torch.randn(2, 4)
    for value, expected in ((2.0, (1, 0)), (2.0, (1, 1)), (3.0, (2, 1)), (2.0, (2, 2))):
        G = value
        assert_same_tensor(jm(x), model(x))
        assert counts(jm) == expected


def test_closure_cell_rebound_by_nonlocal():
    scale = 2.0

    def f(x):
        return x * scale

    def set_scale(value):
        nonlocal scale
        scale = value

    jf = dtcompile.jit(f)
    x = torch.randn(3)
    assert_same_tensor(jf(x), x * 2.0)
    set_scale(5.0)
    assert_same_tensor(jf(x), x * 5.0)
    assert_same_tensor(jf(x), x * 5.0)
    assert counts(jf) == (2, 1)


def test_a_lambda_closing_over_a_variable_that_changes():
    shift = 1.0
    jf = dtcompile.jit(lambda x: x + shift)
    x = torch.zeros(2)
    for value in (1.0, 2.0, 2.0, 1.0):
        shift = value
        assert_same_tensor(jf(x), torch.full((2,), value))
    assert counts(jf) == (2, 2)


def test_a_closure_that_changes_between_calls():
    state = {"mode": "relu"}

    def make():
        act = state["mode"]

        def inner(x):
            return torch.relu(x) if act == "relu" else torch.tanh(x)

        return inner

    inner = make()
    jf = dtcompile.jit(inner)
    x = torch.randn(5)
    assert_same_tensor(jf(x), torch.relu(x))
    inner.__closure__[0].cell_contents = "tanh"
    assert_same_tensor(jf(x), torch.tanh(x))
    assert counts(jf) == (2, 0)


EPS = 1e-5


def helper(x):
    return x / (x.abs().sum() + EPS)


def calls_helper(x):
    return helper(x) * 2


def test_a_helper_function_whose_global_changes():
    global EPS
    jf = dtcompile.jit(calls_helper)
    x = torch.randn(4)
    try:
        assert_same_tensor(jf(x), calls_helper(x))
        EPS = 10.0
        assert_same_tensor(jf(x), calls_helper(x))
        assert_same_tensor(jf(x), calls_helper(x))
        assert counts(jf) == (2, 1)
    finally:
        EPS = 1e-5


def activation(x):
    return torch.relu(x)


def other_activation(x):
    return torch.sigmoid(x)


def uses_activation(x):
    return activation(x) + 1


def test_a_global_function_replaced_by_another():
    global activation
    original = activation
    jf = dtcompile.jit(uses_activation)
    x = torch.randn(4)
    try:
        assert_same_tensor(jf(x), torch.relu(x) + 1)
        activation = other_activation
        assert_same_tensor(jf(x), torch.sigmoid(x) + 1)
        activation = original
        assert_same_tensor(jf(x), torch.relu(x) + 1)
        assert counts(jf) == (2, 1)
    finally:
        activation = original


CONFIG_MODULE = types.ModuleType("user_config")
CONFIG_MODULE.SCALE = 2.0


def uses_a_python_module(x):
    return x * CONFIG_MODULE.SCALE


def test_an_attribute_of_a_user_python_module():
    jf = dtcompile.jit(uses_a_python_module)
    x = torch.randn(3)
    try:
        assert_same_tensor(jf(x), x * 2.0)
        CONFIG_MODULE.SCALE = 4.0
        assert_same_tensor(jf(x), x * 4.0)
        assert counts(jf) == (2, 0)
    finally:
        CONFIG_MODULE.SCALE = 2.0


@dataclass
class Config:
    scale: float = 2.0
    use_bias: bool = True


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.eps = 1e-6

    def forward(self, x):
        return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()


class Block(torch.nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.lin = torch.nn.Linear(4, 4)
        self.norm = Norm()
        self.scale = 1.0
        self.use_bias = True
        self.last = None

    def forward(self, x):
        y = self.norm(self.lin(x)) * self.scale * self.config.scale
        if self.use_bias and self.config.use_bias:
            y = y + 1
        self.last = y  # assigned a tensor by the forward: replayed after each call, not guarded
        return y


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m, "scale", 3.0),
        lambda m: setattr(m, "use_bias", False),
        lambda m: setattr(m.norm, "eps", 10.0),
        lambda m: setattr(m.config, "scale", 0.5),
        lambda m: setattr(m.config, "use_bias", False),
        lambda m: setattr(m, "config", Config(scale=5.0)),
    ],
    ids=["scale", "flag", "submodule eps", "config scale", "config flag", "config replaced"],
)
def test_module_attributes(change):
    torch.manual_seed(0)
    model, reference = Block(Config()), Block(Config())
    reference.load_state_dict(model.state_dict())
    jm = dtcompile.jit(model)
    x = torch.randn(2, 4)
    for _ in range(2):
        assert_same_tensor(jm(x), reference(x))
    assert counts(jm) == (1, 1)
    change(model)
    change(reference)
    for _ in range(2):
        assert_same_tensor(jm(x), reference(x))
    assert counts(jm) == (2, 2)
    assert_same_tensor(model.last, reference.last)


class Settings:
    gain = 2.0  # a class attribute, read through an instance


class Base(torch.nn.Module):
    def act(self, y):
        return torch.relu(y)


class Patched(Base):
    SCALE = 3.0

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.settings = Settings()
        self.last = None

    def helper(self, y):
        return y * self.SCALE

    def forward(self, x):
        y = self.act(self.helper(self.lin(x))) * self.settings.gain
        self.last = y  # assigned by the forward: its name does not count as added
        return y


# Code patched and class attributes changed after compiling, on an instance (a name that
# shadows the class's) or on the class itself; each undone after the test.
CODE_CHANGES = {
    "forward of a submodule instance": lambda m: setattr(m.lin, "forward", lambda x: x + 1),
    "method on the instance": lambda m: setattr(m, "helper", lambda y: y - 1),
    "class constant shadowed on the instance": lambda m: setattr(m, "SCALE", 5.0),
    "class constant": lambda m: setattr(Patched, "SCALE", 7.0),
    "method of the class": lambda m: setattr(Patched, "helper", lambda self, y: y + 2),
    "method of a base, overridden in the class": lambda m: setattr(Patched, "act", lambda self, y: y * 0.5),
    "method of a base": lambda m: setattr(Base, "act", lambda self, y: torch.tanh(y)),
    "forward of a library class": lambda m: setattr(torch.nn.Linear, "forward", lambda self, x: x * 0),
    "config attribute shadowing its class's": lambda m: setattr(m.settings, "gain", 9.0),
    "config class attribute": lambda m: setattr(Settings, "gain", 11.0),
}


@pytest.fixture
def restore_classes():
    saved = [(cls, dict(vars(cls))) for cls in (Patched, Base, Settings, torch.nn.Linear)]
    yield
    for cls, attributes in saved:
        for name in set(vars(cls)) - set(attributes):
            delattr(cls, name)
        for name, value in attributes.items():
            if vars(cls).get(name) is not value and not name.startswith("__"):
                setattr(cls, name, value)


@pytest.mark.parametrize("change", list(CODE_CHANGES))
def test_code_patched_and_class_attributes_changed_after_compiling(change, restore_classes):
    torch.manual_seed(0)
    model = Patched()
    jm = dtcompile.jit(model)
    x = torch.randn(2, 4)
    for _ in range(2):
        jm(x)
    assert counts(jm) == (1, 1)  # the forward's own assignment does not miss
    CODE_CHANGES[change](model)
    for _ in range(2):
        assert_same_tensor(jm(x), Patched.forward(model, x))  # eager: the forward as the class has it now
    assert counts(jm) == (2, 2)


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.ready = False

    def forward(self, x):
        self.calls = self.calls + 1  # a Python counter: the program bakes in the new value
        self.ready = True
        return x * self.calls


def test_module_attributes_the_forward_assigns_constants():
    model, reference = Counter(), Counter()
    jm = dtcompile.jit(model)
    x = torch.ones(2)
    for _ in range(3):
        assert_same_tensor(jm(x), reference(x))
    assert (model.calls, model.ready) == (reference.calls, reference.ready) == (3, True)
    assert counts(jm) == (3, 0)  # correct, at a compile per call: the counter is guarded


def test_module_attribute_under_symbolic_values():
    torch.manual_seed(0)
    model, reference = Block(Config()), Block(Config())
    reference.load_state_dict(model.state_dict())
    jm = dtcompile.jit(model, cache="symbolic values")
    for rows in (2, 3):
        x = torch.randn(rows, 4)
        assert_same_tensor(jm(x), reference(x))
    assert counts(jm) == (1, 1)
    model.scale = reference.scale = 7.0
    for rows in (3, 5):
        x = torch.randn(rows, 4)
        assert_same_tensor(jm(x), reference(x))
    assert counts(jm) == (2, 2)


def test_a_plain_function_in_a_module_attribute():
    class Act(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.act = F.relu

        def forward(self, x):
            return self.act(x)

    model = Act()
    jm = dtcompile.jit(model)
    x = torch.randn(5)
    assert_same_tensor(jm(x), F.relu(x))
    model.act = torch.tanh
    assert_same_tensor(jm(x), torch.tanh(x))
    assert counts(jm) == (2, 0)


W = torch.ones(3)


def uses_a_global_tensor(x):
    return x * W


def test_a_global_tensor_rebound():
    global W
    jf = dtcompile.jit(uses_a_global_tensor)
    x = torch.randn(3)
    try:
        assert_same_tensor(jf(x), x)
        W.mul_(2)  # in place: read at each call, same entry
        assert_same_tensor(jf(x), x * 2)
        W = torch.full((3,), 5.0)  # rebound: a new entry
        assert_same_tensor(jf(x), x * 5)
        assert counts(jf) == (2, 1)
    finally:
        W = torch.ones(3)


COUNTER = 0


def counts_calls(x):
    global COUNTER
    COUNTER += 1
    return x + 1


class _Counted:
    calls = 0


def counts_in_a_class(x):
    _Counted.calls += 1
    return x + _Counted.calls


def counts_in_a_cell():
    calls = 0

    def fn(x):
        nonlocal calls
        calls += 1
        return x + calls

    return fn


@pytest.mark.parametrize("fn", [counts_calls, counts_in_a_class, counts_in_a_cell()])
def test_a_value_the_traced_code_rebinds_is_refused_and_put_back(fn):
    """Eager rebinds it at every call; a program would once, while tracing, and bake in
    the value read (``x + COUNTER`` stays ``x + 1``)."""
    before = (COUNTER, _Counted.calls)
    with pytest.raises(dtcompile.TracingError, match="changed .*a Python value outside its inputs"):
        dtcompile.jit(fn)(torch.zeros(2))
    assert (COUNTER, _Counted.calls) == before
    if fn.__closure__:
        assert fn.__closure__[0].cell_contents == 0


def test_library_code_is_not_followed():
    state = dtcompile.capture.python_state.PythonState.of_function(calls_helper)
    holders = {id(read.holder) for read in state.reads}
    assert id(vars(sys.modules[__name__])) in holders
    assert not any(read.holder is vars(torch.nn.functional) for read in state.reads)
    assert {read.key for read in state.reads} >= {"helper", "EPS"}


OFFSET = 0.0


class WithHelper(torch.nn.Module):
    """Reads a global in a method its forward calls, and in a forward hook."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_forward_hook(lambda module, args, out: out * HOOK_SCALE)

    def shifted(self, y):
        return y + OFFSET

    def forward(self, x):
        return self.shifted(self.lin(x))


HOOK_SCALE = 1.0


def test_a_method_and_a_hook_reading_globals():
    global OFFSET, HOOK_SCALE
    model = WithHelper()
    jm = dtcompile.jit(model)
    x = torch.randn(2, 3)
    try:
        for offset, hook_scale in ((0.0, 1.0), (1.0, 1.0), (1.0, 3.0), (1.0, 3.0)):
            OFFSET, HOOK_SCALE = offset, hook_scale
            assert_same_tensor(jm(x), model(x))
        assert counts(jm) == (3, 1)
    finally:
        OFFSET, HOOK_SCALE = 0.0, 1.0


MODEL = None  # set by the tests below


def calls_a_global_model(x):
    return MODEL(x).sum(-1)


def test_a_function_calling_a_module_sees_its_attributes():
    global MODEL
    MODEL = TrainingBlock(Block(Config()))
    jf = dtcompile.jit(calls_a_global_model)
    x = torch.randn(2, 4)
    try:
        for change in (
            lambda: None,
            lambda: setattr(MODEL.block.norm, "eps", 3.0),
            lambda: setattr(MODEL.block.config, "scale", 9.0),
        ):
            change()
            assert_same_tensor(jf(x), calls_a_global_model(x))
        assert counts(jf) == (3, 0)
    finally:
        MODEL = None


def test_a_module_a_function_calls_must_not_assign_attributes():
    global MODEL
    MODEL = Block(Config())  # its forward assigns self.last: not replayable, it is no input
    try:
        with pytest.raises(dtcompile.TracingError, match="the attributes of the module global 'MODEL'"):
            dtcompile.jit(calls_a_global_model)(torch.randn(2, 4))
        assert MODEL.last is None  # put back: no proxy left
    finally:
        MODEL = None


def test_training_call_with_a_changed_attribute():
    torch.manual_seed(0)
    model, reference = Block(Config()), Block(Config())
    reference.load_state_dict(model.state_dict())
    model.last = reference.last = torch.zeros(())  # not assigned in a training call: see Block
    jm = dtcompile.jit(TrainingBlock(model))
    eager = TrainingBlock(reference)
    x = torch.randn(2, 4)
    with torch.enable_grad():
        for scale in (1.0, 2.0):
            model.scale = reference.scale = scale
            jm(x).sum().backward()
            eager(x).sum().backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
    assert counts(jm) == (2, 0)


class TrainingBlock(torch.nn.Module):
    """Block's computation without its attribute assignment (not replayed with gradients)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        b = self.block
        y = b.norm(b.lin(x)) * b.scale * b.config.scale
        return y + 1 if b.use_bias and b.config.use_bias else y


SKIP = [1]
SETTINGS = {"scale": 2.0, "mode": "add"}


def reads_containers(x):
    y = x * SETTINGS["scale"]
    y = y + 1 if SETTINGS["mode"] == "add" else y - 1
    return y * 0 if 1 in SKIP else y


def test_small_lists_and_dicts_of_scalars_are_guarded_by_contents():
    jf = dtcompile.jit(reads_containers)
    x = torch.randn(3)
    try:
        for change in (
            lambda: None,
            lambda: SETTINGS.update(scale=3.0),
            lambda: SETTINGS.update(mode="sub"),
            lambda: SKIP.remove(1),
            lambda: SKIP.append(1.0),  # 1.0 in SKIP like 1: a new entry, the same result
            lambda: None,
        ):
            change()
            assert_same_tensor(jf(x), reads_containers(x))
        assert counts(jf) == (5, 1)
    finally:
        SKIP[:] = [1]
        SETTINGS.update(scale=2.0, mode="add")


@pytest.mark.parametrize("cache", ["symbolic values", "no caching"])
def test_a_global_under_other_cache_options(cache):
    global G
    jf = dtcompile.jit(by_float, cache=cache)
    for value, rows in ((2.0, 3), (2.0, 5), (4.0, 5), (4.0, 7)):
        G = value
        x = torch.arange(1.0, rows + 1)
        assert_same_tensor(jf(x), by_float(x))
    if cache == "symbolic values":
        assert counts(jf) == (2, 2)


def test_a_global_under_the_eager_check():
    global G
    jf = dtcompile.jit(by_float, check="eager")
    x = torch.arange(1.0, 4.0)
    for value in (2.0, 5.0):
        G = value
        assert_same_tensor(jf(x), by_float(x))


view = None  # a script's variable named like an attribute the function uses (``.view``)


def uses_an_attribute_named_view(x):
    return torch.nn.functional.relu(x).sum(0).view(1, -1)


def test_attribute_names_do_not_guard_globals_of_that_name():
    global view
    jf = dtcompile.jit(uses_an_attribute_named_view)
    x = torch.randn(3, 2)
    try:
        for _ in range(3):
            view = jf(x)  # rebinds the global ``view`` at each call
            assert_same_tensor(view, uses_an_attribute_named_view(x))
        reads = dtcompile.capture.python_state.PythonState.of_function(uses_an_attribute_named_view).reads
        assert [read.key for read in reads if read.holder is globals()] == ["torch"]  # not ``view``
        assert {read.key for read in reads if read.holder is vars(torch.nn.functional)} == {"relu"}
        assert counts(jf) == (1, 2)
    finally:
        view = None


@dataclass
class Activation:
    fn: object = torch.relu


class UsesConfigFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = Activation()

    def forward(self, x):
        return self.config.fn(x)


def test_a_function_a_config_holds_is_guarded_by_identity():
    model = UsesConfigFunction()
    jm = dtcompile.jit(model)
    x = torch.randn(4)
    assert_same_tensor(jm(x), torch.relu(x))
    model.config.fn = torch.tanh
    assert_same_tensor(jm(x), torch.tanh(x))
    assert counts(jm) == (2, 0)


class Switchable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        y = self.act(self.lin(x))
        return y * 2 if self.training else y


def test_the_state_of_a_module_a_function_calls():
    global MODEL
    MODEL = Switchable()
    jf = dtcompile.jit(calls_a_global_model)
    x = torch.randn(2, 3)
    try:
        for change in (
            lambda: None,
            lambda: MODEL.eval(),
            lambda: setattr(MODEL.lin, "weight", torch.nn.Parameter(torch.randn(3, 3))),
            lambda: setattr(MODEL, "act", torch.nn.Tanh()),
            lambda: setattr(MODEL.lin, "bias", None),
            lambda: None,
        ):
            change()
            assert_same_tensor(jf(x), calls_a_global_model(x))
        assert counts(jf) == (5, 1)
    finally:
        MODEL = None


FLAGS = {"a": 1.0, "b": 2.0}


def reads_a_whole_dict(x):
    return x * sum(FLAGS.values()) + len(FLAGS)


def test_a_dict_read_whole_is_checked_by_its_version_then_by_contents():
    """The dict read at each call is the one traced, unchanged since (its version): no
    comparing; changed, even back to the traced contents, its contents are compared."""
    jf = dtcompile.jit(reads_a_whole_dict)
    x = torch.randn(3)
    try:
        for change in (
            lambda: None,
            lambda: None,
            lambda: FLAGS.update(a=3.0),
            lambda: FLAGS.update(a=1.0),  # back to the first entry's contents, a new version
            lambda: FLAGS.update(c=0.0),
            lambda: FLAGS.pop("c"),
        ):
            change()
            assert_same_tensor(jf(x), reads_a_whole_dict(x))
        assert counts(jf) == (3, 3)
    finally:
        FLAGS.clear()
        FLAGS.update(a=1.0, b=2.0)


def _scaled(x, k=2.0, *, shift=0.0):
    return x * k + shift


def _calls_scaled(x):
    return _scaled(x)


_PARTIAL = functools.partial(_scaled, k=3.0)
NESTED = {"scales": [2.0, {"inner": 1.0}], "pair": ([1.0], 2.0)}


def _reads_nested(x):
    return x * NESTED["scales"][1]["inner"] + NESTED["pair"][0][0]


class _Level:
    def __init__(self, **attributes):
        vars(self).update(attributes)


DEEP = _Level(attention=_Level(rope=_Level(theta=2.0)))


def _reads_deep(x):
    return x * DEEP.attention.rope.theta


def _imports_inside(x):
    import dtcompile_test_settings

    return x * dtcompile_test_settings.SCALE


# Values read at each call that live in no module's or globals' dict, or deeper than
# the first level: each changed (then put back) after a first compile.
READ_AT_EACH_CALL = {
    "default argument": (_scaled, lambda: setattr(_scaled, "__defaults__", (5.0,))),
    "keyword-only default": (_scaled, lambda: setattr(_scaled, "__kwdefaults__", {"shift": 1.0})),
    "default of a helper": (_calls_scaled, lambda: setattr(_scaled, "__defaults__", (7.0,))),
    "keyword of a partial": (_PARTIAL, lambda: _PARTIAL.keywords.update(k=9.0)),
    "value in a nested dict": (_reads_nested, lambda: NESTED["scales"][1].update(inner=4.0)),
    "list in a tuple": (_reads_nested, lambda: NESTED["pair"][0].append(0.0) or NESTED["pair"][0].reverse()),
    "attribute three objects down": (_reads_deep, lambda: setattr(DEEP.attention.rope, "theta", 6.0)),
    "module imported inside the function": (
        _imports_inside,
        lambda: setattr(sys.modules["dtcompile_test_settings"], "SCALE", 8.0),
    ),
}


@pytest.fixture
def restore_read_state():
    settings = types.ModuleType("dtcompile_test_settings")
    settings.SCALE = 2.0
    sys.modules[settings.__name__] = settings
    saved = (_scaled.__defaults__, dict(_scaled.__kwdefaults__), dict(_PARTIAL.keywords), DEEP.attention.rope.theta)
    NESTED.update(scales=[2.0, {"inner": 1.0}], pair=([1.0], 2.0))
    yield
    del sys.modules[settings.__name__]
    _scaled.__defaults__, _scaled.__kwdefaults__ = saved[0], saved[1]
    _PARTIAL.keywords.clear()
    _PARTIAL.keywords.update(saved[2])
    DEEP.attention.rope.theta = saved[3]


@pytest.mark.parametrize("case", list(READ_AT_EACH_CALL))
def test_values_read_at_each_call_outside_dicts_and_deeper(case, restore_read_state):
    fn, change = READ_AT_EACH_CALL[case]
    jf = dtcompile.jit(fn)
    x = torch.randn(3)
    for _ in range(2):
        assert_same_tensor(jf(x), fn(x))
    assert counts(jf) == (1, 1)
    change()
    for _ in range(2):
        assert_same_tensor(jf(x), fn(x))
    assert counts(jf) == (2, 2)


class _GrowsAList(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.history = []

    def forward(self, x):
        self.history = self.history + [x.sum()]  # a container assigned: guarded, eager's grows
        return x * len(self.history)


class _DeletesAnAttribute(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pending = 3.0

    def forward(self, x):
        scale = getattr(self, "pending", 1.0)
        if hasattr(self, "pending"):
            del self.pending  # the next call does not find it
        return x * scale


class _StoresOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        y = self.lin(x)
        self.last = [y]  # assigned, never read: not guarded once it exists
        return y


# _StoresOutputs: its attribute, absent before the first call (code may read it by a name
# made at run time), compiles once more.
@pytest.mark.parametrize("cls, misses", [(_GrowsAList, 4), (_DeletesAnAttribute, 2), (_StoresOutputs, 2)])
def test_containers_and_deletions_the_forward_makes_are_guarded(cls, misses):
    torch.manual_seed(0)
    model = cls()
    torch.manual_seed(0)
    reference = cls()
    jitted = dtcompile.jit(model)
    for _ in range(4):
        assert_same_tensor(jitted(torch.ones(2, 2)), reference(torch.ones(2, 2)))
    assert dtcompile.cache_misses(jitted) == misses


class _StoresATensorAndATupleOfIt(torch.nn.Module):
    def forward(self, x):
        a = x * 2
        self.a = a
        self.pair = (a, x)  # a container of the last call's tensors: never read by name
        return x + 1


class _StoresAndReadsBack(torch.nn.Module):
    def forward(self, x):
        self.a = x * 2
        self.pair = [self.a, x]  # ``self.a`` is read (after its assignment): guarded, so a compile a call
        return x + 1


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("cls, misses", [(_StoresATensorAndATupleOfIt, 2), (_StoresAndReadsBack, 4)])
def test_a_forward_storing_a_tensor_and_a_container_of_it(cls, misses, cache):
    """At the next call the container holds a tensor of the call (the module's attribute
    ``a``): that was refused as a table looked up by tensor, which no code reads here."""
    model, reference = cls(), cls()
    jitted = dtcompile.jit(model, cache=cache)
    for _ in range(4):
        x = torch.randn(3)
        assert_same_tensor(jitted(x), reference(x))
        assert torch.equal(model.a, reference.a) and model.pair[0] is model.a and model.pair[1] is x
    assert dtcompile.cache_misses(jitted) == misses


def test_a_simple_namespace_config_is_followed():
    config = types.SimpleNamespace(scale=2.0, inner=types.SimpleNamespace(shift=1.0))

    def fn(x):
        return x * config.scale + config.inner.shift

    jitted = dtcompile.jit(fn)
    x = torch.ones(2)
    assert_same_tensor(jitted(x), fn(x))
    config.scale = 5.0
    assert_same_tensor(jitted(x), fn(x))
    config.inner.shift = -1.0
    assert_same_tensor(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 3


class _KeyedAttributes:
    """A class whose ``__getattr__`` raises KeyError, not AttributeError."""

    def __init__(self):
        self.store = {"scale": 2.0}

    def __getattr__(self, name):
        return self.store[name]


def test_an_object_whose_getattr_raises_key_error():
    holder = _KeyedAttributes()

    def fn(x):
        return x * holder.scale

    jitted = dtcompile.jit(fn)
    assert_same_tensor(jitted(torch.ones(2)), fn(torch.ones(2)))
    holder.store["scale"] = 3.0
    assert_same_tensor(jitted(torch.ones(2)), fn(torch.ones(2)))


class _Holder:
    def __init__(self):
        self.value = 2.0


_TABLE = {"act": torch.relu}
_OBJECTS = [_Holder()]
_BY_INDEX = {0: 2.0}


def _changed_table():
    _TABLE["act"] = torch.neg


def _changed_object_in_a_list():
    _OBJECTS[0].value = 5.0


def _changed_int_keyed_dict():
    _BY_INDEX[0] = 5.0


@pytest.mark.parametrize(
    "fn, change",
    [
        (lambda x: _TABLE["act"](x - 1), _changed_table),
        (lambda x: x * _OBJECTS[0].value, _changed_object_in_a_list),
        (lambda x: x * _BY_INDEX[0], _changed_int_keyed_dict),
    ],
    ids=["function_table", "object_in_a_list", "int_keyed_dict"],
)
def test_small_containers_of_objects_are_guarded_by_their_items(fn, change):
    saved = (dict(_TABLE), _OBJECTS[0].value, dict(_BY_INDEX))
    try:
        jitted = dtcompile.jit(fn)
        x = torch.full((3,), 0.5)
        assert_same_tensor(jitted(x), fn(x))
        change()
        assert_same_tensor(jitted(x), fn(x))
        assert dtcompile.cache_misses(jitted) == 2
    finally:
        _TABLE.update(saved[0])
        _OBJECTS[0].value = saved[1]
        _BY_INDEX.update(saved[2])


class _LazyCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = None

    def forward(self, x):
        if self.cache is None:  # read, then assigned a tensor: the read stays guarded
            self.cache = x * 10
        return x + self.cache[: x.shape[0]]


class _CreatedOnce(torch.nn.Module):
    def forward(self, x):
        if not hasattr(self, "cache"):  # absent before the first call: its absence is guarded
            self.cache = x * 10
        return x + self.cache[: x.shape[0]]


class _GetattrDefault(torch.nn.Module):
    def forward(self, x):
        cache = getattr(self, "cache", None)
        if cache is None:
            cache = self.cache = x * 10
        return x + cache[: x.shape[0]]


class _RunningMax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.longest = 0

    def forward(self, x):
        self.longest = max(self.longest, x.shape[0])  # a size computed from the value read
        return x[: self.longest] * self.longest


class _RecordsLength(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = 0

    def forward(self, x):
        self.seen = x.shape[0] * 2  # assigned, never read by name: not guarded
        return x * 2


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("cls", [_LazyCache, _CreatedOnce, _GetattrDefault, _RunningMax, _RecordsLength])
def test_attributes_read_then_assigned_by_the_forward(cls, cache):
    """Eager's results and state when the forward reads an attribute it then assigns: the
    value read (or its absence) was baked into the program, so another compiles anew."""
    model, reference = cls(), cls()
    jitted = dtcompile.jit(model, cache=cache)
    for n, fill in [(4, 4.0), (4, 4.5), (3, 3.0), (2, 5.0), (3, 2.0)]:
        x = torch.full((n,), fill)
        assert_same_tensor(jitted(x), reference(x))
        for name, value in vars(reference).items():
            if not name.startswith("_"):
                got = getattr(model, name)
                assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, name
    if cls is _RecordsLength and cache == "symbolic values":
        assert dtcompile.cache_misses(jitted) == 1


def reads_a_late_global(x):
    try:
        return x + LATE  # noqa: F821 (defined by the test)
    except NameError:
        return x - 1


def shadows_a_builtin(x):
    return x * max(2, 1)


def test_a_global_absent_when_compiled_is_guarded_as_absent():
    """A name not defined yet (a NameError caught) or a builtin: defining it after
    compiling compiles anew, as eager sees it."""
    x = torch.zeros(2)
    late, shadowing = dtcompile.jit(reads_a_late_global), dtcompile.jit(shadows_a_builtin)
    assert_same_tensor(late(x), reads_a_late_global(x))
    assert_same_tensor(shadowing(x + 1), shadows_a_builtin(x + 1))
    module = sys.modules[__name__]
    module.LATE, module.max = 5.0, lambda *args: 10
    try:
        assert_same_tensor(late(x), reads_a_late_global(x))
        assert_same_tensor(shadowing(x + 1), shadows_a_builtin(x + 1))
    finally:
        del module.LATE, module.max
    assert_same_tensor(late(x), reads_a_late_global(x))
    assert_same_tensor(shadowing(x + 1), shadows_a_builtin(x + 1))
    assert (counts(late), counts(shadowing)) == ((2, 1), (2, 1))


ARRAY, QUEUE, SET = None, None, None  # what the functions below read: each test sets them


def reads_tables(x):
    return x * float(ARRAY[0]) + len(QUEUE) + QUEUE[-1] + (3 in SET)


@pytest.fixture
def tables():
    import collections

    import numpy

    global ARRAY, QUEUE, SET
    ARRAY, QUEUE, SET = numpy.zeros(2), collections.deque([1]), {1, 2}
    yield
    ARRAY, QUEUE, SET = None, None, None


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_numpy_arrays_deques_and_sets_changed_between_calls(cache, tables):
    jf = dtcompile.jit(reads_tables, cache=cache)
    x = torch.ones(2)
    assert_same_tensor(jf(x), reads_tables(x))
    for change in (lambda: ARRAY.__setitem__(0, 5.0), lambda: QUEUE.append(7), lambda: SET.add(3)):
        change()
        assert_same_tensor(jf(x), reads_tables(x))
    assert counts(jf) == (4, 0)


def appends_to_tables(x):
    QUEUE.append(1)
    ARRAY[0] += 1
    return x + len(QUEUE)


def test_numpy_arrays_and_deques_changed_inside_are_refused_and_put_back(tables):
    with pytest.raises(dtcompile.TracingError, match="a Python value outside its inputs"):
        dtcompile.jit(appends_to_tables)(torch.zeros(1))
    assert list(QUEUE) == [1] and ARRAY[0] == 0


TABLES = {}  # a dict of tables the function below reads: the test fills it


def reads_a_dict_of_tables(x):
    return x * float(TABLES["array"][0]) + len(TABLES["queue"]) + (3 in TABLES["set"]) + TABLES["weights"].sum()


def test_small_containers_held_in_a_dict_are_guarded_by_contents():
    import collections

    import numpy

    TABLES.update(array=numpy.ones(2), queue=collections.deque([1]), set={1, 2}, weights=torch.ones(2))
    try:
        jf = dtcompile.jit(reads_a_dict_of_tables)
        x = torch.ones(2)
        assert_same_tensor(jf(x), reads_a_dict_of_tables(x))
        for change in (
            lambda: TABLES["array"].__setitem__(0, 5.0),
            lambda: TABLES["queue"].append(7),
            lambda: TABLES["set"].add(3),
        ):
            change()
            assert_same_tensor(jf(x), reads_a_dict_of_tables(x))
        assert counts(jf) == (4, 0)
    finally:
        TABLES.clear()


PLAN = {}  # a nested table (a tuple of lists, as Hugging Face's ``_pp_plan``): the test fills it


def reads_a_nested_plan(x):
    inputs, outputs = PLAN["layer"]
    return x * len(inputs) + float(outputs[0] is True) + PLAN["scale"][0] + len(PLAN["names"])


def test_nested_containers_changed_in_place_or_replaced_by_equal_ones():
    """Unchanged containers pass by the identity of what they hold; an item replaced by
    an equal one passes by value; a change at any depth, or a value of another type,
    compiles again."""
    PLAN.update(layer=(["hidden"], [True]), scale=[2.0], names={"a": "b"})
    try:
        jf = dtcompile.jit(reads_a_nested_plan)
        x = torch.ones(2)
        assert_same_tensor(jf(x), reads_a_nested_plan(x))
        assert_same_tensor(jf(x), reads_a_nested_plan(x))
        assert counts(jf) == (1, 1)
        PLAN["layer"][0][0] = "".join(["hid", "den"])  # an equal string: no new entry, at each call
        PLAN["scale"][0] = float("2.0")
        for _ in range(2):
            assert_same_tensor(jf(x), reads_a_nested_plan(x))
        assert counts(jf) == (1, 3)
        for change in (
            lambda: PLAN["layer"][0].append("extra"),
            lambda: PLAN["layer"][1].__setitem__(0, 1),  # True to 1: equal, but another type
            lambda: PLAN["scale"].__setitem__(0, 3.0),
            lambda: PLAN["names"].__setitem__("c", "d"),
        ):
            change()
            assert_same_tensor(jf(x), reads_a_nested_plan(x))
            assert_same_tensor(jf(x), reads_a_nested_plan(x))
        assert counts(jf) == (5, 7)
    finally:
        PLAN.clear()


class _Bag:
    def __init__(self, tensors, names):
        self.tensors, self.names = tensors, names


torch.utils._pytree.register_pytree_node(_Bag, lambda b: (b.tensors, b.names), lambda ch, ctx: _Bag(list(ch), ctx))


def reads_a_bag(x, bag):
    return x * (2.0 if bag.names[0] == "a" else 3.0) + bag.tensors[0]


@pytest.mark.parametrize("names", [3, 17])
def test_a_pytree_context_changed_in_place(names):
    """A pytree node's context (here a live list, short or long) is compared with a copy
    taken when compiling: a change in place compiles again."""
    bag = _Bag([torch.ones(2)], ["a"] + [f"n{i}" for i in range(names - 1)])
    jf, x = dtcompile.jit(reads_a_bag), torch.ones(2)
    assert_same_tensor(jf(x, bag), reads_a_bag(x, bag))
    bag.names[0] = "b"
    assert_same_tensor(jf(x, bag), reads_a_bag(x, bag))
    assert counts(jf) == (2, 0)


_OFFSET = 1.0


@functools.singledispatch
def _dispatched(t):
    return t * 2


def test_an_implementation_registered_on_a_singledispatch_function_after_compiling():
    """The registry is functools' (library code, not followed): a new implementation was
    not seen, and the first call's baked in."""
    global _OFFSET

    def fn(x):
        return _dispatched(x) + 0

    jitted = dtcompile.jit(fn)
    x = torch.ones(2)
    assert torch.equal(jitted(x), fn(x))
    _dispatched.register(torch.Tensor)(lambda t: t * 100 + _OFFSET)
    try:
        assert torch.equal(jitted(x), fn(x))
        _OFFSET = 5.0  # a global the registered implementation reads
        assert torch.equal(jitted(x), fn(x))
    finally:
        _OFFSET = 1.0


class _StateByComputedNames(torch.nn.Module):
    """Per-slot state under names made at run time, as layer-indexed code keeps it."""

    def forward(self, x):
        outs = []
        for i in range(2):
            previous = getattr(self, f"state_{i}", None)
            y = x * (i + 1) if previous is None else previous + x
            setattr(self, f"state_{i}", y)
            outs.append(y)
        return torch.stack(outs)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_state_the_forward_creates_under_names_made_at_run_time(cache):
    """No code loads ``state_0`` by name, so its value was not guarded: every call got the
    first call's branch (``previous is None``)."""
    model, reference = _StateByComputedNames(), _StateByComputedNames()
    jitted = dtcompile.jit(model, cache=cache)
    with torch.no_grad():
        for _ in range(4):
            assert_same_tensor(jitted(torch.ones(2)), reference(torch.ones(2)))
    assert dtcompile.cache_misses(jitted) == 2


def _knob(kind: str):
    import ctypes

    return {"memoryview": lambda: memoryview(bytearray([1])), "ctypes": lambda: ctypes.c_double(1.0)}[kind]()


def _knob_value(knob) -> float:
    return float(knob[0]) if isinstance(knob, memoryview) else knob.value


def _set_knob(knob, value: int) -> None:
    if isinstance(knob, memoryview):
        knob[0] = value
    else:
        knob.value = value


class _Knobbed(torch.nn.Module):
    def __init__(self, knob):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.knob = knob

    def forward(self, x):
        return self.lin(x) * _knob_value(self.knob)


@pytest.mark.parametrize("kind", ["memoryview", "ctypes"])
def test_memory_a_module_reads_through_a_memoryview_or_ctypes_changed_between_calls(kind):
    """Compared by identity only, the first call's value stayed baked in."""
    torch.manual_seed(0)
    model = _Knobbed(_knob(kind))
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for value in (1, 5, 5, 2):
            _set_knob(model.knob, value)
            assert_same_tensor(jitted(x), model(x))


@pytest.mark.parametrize("kind", ["memoryview", "ctypes"])
def test_a_layer_s_memoryview_or_ctypes_value_a_parent_changes_between_layers(kind):
    """Repeated blocks compared such a value by identity (the later layers were replayed
    with the first one's), and the parent's writes to it went unseen."""
    knob = _knob(kind)

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(_Knobbed(knob) for _ in range(4))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                _set_knob(knob, i + 1)
                x = layer(x).tanh()
            return x

    torch.manual_seed(0)
    model = Parent()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
        _set_knob(knob, 1)
        # The parent's writes would happen once, while tracing: refused, as a bytearray's are.
        with pytest.raises(dtcompile.TracingError, match=r"changed the module attribute layers\.0\.knob"):
            dtcompile.jit(model)(x)
        assert _knob_value(knob) == 1  # put back
        assert_same_tensor(model(x), expected)


@pytest.mark.parametrize("kind", ["memoryview", "ctypes"])
def test_a_memoryview_or_ctypes_value_the_code_changes_is_refused_and_put_back(kind):
    knob = _knob(kind)

    def fn(x):
        _set_knob(knob, int(_knob_value(knob)) + 1)
        return x * 2

    with pytest.raises(dtcompile.TracingError, match="changed"):
        dtcompile.jit(fn)(torch.ones(2))
    assert _knob_value(knob) == 1


_READERS = {
    "bound get": lambda settings: settings.get,
    "bound __getitem__": lambda settings: settings.__getitem__,
    "values view": lambda settings: (lambda view: lambda key: next(iter(view)))(settings.values()),
}


class _Looking(torch.nn.Module):
    def __init__(self, lookup):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.lookup = lookup  # reads a dict no attribute of the tree holds

    def forward(self, x):
        return self.lin(x) * self.lookup("scale")


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("reader", list(_READERS))
def test_a_dict_read_through_a_built_in_method_or_a_view_changed_between_calls(reader, cache):
    """Only its method (``settings.get``) or view was held: by identity, with no guard
    on the dict it reads, so its change kept the first call's value."""
    settings = {"scale": 1.0}
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Looking(_READERS[reader](settings)), _Looking(_READERS[reader](settings)))
    jitted = dtcompile.jit(model, cache=cache)
    x = torch.randn(2, 4)
    assert_same_tensor(jitted(x), model(x))
    settings["scale"] = 3.0
    assert_same_tensor(jitted(x), model(x))
    assert counts(jitted) == (2, 0)


@pytest.mark.parametrize("reader", list(_READERS))
def test_layers_reading_a_dict_through_a_built_in_method_their_parent_changes(reader):
    """Repeated blocks replayed the first layer for the others: what they can read did
    not follow a built-in method's object or a view's dict."""

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.settings = {"scale": 1.0}
            lookup = _READERS[reader](self.settings)  # one object, held by every layer
            self.layers = torch.nn.ModuleList(_Looking(lookup) for _ in range(4))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                self.settings["scale"] = float(i + 1)
                x = layer(x)
            self.settings["scale"] = 1.0
            return x

    torch.manual_seed(0)
    model = Parent()
    x = torch.randn(2, 4)
    assert_same_tensor(dtcompile.jit(model)(x), model(x))


def test_a_dict_changed_through_a_built_in_method_is_refused_and_put_back():
    settings = {"scale": 1.0}

    class Writing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.put = settings.__setitem__

        def forward(self, x):
            self.put("scale", 2.0)
            return self.lin(x)

    with pytest.raises(dtcompile.TracingError, match="changed"):
        dtcompile.jit(Writing())(torch.ones(2))
    assert settings == {"scale": 1.0}


class _NamedBlock(torch.nn.Module):
    def forward(self, x):
        return x * 2 if type(self).__name__ == "_NamedBlock" else x - 1


class _QualifiedBlock(torch.nn.Module):
    def forward(self, x):
        return x * 2 if type(self).__qualname__.startswith("_Qualified") else x - 1


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("block_class", [_NamedBlock, _QualifiedBlock])
def test_a_class_renamed_after_compiling_is_seen_where_code_reads_its_name(cache, block_class):
    model = torch.nn.Sequential(*(block_class() for _ in range(4)))
    jitted, x = dtcompile.jit(model, cache=cache), torch.ones(3)
    names = block_class.__name__, block_class.__qualname__
    try:
        for _ in range(2):
            torch.testing.assert_close(jitted(x), model(x))
        block_class.__name__ = block_class.__qualname__ = "Renamed"
        torch.testing.assert_close(jitted(x), model(x))
    finally:
        block_class.__name__, block_class.__qualname__ = names
    torch.testing.assert_close(jitted(x), model(x))


class _ModeBranch(torch.nn.Module):
    def forward(self, x):
        return x * 2 if torch.is_inference_mode_enabled() else x - 1


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("first", ["no_grad", "inference_mode"])
def test_inference_mode_is_guarded(cache, first):
    model = torch.nn.Sequential(*(_ModeBranch() for _ in range(3)))
    jitted, x = dtcompile.jit(model, cache=cache), torch.ones(3)
    modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    for name in (first, *(m for m in modes if m != first), first):
        with modes[name]():
            torch.testing.assert_close(jitted(x), model(x))
    assert dtcompile.cache_misses(jitted) == 2


class _Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class _Level(enum.IntEnum):
    LOW = 1


_Mode.FAST.scale = 2.0  # per-member configuration, kept as attributes of the members
_Level.LOW.scale = 2.0
_GLOBAL_MODE = _Mode.FAST


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("how", ["argument", "default", "global", "int enum argument"])
def test_attributes_of_an_enum_member_set_after_compiling_are_seen(how, cache):
    member = _Level.LOW if how == "int enum argument" else _Mode.FAST

    def fn(x, mode=_Mode.FAST):
        mode = _GLOBAL_MODE if how == "global" else mode
        return x * mode.scale + getattr(mode, "bias", 0.0)

    args = () if how in ("default", "global") else (member,)
    compiled = dtcompile.jit(fn, cache=cache)
    x = torch.ones(2)
    try:
        for scale, bias in ((2.0, None), (5.0, None), (5.0, 100.0)):
            member.scale = scale
            if bias is not None:
                member.bias = bias
            assert torch.equal(compiled(x, *args), fn(x, *args))
    finally:
        member.scale = 2.0
        vars(member).pop("bias", None)


class _Config:
    def __init__(self, v):
        self.v = v


_SCALE_OF = {}


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("how", ["global table", "argument"])
def test_objects_and_modules_as_dict_keys_are_followed(how, cache):
    config, linear = _Config(2.0), torch.nn.Linear(2, 2)
    _SCALE_OF.clear()
    _SCALE_OF.update({config: 1.0, linear: 0.5})

    def fn(x, table=None):
        for key, scale in (table if how == "argument" else _SCALE_OF).items():
            x = (key(x) if isinstance(key, torch.nn.Module) else x * key.v) * scale
        return x

    args = (dict(_SCALE_OF),) if how == "argument" else ()
    compiled = dtcompile.jit(fn, cache=cache)
    x = torch.ones(2)
    with torch.no_grad():
        for change in (None, "attribute", "parameter", "hook"):
            if change == "attribute":
                config.v = 5.0
            elif change == "parameter":
                linear.bias = torch.nn.Parameter(torch.full((2,), 10.0))
            elif change == "hook":
                linear.register_forward_hook(lambda m, i, o: o * 3)
            assert torch.equal(compiled(x, *args), fn(x, *args)), change


class _HoldsAMockAndAnAutoConfig(torch.nn.Module):
    """A logger mocked in a test, a config that makes an attribute when one is asked for
    (``addict.Dict``-like): walking what they hold never ended (memory grew until killed),
    or a probe made attributes and the call was refused as changing the module."""

    class AutoConfig(dict):
        def __missing__(self, key):
            made = type(self)()
            self[key] = made
            return made

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return self[name]

    def __init__(self, uses: bool):
        super().__init__()
        from unittest import mock

        self.logger, self.cfg, self.uses = mock.MagicMock(), self.AutoConfig(scale=2.0), uses
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x) * (self.cfg.scale if self.uses else 1.0)


@pytest.mark.parametrize("uses", [False, True])
def test_a_mock_and_a_config_making_attributes_on_access(uses):
    model = _HoldsAMockAndAnAutoConfig(uses)
    jitted = dtcompile.jit(model)
    for scale in (2.0, 2.0, 3.0):
        model.cfg["scale"] = scale
        x = torch.randn(1, 2)
        with torch.no_grad():
            assert_same_tensor(jitted(x), torch.nn.Linear.forward(model.lin, x) * (scale if uses else 1.0))
    assert sorted(model.cfg) == ["scale"]


@pytest.mark.parametrize("make", [torch.jit.script, lambda m: torch.jit.trace(m, torch.randn(2, 4))])
def test_torchscript_modules_are_refused_clearly(make):
    """Reached by a function, or jitted: torch's raw AttributeError where eager runs."""
    scripted = make(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="TorchScript module"):
        dtcompile.jit(scripted)
    with pytest.raises(dtcompile.TracingError, match="TorchScript module"):
        dtcompile.jit(lambda x: scripted(x) * 2)(torch.randn(2, 4))


class _MockConfigured(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from unittest import mock

        self.cfg, self.flags = mock.MagicMock(), mock.NonCallableMock()
        self.cfg.scale, self.flags.shift = 1.0, False

    def forward(self, x):
        return x * self.cfg.scale + (1 if self.flags.shift else 0)


def test_what_the_code_set_on_a_mock_config_is_guarded():
    """A unit test's fake config: what was set on it is read as a config's attributes."""
    model = _MockConfigured()
    jitted = dtcompile.jit(model)
    for scale, shift in ((1.0, False), (3.0, False), (3.0, True)):
        model.cfg.scale, model.flags.shift = scale, shift
        x = torch.ones(2)
        with torch.no_grad():
            assert_same_tensor(jitted(x), x * scale + (1 if shift else 0))


class _HoldsOddValues(torch.nn.Module):
    """A dict tree with parent links, a list holding itself, a 0-d NumPy array, a weak
    proxy to a config: each raised an internal error (recursion, ``len()`` of an unsized
    object, a ``__class__`` assignment) where eager runs."""

    def __init__(self, config):
        super().__init__()
        import weakref

        tree = {"scale": 2.0, "children": []}
        tree["children"].append({"parent": tree})
        loop = [1.0]
        loop.append(loop)
        self.tree, self.loop, self.zero_d, self.config = tree, loop, numpy.array(3.0), weakref.proxy(config)

    def forward(self, x):
        return x * self.tree["scale"] * float(self.zero_d) * self.config.shift


class _Shift:
    shift = 1.0


def test_self_holding_containers_zero_d_arrays_and_weak_proxies():
    config = _Shift()
    model = _HoldsOddValues(config)
    jitted = dtcompile.jit(model)
    for scale, zero_d, shift in ((2.0, 3.0, 1.0), (5.0, 3.0, 1.0), (5.0, 4.0, 1.0), (5.0, 4.0, 0.5)):
        model.tree["scale"], config.shift = scale, shift
        model.zero_d[()] = zero_d
        x = torch.ones(2)
        with torch.no_grad():
            assert_same_tensor(jitted(x), x * scale * zero_d * shift)


class _HoldsWeakProxy(torch.nn.Module):
    """A weak proxy to a helper, alone and in a list, that the forward reads only while
    its object lives (eager's ``ReferenceError`` caught): a dead one raised an internal
    ``ReferenceError`` at any ``isinstance`` of it while tracing, where eager runs."""

    def __init__(self, helper):
        super().__init__()
        import weakref

        self.lin = torch.nn.Linear(3, 3)
        self.helper, self.helpers = weakref.proxy(helper), [weakref.proxy(helper), weakref.proxy(print)]

    def forward(self, x, options):
        try:
            scale = self.helper.scale * options.helper.scale
        except ReferenceError:
            scale = 0.5
        return self.lin(x) * scale


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("grad", [False, True])
def test_weak_proxies_that_die_between_calls(cache, grad):
    import weakref

    helper = _Shift()
    helper.scale = 3.0
    model = _HoldsWeakProxy(helper)
    jitted = dtcompile.jit(model, cache=cache)
    options = types.SimpleNamespace(helper=weakref.proxy(helper))
    for step in range(4):
        if step == 1:
            helper.scale = 4.0  # (read through both proxies)
        if step == 2:
            del helper  # every proxy dies: the forward takes the other branch, as eager does
        x = torch.randn(step + 2, 3, requires_grad=grad)
        with torch.set_grad_enabled(grad):  # (this file's tests run under no_grad)
            out, expected = jitted(x, options), model(x, options)
            assert_same_tensor(out, expected)
            if grad:
                (g,) = torch.autograd.grad(out.sum(), x)
                (e,) = torch.autograd.grad(expected.sum(), x)
                assert_same_tensor(g, e)


def test_a_weak_proxy_to_a_tensor_as_input_is_refused():
    import weakref

    x = torch.ones(2)
    with pytest.raises(dtcompile.UnsupportedInputError, match=r"args\[0\] is a weak proxy to a tensor"):
        dtcompile.jit(lambda t: t * 2)(weakref.proxy(x))
