"""Single process: a Python container the program reads can change in place without
becoming another object, whatever its class, size or depth: an ``OrderedDict`` or a
``defaultdict`` of settings, a list subclass, a bytearray, an ``array.array``, a list of
a hundred scales, a config five objects down, a namedtuple holding a list, a list of
tensors one of which is replaced. Each is guarded by its contents: a change compiles a
new entry and gives eager's result, read from a global, a closure cell or a module
attribute. A traced call that changes one is refused (the change is undone)."""

import array
import collections
import dataclasses
import functools
import itertools
import os
import types
import weakref
from os import getenv

import pytest
import torch

import dtcompile


class Scales(list):
    pass


class Settings(dict):
    pass


class Window(collections.deque):
    pass


Pair = collections.namedtuple("Pair", "scales name")


def _deep(value):
    return types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(c=types.SimpleNamespace(d=value))))


_BACKING = {}


def _proxy():
    _BACKING.clear()
    _BACKING["a"] = 2.0
    return types.MappingProxyType(_BACKING)


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


def _set_attr(name, value):
    return lambda c: setattr(c, name, value)


# name: (make the container, read a scale from it, change it in place)
CASES = {
    "OrderedDict in a list": (
        lambda: [collections.OrderedDict(a=2.0)],
        lambda c: c[0]["a"],
        lambda c: c[0].__setitem__("a", 3.0),
    ),
    "OrderedDict": (lambda: collections.OrderedDict(a=2.0, b=1.0), lambda c: c["a"], _set("a", 3.0)),
    "OrderedDict reordered": (
        lambda: collections.OrderedDict(a=2.0, b=5.0),
        lambda c: next(iter(c.values())),
        lambda c: c.move_to_end("a"),
    ),
    "defaultdict": (lambda: collections.defaultdict(float, a=2.0), lambda c: c["a"], _set("a", 3.0)),
    "defaultdict factory": (
        lambda: collections.defaultdict(lambda: 2.0),
        lambda c: c.copy()["missing"],
        lambda c: setattr(c, "default_factory", lambda: 3.0),
    ),
    "a mapping proxy": (_proxy, lambda c: c["a"], lambda c: _BACKING.__setitem__("a", 3.0)),
    "Counter": (lambda: collections.Counter(a=2), lambda c: c["a"], _set("a", 3)),
    "list subclass": (lambda: Scales([2.0]), lambda c: c[0], _set(0, 3.0)),
    "list subclass attribute": (
        lambda: Scales([2.0]),
        lambda c: getattr(c, "factor", 1.0) * c[0],
        lambda c: setattr(c, "factor", 1.5),
    ),
    "dict subclass": (lambda: Settings(a=2.0), lambda c: c["a"], _set("a", 3.0)),
    "deque subclass": (lambda: Window([2.0]), lambda c: c[0], _set(0, 3.0)),
    "bytearray": (lambda: bytearray(b"\x02"), lambda c: c[0], _set(0, 3)),
    "array.array": (lambda: array.array("d", [2.0]), lambda c: c[0], _set(0, 3.0)),
    "a list of 100": (lambda: [2.0] * 100, lambda c: c[50], _set(50, 3.0)),
    "a dict of 100": (lambda: {f"k{i}": 2.0 for i in range(100)}, lambda c: c["k50"], _set("k50", 3.0)),
    "a list in a list of 100": (
        lambda: [[2.0] for _ in range(100)],
        lambda c: c[50][0],
        lambda c: c[50].__setitem__(0, 3.0),
    ),
    "an object in a list of 40": (
        lambda: [types.SimpleNamespace(a=2.0) for _ in range(40)],
        lambda c: c[39].a,
        lambda c: setattr(c[39], "a", 3.0),
    ),
    "an attribute five objects down": (lambda: _deep(2.0), lambda c: c.a.b.c.d, lambda c: setattr(c.a.b.c, "d", 3.0)),
    "a namedtuple holding a list": (
        lambda: Pair([2.0], "s"),
        lambda c: c.scales[0],
        lambda c: c.scales.__setitem__(0, 3.0),
    ),
    "a dict with tuple keys": (lambda: {(1, 2): 2.0}, lambda c: c[(1, 2)], _set((1, 2), 3.0)),
    "a dict with class keys": (lambda: {int: 2.0}, lambda c: c[int], _set(int, 3.0)),
}


