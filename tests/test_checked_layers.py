"""Layers checked rather than traced (``capture/verified.py``): once two calls of a layer
class traced as they are made the same torch-level calls, a later call runs its Python
with each call checked against the logged one, nothing dispatched, and becomes a call of
the program outlining makes.

Every result must be eager's, bit for bit, and so must every cache tensor, also where a
later layer does something else than the logged ones (the call is then traced again,
every block traced).
"""

import contextlib

import pytest
import torch
from test_block_calls import calls_in
from test_outlining import CACHES, Layer, Model, assert_like_eager
from torch.distributed.tensor import DTensor

from dtcompile.capture import tracer, verified

SETTINGS = {"scale": {}}


class Differs(Layer):
    """Its fifth call (checked) does something the logged ones did not; where ``how`` names
    a state, every layer makes the same calls, the fifth under that state."""

    how = ""

    def forward(self, x, cache):
        if self.layer_idx == 4 and self.how == "fewer calls":
            cache.update(self.key(x), self.layer_idx)  # writes its cache layer, and no more
            return x
        out = super().forward(x, cache)
        if self.how in _STATES:
            with _STATES[self.how]() if self.layer_idx == 4 else contextlib.nullcontext():
                return out + self.out(out).float()
        if self.layer_idx != 4:
            return out
        if self.how == "another op":
            return out * 2
        if self.how == "another argument":
            return out + SETTINGS["scale"].get(self.layer_idx, 1.0)
        if self.how == "text":
            return out + len(f"{out}")  # the traced tensor turned into text: refused
        raise AssertionError(self.how)


@contextlib.contextmanager
def _warn_always():  # a setting code may read, changed, then put back before the layer returns
    torch.set_warn_always(True)
    try:
        yield
    finally:
        torch.set_warn_always(False)


@contextlib.contextmanager
def _dtensor_handler():  # DTensor's table changed in place and put back, as loss_parallel() does
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers[torch.ops.aten.hardsigmoid.default] = lambda op, args, kwargs: op(*args, **kwargs)
    try:
        yield
    finally:
        del handlers[torch.ops.aten.hardsigmoid.default]


@contextlib.contextmanager
def _dtensor_handler_replaced():  # another handler for an op the table has: its keys stay the same
    handlers = DTensor._op_dispatcher._custom_op_handlers
    op, handler = next(iter(handlers.items()))
    handlers[op] = lambda *args: handler(*args)
    try:
        yield
    finally:
        handlers[op] = handler


_STATES = {
    "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "a torch setting": _warn_always,
    "a DTensor op handler": _dtensor_handler,
    "a DTensor op handler replaced": _dtensor_handler_replaced,
}


@pytest.mark.parametrize("how", ["another op", "another argument", "fewer calls", *_STATES])
@pytest.mark.parametrize("cache", CACHES)
def test_a_later_layer_that_differs_is_traced(how, cache, monkeypatch):
    monkeypatch.setattr(Differs, "how", how)
    SETTINGS["scale"] = {4: 0.5}
    traced = []
    capture = tracer._capture

    def counted(*args, **kwargs):
        traced.append(args[-1])  # replay, or every block traced
        return capture(*args, **kwargs)

    monkeypatch.setattr(tracer, "_capture", counted)
    assert_like_eager(Model(6, layer=Differs), 6, mode=cache)
    assert False in traced  # traced again with every block traced, at a compile


class Keeps(Layer):
    """Keeps a tensor of its own where the caller reads it later."""

    def forward(self, x, cache, kept=None):
        hidden = self.key(x).relu()
        if kept is not None:
            kept.append(hidden)
        return super().forward(x, cache)


def test_a_checked_layers_tensor_read_later_comes_from_its_call():
    class Keeping(Model):
        def forward(self, x, cache):
            kept = []
            for layer in self.layers:
                x = layer(x, cache, kept=kept)
            return x + torch.stack(kept).sum(0)

    program = assert_like_eager(Keeping(7, layer=Keeps), 7)
    assert len(calls_in(program)) == 7, program


@pytest.mark.parametrize("cache", CACHES)
def test_checked_and_traced_layers_compute_alike(cache, monkeypatch):
    model = Model(7)
    monkeypatch.setattr(verified, "ENABLED", False)
    assert_like_eager(model, 7, mode=cache)
    monkeypatch.setattr(verified, "ENABLED", True)
    assert_like_eager(model, 7, mode=cache)


def test_a_cache_layer_of_another_shape_is_traced():
    from test_outlining import Cache, generate

    model = Model(6)
    cache, expected_cache = Cache(6), Cache(6)
    for c in (cache, expected_cache):
        c.layers[5].keys = torch.zeros(1, 12, 8)  # the last layer's cache is shorter
    import dtcompile

    expected = generate(model, expected_cache)
    got = generate(dtcompile.jit(model), cache)
    for out, want in zip(got, expected):
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(cache.layers[5].keys, expected_cache.layers[5].keys, rtol=0, atol=0)


