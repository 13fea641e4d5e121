"""Torch-level calls recorded again for inputs like an earlier call's (``capture/op_memo.py``).

Layers that cannot be replayed whole (each picks its cache entry by its index, as a
Hugging Face decoder layer does) are traced one by one, their calls recorded again from
the first layer's. The program must be the one dispatching every call records (the
printed traces of every stage are compared), calls that differ in anything that decides
their result must be dispatched, and every result must be eager's.
"""

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import assert_same_result
from test_blocks import assert_eager

import dtcompile
from dtcompile.capture import op_memo, verified
from dtcompile.core import TracingError


class Cache:
    """A KV cache: one tensor per layer, written in place."""

    def __init__(self, layers: int, length: int = 6, dim: int = 8):
        self.keys = [torch.zeros(2, length, dim) for _ in range(layers)]


class IndexedLayer(nn.Module):
    """A layer that reads and writes its own entry of the cache by its index."""

    def __init__(self, index: int, dim: int = 8):
        super().__init__()
        self.index = index
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cache, position):
        h = self.proj(x)
        half = h.shape[-1] // 2
        h = h * 0.5 + torch.cat((-h[..., half:], h[..., :half]), dim=-1) * 0.25
        keys = cache.keys[self.index]
        keys.index_copy_(1, position, h)
        seen = keys[:, : position.shape[0]].transpose(0, 1).contiguous().transpose(0, 1)
        return x + F.silu(seen)


class Model(nn.Module):
    def __init__(self, layer=IndexedLayer, n: int = 4, **kwargs):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(layer(i, **kwargs) for i in range(n))

    def forward(self, x, cache, position):
        for layer in self.layers:
            x = layer(x, cache, position)
        return x


def _compiled_traces(model, args, memo: bool, cache: str):
    saved, op_memo.ENABLED = op_memo.ENABLED, memo
    try:
        with torch.no_grad():
            jitted = dtcompile.jit(model, cache=cache)
            out = jitted(*args)
    finally:
        op_memo.ENABLED = saved
    return out, "\n".join(map(str, dtcompile.last_traces(jitted)))


@pytest.fixture
def replays(monkeypatch):
    """How many calls were recorded again, not dispatched."""
    counted = []
    original = op_memo.record_again

    def counting(*args, **kwargs):
        counted.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(op_memo, "record_again", counting)
    return counted


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_the_program_is_the_one_dispatched_and_eagers(cache, replays):
    model = Model()
    x, position = torch.randn(2, 3, 8), torch.tensor([0, 1, 2])
    memo_cache, plain_cache, eager_cache = Cache(4), Cache(4), Cache(4)
    out, trace = _compiled_traces(model, (x, memo_cache, position), True, cache)
    assert replays, "the later layers' calls were recorded again"
    _, dispatched = _compiled_traces(model, (x, plain_cache, position), False, cache)
    assert trace == dispatched  # every stage's program
    with torch.no_grad():
        expected = model(x, eager_cache, position)
    assert_same_result(out, expected)
    for got, want in zip(memo_cache.keys, eager_cache.keys):
        assert_same_result(got, want)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_every_later_layers_calls_are_recorded_again(cache, replays, monkeypatch):
    """Each layer after the first records every call again: no call of theirs is
    dispatched (a proxy's own state taken for a user's attribute once made calls with
    replayed outputs unkeyed, silently: the programs stayed the same, only slower). (The
    fourth layer on would be checked, not traced: ``test_checked_layers.py``.)"""
    monkeypatch.setattr(verified, "ENABLED", False)
    counts = []
    for n in (2, 4):
        replays.clear()
        model = Model(n=n)
        out, _ = _compiled_traces(model, (torch.randn(2, 3, 8), Cache(n), torch.tensor([0, 1, 2])), True, cache)
        counts.append(len(replays))
    assert counts[0] > 0 and counts[1] == 3 * counts[0]


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_later_calls_of_a_compiled_model_are_eagers(cache):
    model = Model()
    compiled_cache, eager_cache = Cache(4, length=8), Cache(4, length=8)
    jitted = dtcompile.jit(model, cache=cache)
    with torch.no_grad():
        for length, start in ((3, 0), (1, 3), (2, 4)):
            x, position = torch.randn(2, length, 8), torch.arange(start, start + length)
            assert_same_result(jitted(x, compiled_cache, position), model(x, eager_cache, position))
    for got, want in zip(compiled_cache.keys, eager_cache.keys):
        assert_same_result(got, want)