@pytest.mark.parametrize(
    "make",
    [
        lambda: [torch.full((3,), 2.0)],
        lambda: {"w": torch.full((3,), 2.0)},
        lambda: collections.OrderedDict(w=torch.full((3,), 2.0)),
        lambda: Pair([torch.full((3,), 2.0)], "w"),
    ],
    ids=["list", "dict", "OrderedDict", "namedtuple"],
)
def test_a_tensor_replaced_in_a_global_container_is_seen(make):
    container = make()
    ns = {"TABLE": container, "next": next, "iter": iter, "hasattr": hasattr, "isinstance": isinstance, "list": list}
    exec(
        "def scaled(x):\n"
        "    held = TABLE.scales if hasattr(TABLE, 'scales') else TABLE\n"
        "    return x * (held[0] if isinstance(held, list) else next(iter(held.values())))\n",
        ns,
    )
    fn = ns["scaled"]
    jitted = dtcompile.jit(fn)
    x = torch.ones(3)
    torch.testing.assert_close(jitted(x), fn(x))
    held = container.scales if isinstance(container, Pair) else container
    held[0 if isinstance(held, list) else next(iter(held))] = torch.full((3,), 3.0)
    torch.testing.assert_close(jitted(x), fn(x), rtol=0, atol=0)
    assert jitted(x)[0].item() == 3.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: bytearray(b"\x02"),
        lambda: array.array("d", [2.0]),
        lambda: collections.OrderedDict(a=2.0),
        lambda: Scales([2.0]),
    ],
    ids=["bytearray", "array.array", "OrderedDict", "list subclass"],
)
def test_a_call_that_changes_a_container_is_refused_and_the_change_undone(make):
    container = make()
    before = repr(container)

    def bump(c):
        key = "a" if isinstance(c, dict) else 0
        c[key] = c[key] + 1

    def scaled(x):
        bump(container)
        return x

    with pytest.raises(dtcompile.TracingError, match="changed 'container'"):
        dtcompile.jit(scaled)(torch.ones(2))
    assert repr(container) == before


@pytest.mark.parametrize("levels", [1, 3, 6])
def test_a_call_that_changes_a_list_levels_down_is_refused(levels):
    nested = [0.0]
    for _ in range(levels):
        nested = [nested]

    def counts_calls(x):
        innermost = nested
        while isinstance(innermost[0], list):
            innermost = innermost[0]
        innermost[0] += 1.0
        return x * innermost[0]

    with pytest.raises(dtcompile.TracingError, match=r"changed .*nested.*\[0\]"):
        dtcompile.jit(counts_calls)(torch.ones(2))
    innermost = nested
    for _ in range(levels):
        innermost = innermost[0]
    assert innermost == [0.0]  # put back


@pytest.mark.parametrize(
    "make", [dict, collections.OrderedDict, lambda **kw: Settings(kw)], ids=["dict", "OrderedDict", "subclass"]
)
def test_a_key_replaced_by_an_equal_key_of_another_type_is_seen(make):
    table = make()
    table[1] = "scale"

    def by_key(x):
        return x * next(iter(table))  # an int key keeps an int tensor; a float key does not

    jitted = dtcompile.jit(by_key)
    x = torch.ones(2, dtype=torch.int64)
    assert jitted(x).dtype == torch.int64
    del table[1]
    table[1.0] = "scale"
    assert jitted(x).dtype == by_key(x).dtype == torch.float32


class SlottedConfig:
    __slots__ = ("scale", "inner")


@dataclasses.dataclass(slots=True)
class SlotsDataclass:
    scale: float
    extra: list


def _slotted(inner=None):
    config = SlottedConfig()
    config.scale = 2.0
    if inner is not None:
        config.inner = inner
    return config


class Config:
    def __init__(self, scale):
        self.scale = scale


