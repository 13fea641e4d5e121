"""Single process: what a compiled call returns or stores is of eager's very type, and a
dict of any keys eager takes is taken: enum members and str subclasses returned, dicts
keyed by an enum, infinity or a nan, sizes code made numbers under symbolic values."""

import array
import collections
import dataclasses
import enum
import functools
import types

import pytest
import torch

import dtcompile

CACHES = ["constant values", "symbolic values"]


class Mode(enum.IntEnum):
    A = 1


class Name(str):
    pass


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def _constants_of_subclasses(x, mode):
    return mode, Mode.A, Name("n"), [Mode.A], {"mode": mode}, x + 1


@pytest.mark.parametrize("cache", CACHES)
def test_enum_members_and_str_subclasses_returned_keep_their_type(cache):
    # An IntEnum or a str subclass printed as a literal of its base type came back an int, a str.
    jitted = dtcompile.jit(_constants_of_subclasses, cache=cache)
    for _ in range(2):
        got, expected = jitted(torch.ones(2), Mode.A), _constants_of_subclasses(torch.ones(2), Mode.A)
        flat = [got[0], got[1], got[2], got[3][0], got[4]["mode"]]
        wanted = [expected[0], expected[1], expected[2], expected[3][0], expected[4]["mode"]]
        assert [type(v) for v in flat] == [type(v) for v in wanted] == [Mode, Mode, Name, Mode, Mode]
        assert flat == wanted and torch.equal(got[5], expected[5])


def _weigh(d):
    return d[Color.RED] * 2 + d[Color.BLUE]


def _keyed_by_an_enum(x):
    return {Color.RED: x + 1, Color.BLUE: x - 1, float("inf"): x * 2}


def _weigh_named(d):
    return d["a"] * 2 + d["b"]


@pytest.mark.parametrize("cache", CACHES)
def test_dicts_keyed_by_enums_infinity_and_nan_are_taken_and_returned(cache):
    # Their keys were written with repr: a SyntaxError or NameError in the generated code.
    d = {Color.RED: torch.ones(2), Color.BLUE: torch.full((2,), 3.0)}
    assert torch.equal(dtcompile.jit(_weigh, cache=cache)(d), _weigh(d))
    got, expected = dtcompile.jit(_keyed_by_an_enum, cache=cache)(torch.ones(2)), _keyed_by_an_enum(torch.ones(2))
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    # A nan key is found by identity: read by position, not looked up; and not "changed in place".
    jitted = dtcompile.jit(_weigh_named, cache=cache)
    for nan in (float("nan"), float("nan")):
        d = {"a": torch.ones(2), "b": torch.full((2,), 3.0), nan: 1}
        assert torch.equal(jitted(d), _weigh_named(d))