class BranchingLayer(IndexedLayer):
    """Python decisions by the layer's index, between calls like every other layer's."""

    def forward(self, x, cache, position):
        h = self.proj(x)
        if self.index == 2:
            h = h.transpose(0, 1).transpose(0, 1) * 2
        offsets = (torch.arange(4) + self.index).tolist()  # values known while tracing
        h = h + offsets[0]
        alias = h if self.index % 2 else h.clone()  # storage shared, or not
        alias.mul_(3)
        return x + h + alias


class DataLayer(IndexedLayer):
    """Sizes and values read from tensor data: a new number at each layer."""

    def forward(self, x, cache, position):
        h = self.proj(x)
        picked = h[h > 0]
        count = int((h > 0).sum())
        return x + picked.sum() + count + torch.nonzero(h > 0.1).shape[0]


@pytest.mark.parametrize("layer", [BranchingLayer, DataLayer])
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_calls_that_differ_are_dispatched(layer, cache):
    model = Model(layer)
    jitted = dtcompile.jit(model, cache=cache)
    with torch.no_grad():
        for seed in (0, 1):
            torch.manual_seed(seed)
            x, position = torch.randn(2, 3, 8), torch.tensor([0, 1, 2])
            args = (x, Cache(4), position)
            assert_eager(model, args, jitted(*args))


class DtypeLayer(IndexedLayer):
    """The default dtype changed by one layer: the others' calls are alike, this one's not."""

    def forward(self, x, cache, position):
        if self.index == 1:
            torch.set_default_dtype(torch.float64)
        try:
            return x + self.proj(x) * 2.5
        finally:
            torch.set_default_dtype(torch.float32)


def test_a_call_under_another_default_dtype_is_dispatched_and_refused():
    model = Model(DtypeLayer)
    with torch.no_grad(), pytest.raises(TracingError, match="default dtype"):
        dtcompile.jit(model)(torch.randn(2, 3, 8), Cache(4), torch.tensor([0]))


# Found by an audit: what a call recorded again must give as dispatching does.
def _dtype_views(x, y):  # a view as another dtype, then what depends on the dtype
    a, b = x.view(torch.int32).float(), y.view(torch.int32).float()
    c, d = torch.view_as_complex(x.view(4, 3, 2)), torch.view_as_complex(y.view(4, 3, 2))
    return a, b, (y.view(torch.int32) >> 23).float(), c * (1 if c.dtype == torch.complex64 else 2), d * 1


def _conjugate_bits(x, y):  # the bits ops dispatch on, and branches on them
    a, b = torch.complex(x, y).conj(), torch.complex(y, x).conj()
    n, m = torch._neg_view(x), torch._neg_view(y)
    return (
        (a * 1 if a.is_conj() else a * 0),
        (b * 1 if b.is_conj() else b * 0),
        b.imag * 1,
        n * (2 if n.is_neg() else 3),
        m * (2 if m.is_neg() else 3),
    )


def _resolved(x, y):  # ``resolve_conj`` of a tensor without the bit returns the tensor itself
    a = torch._neg_view(x).resolve_neg()
    b = y.resolve_neg()
    b.add_(1)
    return a, b


class _Scaling(nn.Module):
    """A forward that sets an attribute a user's function reads, between two calls of it."""

    def forward(self, x, y):
        self.scale = 2.0
        a = _scaled(x)
        self.scale = 3.0
        return a, _scaled(y)


SCALING = _Scaling()


def _scaled(x):  # a user's function taking part in ``__torch_function__``, reading a global
    if torch.overrides.has_torch_function((x,)):
        return torch.overrides.handle_torch_function(_scaled, (x,), x)
    return x * SCALING.scale


@pytest.mark.parametrize("fn", [_dtype_views, _conjugate_bits, _resolved])
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_calls_like_others_but_for_what_decides_their_result(fn, cache):
    jitted = dtcompile.jit(fn, cache=cache)
    with torch.no_grad():
        for seed in (0, 1):
            torch.manual_seed(seed)
            x, y = torch.randn(4, 6), torch.randn(4, 6)
            got_inputs, expected_inputs = (x.clone(), y.clone()), (x.clone(), y.clone())
            assert_same_result(jitted(*got_inputs), fn(*expected_inputs))
            assert_same_result(got_inputs, expected_inputs)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_a_users_function_is_dispatched(cache):
    jitted = dtcompile.jit(SCALING, cache=cache)
    with torch.no_grad():
        for seed in (0, 1):
            torch.manual_seed(seed)
            x, y = torch.randn(4, 6), torch.randn(4, 6)
            assert_same_result(jitted(x, y), SCALING(x, y))