_KEPT = [None]  # what the WeakValueDictionary case refers to, kept alive


def _weakly_held_config():
    _KEPT[0] = Config(2.0)
    return weakref.WeakValueDictionary(a=_KEPT[0])


class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, value):
        return value * self.factor


class AttrDict(dict):
    def __init__(self, **items):
        super().__init__(**items)
        self.__dict__ = self  # its items are its attributes


CASES.update(
    {
        "an attribute dict replaced": (lambda: Config(2.0), lambda c: c.scale, _set_attr("__dict__", {"scale": 3.0})),
        "an attribute dict replaced, a list inside": (
            lambda: [Config(2.0)],
            lambda c: c[0].scale,
            lambda c: setattr(c[0], "__dict__", {"scale": 3.0}),
        ),
        "a list a partial holds as an argument": (
            lambda: functools.partial(lambda table: table[0], [2.0]),
            lambda c: c(),
            lambda c: c.args[0].__setitem__(0, 3.0),
        ),
        "an object in a WeakValueDictionary": (
            _weakly_held_config,
            lambda c: c["a"].scale,
            lambda c: setattr(c["a"], "scale", 3.0),
        ),
        "an object the code calls": (lambda: Scaler(2.0), lambda c: c(1.0), _set_attr("factor", 3.0)),
        "an AttrDict's attribute": (lambda: AttrDict(scale=2.0), lambda c: c.scale, _set_attr("scale", 3.0)),
        "an AttrDict's item": (lambda: AttrDict(scale=2.0), lambda c: c.scale, _set("scale", 3.0)),
        "a slot": (_slotted, lambda c: c.scale, lambda c: setattr(c, "scale", 3.0)),
        "a slot set later": (
            _slotted,
            lambda c: getattr(c, "inner", 1.0) * c.scale,
            lambda c: setattr(c, "inner", 1.5),
        ),
        "a list in a slot": (lambda: _slotted([2.0]), lambda c: c.inner[0], lambda c: c.inner.__setitem__(0, 3.0)),
        "a slots dataclass": (
            lambda: SlotsDataclass(2.0, [1.0]),
            lambda c: c.scale * c.extra[0],
            _set_attr("scale", 3.0),
        ),
        "a list in a slots dataclass": (
            lambda: SlotsDataclass(2.0, [1.0]),
            lambda c: c.scale * c.extra[0],
            lambda c: c.extra.__setitem__(0, 3.0),
        ),
    }
)