class _Lengths(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        n = x.shape[0]
        steps = len(range(n))  # a number now: the size is specialized
        self.last_length = n
        return self.lin(x) * steps, n, {"n": n}


def _length_on_an_object(x, holder):
    n = x.shape[0]
    int(n)
    holder.n = n
    return x + 1, [n]


def test_a_size_the_code_made_a_number_is_returned_and_stored_as_an_int():
    # Under symbolic values, never the traced SymInt (not hashable, not an int).
    module = _Lengths()
    jitted = dtcompile.jit(module, cache="symbolic values")
    jitted_fn = dtcompile.jit(_length_on_an_object, cache="symbolic values")
    with torch.no_grad():
        for n in (2, 3, 3):
            _, size, table = jitted(torch.ones(n, 4))
            assert (type(size), type(table["n"]), type(module.last_length)) == (int, int, int)
            assert size == table["n"] == module.last_length == n and hash(size) == hash(n)
            holder = types.SimpleNamespace()
            _, sizes = jitted_fn(torch.ones(n), holder)
            assert type(sizes[0]) is int and type(holder.n) is int and holder.n == n


class _Doubles(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(8.0))

    def forward(self, x):
        return x * 2


@pytest.mark.parametrize("view", [lambda w: w.data[:3], lambda w: w.detach()[1:]])
def test_an_argument_viewing_the_modules_parameter_under_symbolic_values_is_a_clear_error(view):
    # A raw AssertionError of the prologue's builder before; constant values compile it.
    module = _Doubles()
    with torch.no_grad():
        expected = view(module.w) * 2
        assert torch.equal(dtcompile.jit(module, cache="constant values")(view(module.w)), expected)
        with pytest.raises(dtcompile.TracingError, match="no input's size binds: tensors of the call share memory"):
            dtcompile.jit(module, cache="symbolic values")(view(module.w))


@dataclasses.dataclass
class _Info:
    tags: list


SETTINGS = types.SimpleNamespace(scale=2)


def _objects_without_tensors(x):
    return x * 2, types.SimpleNamespace(count=0, n=x.shape[0]), _Info(["a"]), {1}, bytearray(b"ab"), SETTINGS


class _Remembers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.info = _Info(["held"])

    def forward(self, x):
        return x + 1, self.info


@pytest.mark.parametrize("cache", CACHES)
def test_objects_holding_no_tensor_the_call_makes_are_made_anew(cache):
    # One object baked into the epilogue before: a change the caller made to the first
    # result showed in the next; under symbolic values a size in one stayed a SymInt.
    jitted = dtcompile.jit(_objects_without_tensors, cache=cache)
    for n in (2, 3, 3):
        first = jitted(torch.ones(n))
        first[1].count += 1
        first[2].tags.append("b")
        first[3].add(9)
        first[4].append(0)
        second = jitted(torch.ones(n))
        assert (second[1].count, second[2].tags, second[3], second[4]) == (0, ["a"], {1}, bytearray(b"ab"))
        assert type(second[1].n) is int and second[1].n == n
        assert second[1] is not first[1] and second[2] is not first[2]
        assert second[5] is first[5] is SETTINGS  # what was there before the call is the same object
    module = _Remembers()
    assert dtcompile.jit(module, cache=cache)(torch.ones(2))[1] is module.info


class _Scores(collections.namedtuple("_Scores", "logits probs")):
    __slots__ = ()

    def __new__(cls, logits, probs=None):  # normalises on construction: once, in eager
        logits = logits / 2.0
        return super().__new__(cls, logits, logits.softmax(-1) if probs is None else probs)


class _Scaled(collections.namedtuple("_Scaled", "t scale")):
    __slots__ = ()

    def __new__(cls, t, scale=1.0):
        return super().__new__(cls, t, float(scale) * 2)


def _scores(x):
    return _Scores(x * 2)


def _use(q):
    return q.t * q.scale


@pytest.mark.parametrize("cache", CACHES)
def test_a_namedtuple_with_its_own_new_is_rebuilt_without_running_it_again(cache):
    # Rebuilt as TYPE(*fields): its __new__ ran again on what it had made (logits halved twice).
    jitted = dtcompile.jit(_scores, cache=cache)
    for _ in range(2):
        x = torch.tensor([1.0, 2.0, 4.0])
        got, expected = jitted(x), _scores(x)
        assert type(got) is _Scores and torch.equal(got.logits, expected.logits)
        assert torch.equal(got.probs, expected.probs)
    q = _Scaled(torch.ones(2), 3.0)
    assert torch.equal(dtcompile.jit(_use, cache=cache)(q), _use(q))


class _Phase(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


def _by_phase(x, phase):
    return x * 2 if phase is _Phase.TRAIN else x - 1, phase


@pytest.mark.parametrize("cache", CACHES)
def test_a_plain_enum_member_argument_is_a_constant_guarded_as_itself(cache):
    # Refused before (an UnsupportedInputError): only IntEnum and str enums were taken.
    jitted = dtcompile.jit(_by_phase, cache=cache)
    for phase in (_Phase.TRAIN, _Phase.EVAL, _Phase.TRAIN):
        got, expected = jitted(torch.ones(2), phase), _by_phase(torch.ones(2), phase)
        assert torch.equal(got[0], expected[0]) and got[1] is phase
    assert dtcompile.cache_misses(jitted) == 2
    holder = types.SimpleNamespace(phase=_Phase.EVAL)
    assert torch.equal(
        dtcompile.jit(lambda x, h: _by_phase(x, h.phase)[0], cache=cache)(torch.ones(2), holder), torch.zeros(2)
    )


class _Listing(list):
    pass


class _Slotted:
    __slots__ = ("items",)

    def __init__(self):
        self.items = []


GLOBAL_LIST = [types.SimpleNamespace(v=1), [1, 2], {"a": 1}]
GLOBAL_QUEUE = collections.deque([1])


def _made_and_held(x):
    made = [_Listing(), collections.UserList(), collections.ChainMap({}), array.array("i"), _Slotted()]
    held = [GLOBAL_LIST[0], GLOBAL_LIST[1], GLOBAL_LIST[2], GLOBAL_LIST, GLOBAL_QUEUE]
    return x + 1, made, held


@pytest.mark.parametrize("cache", CACHES)
def test_containers_are_made_anew_or_returned_as_themselves_as_in_eager(cache):
    # Containers of other kinds the call made were one object across calls; lists and dicts
    # that existed before the call (a global's) came back as new ones.
    jitted = dtcompile.jit(_made_and_held, cache=cache)
    first = jitted(torch.ones(2))
    second = jitted(torch.ones(2))
    assert all(a is not b and type(a) is type(b) for a, b in zip(first[1], second[1]))
    expected = _made_and_held(torch.ones(2))[2]
    assert all(a is b for a, b in zip(second[2], expected))


class _StrEnum(str, enum.Enum):
    X = "x"


def _first_key(x, d):
    key = next(iter(d))
    return x + 1, key, type(key).__name__


@pytest.mark.parametrize("cache", CACHES)
def test_a_dict_keyed_by_a_str_enum_member_is_not_the_entry_of_the_equal_string(cache):
    # The keys were compared with ==: the entry traced with {"x": ...} served {SE.X: ...}.
    jitted = dtcompile.jit(_first_key, cache=cache)
    for key in ("x", _StrEnum.X, "x"):
        got = jitted(torch.ones(2), {key: torch.ones(2)})
        assert got[1] is key and got[2] == type(key).__name__


def _helper(a, b=0):
    return a + b


def _closures_made(x, scale: float):
    def scaled(v):
        return v * scale

    return x * 2, scaled, lambda: scale, functools.partial(_helper, b=1), _helper


@pytest.mark.parametrize("cache", CACHES)
def test_functions_and_partials_the_call_makes_are_made_anew_at_each_call(cache):
    # They were the ones made while tracing: an attribute one caller set, or a partial's
    # keywords changed, showed in every later call's result.
    jf = dtcompile.jit(_closures_made, cache=cache)
    first = jf(torch.ones(2), 3.0)
    first[1].calls = 1
    first[3].keywords["b"] = 100
    second = jf(torch.ones(2), 3.0)
    assert second[1] is not first[1] and not hasattr(second[1], "calls") and second[1](2.0) == 6.0
    assert second[2] is not first[2] and second[2]() == 3.0
    assert second[3] is not first[3] and second[3](1) == 2 and second[3].func is _helper
    assert second[4] is _helper  # one there before the call: itself, as in eager
    assert jf(torch.ones(2), 4.0)[1](2.0) == 8.0


def _counter_made(x):
    count = []

    def step():
        count.append(1)
        return len(count)

    return x + 1, step


def _nonlocal_made(x):
    n = 0

    def step():
        nonlocal n
        n += 1
        return n

    return x + 1, step


class _Acc:
    def __init__(self):
        self.items = []

    def add(self, v):
        self.items.append(v)


def _bound_method_made(x):
    return x + 1, _Acc().add


def _class_made(x):
    class Local:
        hits = []

    return x + 1, Local


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn, named",
    [
        (_counter_made, "the list 'count' it closes over"),
        (_nonlocal_made, "the variable 'n' it rebinds"),
        (_bound_method_made, "the _Acc it is bound to"),
        (_class_made, "a class defined in the function"),
    ],
)
def test_a_function_the_call_makes_keeping_its_state_is_refused(fn, named, cache):
    # Eager's is made anew at each call; the compiled call's was one object, whose state
    # (a counter, a list) carried from one call's result into the next one's.
    with pytest.raises(dtcompile.TracingError, match=f"made inside the call, which keeps state of the call \\({named}"):
        dtcompile.jit(fn, cache=cache)(torch.ones(2))


async def _async_add(x):
    return x + 1


@pytest.mark.parametrize("cache", CACHES)
def test_an_async_function_is_refused_not_its_coroutine_returned(cache):
    # The coroutine made while tracing was returned at every call, holding the traced
    # stand-in of the argument: awaiting it raised an error about a proxy.
    with pytest.raises(dtcompile.TracingError, match="coroutine .*compile the function it awaits"):
        dtcompile.jit(_async_add, cache=cache)(torch.ones(2))


def _itself(x):
    return x


def _beside(x):
    return x + 1, x


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("fn", [_itself, _beside])
def test_an_inference_tensor_the_caller_made_is_returned_as_itself(fn, cache):
    # Refused as a tensor made under inference_mode inside the call: it is the caller's.
    with torch.inference_mode():
        x = torch.ones(3)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = dtcompile.jit(fn, cache=cache)(x)
        assert (got if fn is _itself else got[1]) is x
    with pytest.raises(dtcompile.TracingError, match="made under torch.inference_mode"):  # one made inside: refused
        dtcompile.jit(lambda t: _made_in_inference_mode(t), cache=cache)(torch.ones(3))


def _made_in_inference_mode(t):
    with torch.inference_mode():
        return t * 2


_CONFIG = {"lr": 1}


class _Things(list):
    pass


def _made_twice(x):
    s = {1, 2}
    things = _Things([_CONFIG])
    add = functools.partial(_helper, b=1)
    return x + 1, s, [s], things, {"things": things}, add, (add,)


@pytest.mark.parametrize("cache", CACHES)
def test_an_object_the_call_makes_returned_twice_is_one_object_holding_what_existed(cache):
    # Each place got its own deep copy, and the copy held copies of the global it held.
    jf = dtcompile.jit(_made_twice, cache=cache)
    for _ in range(2):
        _, s, in_list, things, in_dict, add, in_tuple = jf(torch.ones(2))
        assert in_list[0] is s and in_dict["things"] is things and in_tuple[0] is add
        assert type(things) is _Things and things[0] is _CONFIG
    assert jf(torch.ones(2))[1] is not s  # (made anew at each call)


def _parameters_made(x):
    return torch.nn.Parameter(x * 2, requires_grad=False), torch.nn.Parameter(x.sum(0), False)


class _KeepsAParameter(torch.nn.Module):
    def forward(self, x):
        self.p = torch.nn.Parameter(x.sum(0) * 2, requires_grad=False)
        return x + 1


@pytest.mark.parametrize("cache", CACHES)
def test_a_parameter_the_call_makes_is_a_parameter(cache):
    # A plain tensor came back (and was put in the module's _parameters).
    x = torch.ones(2, 3)
    with torch.no_grad():
        frozen, trained = dtcompile.jit(_parameters_made, cache=cache)(x)
        expected = _parameters_made(x)
        module = _KeepsAParameter()
        dtcompile.jit(module, cache=cache)(x)
    for got, want in zip((frozen, trained), expected):
        assert type(got) is torch.nn.Parameter and got.requires_grad == want.requires_grad
        assert torch.equal(got, want)
    assert type(module._parameters["p"]) is torch.nn.Parameter and not module.p.requires_grad


@pytest.mark.parametrize("cache", CACHES)
def test_a_tensor_of_another_class_made_around_a_traced_one_is_refused_clearly(cache):
    # as_subclass dispatches past the recording modes: torch's error spoke of a proxy.
    with pytest.raises(dtcompile.TracingError, match="a tensor of another class around a traced one"):
        dtcompile.jit(lambda x: (x * 2).as_subclass(torch.Tensor), cache=cache)(torch.ones(3))


def _keyed_by_a_made_function(x):
    def handler(v):
        return v + 1

    p = torch.nn.Parameter(x * 2, requires_grad=False)
    return x + 1, {handler: "handler"}, {handler}, handler, p, [p]


@pytest.mark.parametrize("cache", CACHES)
def test_a_made_function_held_as_a_key_and_a_parameter_returned_twice_are_one_object(cache):
    # The function returned was made anew while the dict's key stayed the traced one
    # (`g in d` False); the Parameter was made at each place it was returned.
    jf = dtcompile.jit(_keyed_by_a_made_function, cache=cache)
    for _ in range(2):
        with torch.no_grad():
            _, table, members, handler, p, in_list = jf(torch.ones(2))
        assert handler in table and handler in members and table[handler] == "handler"
        assert in_list[0] is p and type(p) is torch.nn.Parameter