class _BitsBlock(nn.Module):
    def forward(self, x):
        return x + x.view(torch.int32).float() * 0 + torch._neg_view(x).resolve_neg()


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_replayed_blocks_keep_dtypes_and_bits(cache):
    model = nn.Sequential(*[_BitsBlock() for _ in range(3)])
    x = torch.randn(4, 6)
    out, trace = _compiled_traces(model, (x,), True, cache)
    assert_eager(model, (x,), out)


def _views_and_versions(x):
    out = []
    for _ in range(3):  # the same calls three times: the later ones like the first
        h = x * 1
        view = h[:]
        h.add_(0)
        out.append(x * (2.0 if view._is_view() else 1.0) * (3.0 if view._base is h else 1.0) * (h._version + 1))
    return out


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_calls_like_earlier_ones_make_views_and_count_writes_as_eager(cache):
    # A view recorded again was a fresh tensor (no ``_base``), an in-place op recorded again
    # left ``_version`` as it was: code branching on them went the other way.
    x = torch.tensor([1.0, 2.0])
    with torch.no_grad():
        assert_same_result(dtcompile.jit(_views_and_versions, cache=cache)(x), _views_and_versions(x))


class _Writes(nn.Module):
    """Writes a tensor it made and one it was given, returns views: ``index`` read nowhere
    (its blocks replayed) or by a cache object's update (its calls checked)."""

    def __init__(self, index: int):
        super().__init__()
        self.lin, self.layer_idx = nn.Linear(4, 4), index

    def forward(self, x, given, cache=None):
        h = self.lin(x)  # (a view, in eager: a linear of a 3-d input)
        h.add_(1)
        given.add_(1)
        if cache is not None:
            cache.seen.append(self.layer_idx)
        return h, h.transpose(1, 2)


class _History(nn.Module):
    def __init__(self, per_layer: bool, reads: str):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Writes(i if per_layer else 0) for i in range(6))
        self.per_layer, self.reads = per_layer, reads

    def forward(self, x):
        given, read = x * 1, []
        for layer in self.layers:
            x, view = layer(x, given, types.SimpleNamespace(seen=[]) if self.per_layer else None)
            if self.reads == "versions":
                read.append(x._version + given._version * 10)
            else:
                read.append(int(view._is_view()) + 2 * int(view._base is x) + 4 * int(x._is_view()))
        return x + torch.tensor(read).sum()


@pytest.mark.parametrize("reads", ["versions", "views"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["replayed blocks", "checked layers"])
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_views_and_versions_of_tensors_later_blocks_made_are_eagers(reads, per_layer, cache):
    # A replayed block's or checked layer's tensors are made again, not dispatched: its
    # writes are counted again (``_version``), and code reading whether one is a view is traced.
    model, x = _History(per_layer, reads), torch.randn(1, 3, 4)
    with torch.no_grad():
        assert_same_result(dtcompile.jit(model, cache=cache)(x), model(x))


def _detached_writes(x, w):
    out = []
    for _ in range(3):  # the same product three times: the later ones like the first
        h = x @ w
        detached = h.detach()  # (no view, but it shares h's version counter)
        detached.add_(1)
        out.append(h * (1 + h._version + 10 * detached._version))
    return out


def test_a_detached_alias_of_a_call_like_an_earlier_one_shares_its_version():
    torch.manual_seed(0)
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    with torch.no_grad():
        assert_same_result(dtcompile.jit(_detached_writes)(x, w), _detached_writes(x, w))


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


class _ReadsNodes(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Residual() for _ in range(3))

    def forward(self, x):
        names = []
        for layer in self.layers:
            x = layer(x)
            names.append(x.grad_fn.name())  # eager's node, not a replayed block's
        return x * (2.0 if names == ["AddBackward0"] * 3 else 3.0)


def test_the_autograd_node_of_a_replayed_blocks_output_is_eagers():
    model, x = _ReadsNodes(), torch.randn(2, 4, requires_grad=True)
    assert_same_result(dtcompile.jit(model)(x), model(x))