def _reader(holder, container, read):
    """A program reading ``container`` from a global, a closure cell or a module attribute."""
    if holder == "module attribute":

        class Scaled(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.table = container

            def forward(self, x):
                return x * float(read(self.table))

        return Scaled()
    if holder == "closure":

        def scaled(x):
            return x * float(read(container))

        return scaled
    names = {"TABLE": container, "read": read, "float": float}
    exec("def scaled(x):\n    return x * float(read(TABLE))\n", names)
    return names["scaled"]


@pytest.mark.parametrize("holder", ["global", "closure", "module attribute"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_container_changed_in_place_is_seen(case, holder):
    make, read, change = CASES[case]
    container = make()
    fn = _reader(holder, container, read)
    jitted = dtcompile.jit(fn)
    x = torch.ones(3)
    torch.testing.assert_close(jitted(x), fn(x), rtol=0, atol=0)
    torch.testing.assert_close(jitted(x), fn(x), rtol=0, atol=0)
    assert dtcompile.cache_misses(jitted) == 1
    change(container)
    expected = fn(x)
    torch.testing.assert_close(jitted(x), expected, rtol=0, atol=0)
    assert dtcompile.cache_misses(jitted) == 2
    torch.testing.assert_close(jitted(x), expected, rtol=0, atol=0)
    assert dtcompile.cache_misses(jitted) == 2  # the new contents hit


def test_a_list_the_module_holds_growing_at_every_call_is_named_when_entries_pile_up():
    from dtcompile.jit.compiled import ENTRIES_WARNING

    model = torch.nn.Linear(4, 4)
    model.history = []  # appended to by the loop, read by no code the call runs
    jitted = dtcompile.jit(model)
    x = torch.ones(4)
    with (
        torch.no_grad(),
        pytest.warns(
            UserWarning, match=r"Python values its code can read keep changing \(the contents of attribute 'history'"
        ),
    ):
        for step in range(ENTRIES_WARNING):
            torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
            model.history.append(float(step))
    assert dtcompile.cache_misses(jitted) == ENTRIES_WARNING


def _scale_from_getenv(x):
    return x * float(os.getenv("DTCOMPILE_TEST_SCALE", "1"))


def _scale_from_environ(x):
    return x * float(os.environ.get("DTCOMPILE_TEST_SCALE", "1"))


def _scale_from_getenv_by_name(x):
    return x * float(getenv("DTCOMPILE_TEST_SCALE", "1"))


@pytest.mark.parametrize(
    "fn",
    [_scale_from_getenv, _scale_from_environ, _scale_from_getenv_by_name],
    ids=["os.getenv", "os.environ", "from os import getenv"],
)
def test_the_environment_read_is_guarded(fn, monkeypatch):
    jitted = dtcompile.jit(fn)
    x = torch.ones(2)
    for value in ("2", "2", "3", None, "2"):
        if value is None:
            monkeypatch.delenv("DTCOMPILE_TEST_SCALE", raising=False)
        else:
            monkeypatch.setenv("DTCOMPILE_TEST_SCALE", value)
        torch.testing.assert_close(jitted(x), fn(x), rtol=0, atol=0)


def _counting():
    step = 0
    while True:
        yield step
        step += 1


ITERATORS = {
    "itertools.count": itertools.count,
    "a generator": _counting,
    "a list's iterator": lambda: iter([0.0, 1.0, 2.0]),
    "a range's iterator": lambda: iter(range(5)),
    "zip": lambda: zip(range(5), range(5)),
}


@pytest.mark.parametrize("holder", ["global", "closure", "module attribute"])
@pytest.mark.parametrize("kind", list(ITERATORS))
def test_an_iterator_the_trace_advances_is_refused(kind, holder):
    """``next(counter)`` would run once, while tracing: refused, not a constant."""
    iterator = ITERATORS[kind]()

    def read(it):
        item = next(it)
        return float(item[0] if isinstance(item, tuple) else item)

    fn = _reader(holder, iterator, read)
    with pytest.raises(dtcompile.TracingError, match="an iterator it advanced"):
        dtcompile.jit(fn)(torch.ones(2))


def test_an_iterator_the_code_holds_but_does_not_advance_is_fine():
    numbers = iter(range(3))

    def scaled(x, unused=numbers):
        return x * 2

    torch.testing.assert_close(dtcompile.jit(scaled)(torch.ones(2)), torch.full((2,), 2.0))
    assert next(numbers) == 0


LRU_SCALES = [2.0]


@functools.lru_cache(maxsize=8)
def _cached_scales():
    return LRU_SCALES


def _scaled_by_a_cached_helper(x):
    return x * _cached_scales()[0]


def test_what_an_lru_cached_helper_reads_is_guarded():
    """The function an ``lru_cache`` wraps is followed: the list it returns (a global of
    it) changed in place, as eager sees it through the cache."""
    jitted = dtcompile.jit(_scaled_by_a_cached_helper)
    x = torch.ones(2)
    try:
        torch.testing.assert_close(jitted(x), torch.full((2,), 2.0))
        LRU_SCALES[0] = 3.0
        torch.testing.assert_close(jitted(x), _scaled_by_a_cached_helper(x), rtol=0, atol=0)
        assert jitted(x)[0].item() == 3.0
    finally:
        LRU_SCALES[0] = 2.0


class _Descriptor:
    def __init__(self, value):
        self.value = value

    def __get__(self, obj, owner):
        return self.value


class _Settings:
    scale = _Descriptor(2.0)

    class Inner:
        scale = 2.0


@pytest.mark.parametrize(
    ("read", "change", "undo"),
    [
        (
            lambda s: s.scale,
            lambda: setattr(vars(_Settings)["scale"], "value", 3.0),
            lambda: setattr(vars(_Settings)["scale"], "value", 2.0),
        ),
        (
            lambda s: s.Inner.scale,
            lambda: setattr(_Settings.Inner, "scale", 3.0),
            lambda: setattr(_Settings.Inner, "scale", 2.0),
        ),
    ],
    ids=["a descriptor's state", "a nested class's attribute"],
)
def test_what_a_class_holds_is_followed(read, change, undo):
    settings = _Settings()

    def scaled(x):
        return x * read(settings)

    jitted = dtcompile.jit(scaled)
    x = torch.ones(2)
    try:
        torch.testing.assert_close(jitted(x), torch.full((2,), 2.0))
        change()
        torch.testing.assert_close(jitted(x), scaled(x), rtol=0, atol=0)
        assert jitted(x)[0].item() == 3.0
    finally:
        undo()


def _helper(x):
    return x * 2


def _calls_helper(x):
    return _helper(x) + 1


def test_a_function_whose_code_is_replaced():
    jitted = dtcompile.jit(_calls_helper)
    x = torch.ones(2)
    original = _helper.__code__
    try:
        torch.testing.assert_close(jitted(x), torch.full((2,), 3.0))
        _helper.__code__ = (lambda x: x * 3).__code__
        torch.testing.assert_close(jitted(x), _calls_helper(x), rtol=0, atol=0)
        assert jitted(x)[0].item() == 4.0
    finally:
        _helper.__code__ = original


class _Counter:
    """An object passed in each call whose count the code reads (a sliding-window KV
    cache's ``cumulative_length``): guarded by value, so every count compiles anew."""

    def __init__(self):
        self.count = 0


def _scaled_by_count(x, counter):
    counter.count += 1
    return x * counter.count


def test_an_input_objects_counter_changing_at_every_call_is_named_when_entries_pile_up():
    from dtcompile.jit.compiled import ENTRIES_WARNING

    jitted, counter, expected_counter = dtcompile.jit(_scaled_by_count), _Counter(), _Counter()
    x = torch.ones(3)
    with pytest.warns(
        UserWarning,
        match=r"fails its first entry's guard `type\(args\[1\].__dict__\['count'\]\) is not int or args\[1\].__dict__\['count'\] != 0`",
    ) as caught:
        for _ in range(ENTRIES_WARNING):
            torch.testing.assert_close(jitted(x, counter), _scaled_by_count(x, expected_counter), rtol=0, atol=0)
    assert counter.count == expected_counter.count == ENTRIES_WARNING
    assert "metadata of its inputs" not in str(caught[0].message)


class _TwoNames:
    """A KV-cache-like object whose two attributes are one list (``cache.values = cache.keys``)."""

    def __init__(self, items):
        self.keys = items
        self.values = items


def _same_container_twice(a, b, holder):
    first = a[0] if isinstance(a, list) else a["x"]
    return first + (a is b) + 2 * (holder.keys is holder.values) + holder.values[0]


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_one_container_passed_twice_is_one_container(cache, kind):
    """The same list or dict reached at two places of the call (two arguments, two attributes
    of an object) is one object, as in eager (``a is b``); a later call with two distinct
    ones compiles anew. It was two to the trace, and the prologue refused the very call it
    was compiled for."""
    jitted = dtcompile.jit(_same_container_twice, cache=cache)
    for shared in (True, True, False):
        made = []
        for _ in range(2):
            x = torch.arange(3.0)
            a = [x] if kind == "list" else {"x": x}
            b = a if shared else ([x.clone()] if kind == "list" else {"x": x.clone()})
            made.append((a, b, _TwoNames([x + 1])))
        expected, got = _same_container_twice(*made[0]), jitted(*made[1])
        assert torch.equal(got, expected)
        for want, have in zip(made[0], made[1]):
            want, have = (vars(want), vars(have)) if isinstance(want, _TwoNames) else (want, have)
            assert str(want) == str(have)
    assert dtcompile.cache_misses(jitted) == 2