class KeepsOnItself(Layer):
    def forward(self, x, cache):
        out = super().forward(x, cache)
        self.last = out * 2  # a module attribute the caller reads after the layers
        return out


def test_a_tensor_a_checked_layer_sets_on_its_module_is_its_own():
    class Reading(Model):
        def forward(self, x, cache):
            x = super().forward(x, cache)
            return x + sum(layer.last for layer in self.layers)

    assert_like_eager(Reading(6, layer=KeepsOnItself), 6)


class ReturnsAView(Layer):
    def forward(self, x, cache):
        out = super().forward(x, cache)
        return out, cache.layers[self.layer_idx].keys[:, :2]  # a view of its cache layer


def test_a_layer_returning_a_view_of_its_cache_is_traced():
    class Viewing(Model):
        def forward(self, x, cache):
            views = []
            for layer in self.layers:
                x, view = layer(x, cache)
                views.append(view)
            return x + torch.cat(views, 1).sum(1, keepdim=True)

    assert_like_eager(Viewing(6, layer=ReturnsAView), 6)


LOG = []


class Logging(Layer):
    def forward(self, x, cache):
        LOG.append(self.layer_idx)  # a side effect on a global: refused, checked or not
        return super().forward(x, cache)


def test_a_checked_layers_side_effect_is_refused_as_a_traced_ones():
    from test_outlining import Cache, generate

    import dtcompile

    with pytest.raises(dtcompile.TracingError, match="LOG"):
        generate(dtcompile.jit(Model(6, layer=Logging)), Cache(6))


def test_a_hook_on_one_later_layer_is_run():
    model = Model(6)
    model.layers[5].register_forward_hook(lambda module, args, out: out * 3)
    assert_like_eager(model, 6)


def test_a_checked_layer_turning_a_tensor_into_text_is_refused(monkeypatch):
    from test_outlining import Cache, generate

    import dtcompile

    monkeypatch.setattr(Differs, "how", "text")
    with pytest.raises(dtcompile.TracingError, match="into text"):
        generate(dtcompile.jit(Model(6, layer=Differs)), Cache(6))


class Converts(Layer):
    """Turns any error of its ops into its own."""

    def forward(self, x, cache):
        try:
            out = super().forward(x, cache)
            return out * 3 if self.layer_idx == 4 else out
        except Exception as error:
            raise ValueError("the layer failed") from error


@pytest.mark.parametrize("catch", [Exception, BaseException])
@pytest.mark.parametrize("cache", CACHES)
def test_a_failed_check_the_users_code_catches_still_traces_again(catch, cache):
    """A check that fails raises inside the layer: code that catches it and goes on (the
    parent around each layer, the layer around its ops) must not leave the program with
    the logged layer's answers."""

    class Catching(Model):
        def forward(self, x, cache):
            for layer in self.layers:
                try:
                    x = layer(x, cache)
                except catch:  # never taken in eager
                    x = x * 0
            return x

    assert_like_eager(Catching(6, layer=Converts), 6, mode=cache)


class Retries(Layer):
    """A call that raises, caught and done otherwise: in every layer, eagerly too."""

    def forward(self, x, cache):
        try:
            x = x.view(-1, 5)  # 8 features: no view of 5 columns
        except RuntimeError:
            x = x * 1
        return super().forward(x, cache)


@pytest.mark.parametrize("cache", CACHES)
def test_a_layer_whose_call_raises_is_traced_at_every_layer(cache, monkeypatch):
    checked = []
    original = verified.LayerCalls._checked

    def counted(self, stand_in, call):
        checked.append(1)
        return original(self, stand_in, call)

    monkeypatch.setattr(verified.LayerCalls, "_checked", counted)
    assert_like_eager(Model(6, layer=Retries), 6, mode=cache)
    assert not checked  # a logged call raised: no later layer answered from the log


class TakesAComplexTensor(Layer):
    def forward(self, x, cache, f):
        # resolve_conj() is the tensor itself where its conjugate bit is not set: a logged
        # call returns its argument, where the call with a conjugated one makes a tensor.
        return super().forward(x, cache) + torch.view_as_real(f.resolve_conj()).sum(-1)


@pytest.mark.parametrize("cache", CACHES)
def test_a_layer_given_a_conjugated_tensor_is_traced(cache):
    class Conjugating(Model):
        def forward(self, x, cache, f):
            for layer in self.layers:
                x = layer(x, cache, f.conj() if layer.layer_idx == 4 else f)
            return x

    from test_outlining import Cache

    import dtcompile

    model = Conjugating(6, layer=TakesAComplexTensor)
    x, f = torch.randn(1, 3, 8), torch.randn(1, 3, 8, dtype=torch.complex64)
    with torch.no_grad():
        expected = model(x, Cache(6), f)
        got = dtcompile.jit(model, cache=cache)(x, Cache(6), f)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
