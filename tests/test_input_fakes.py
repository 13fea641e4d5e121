"""Inputs' fake tensors made from their metadata (``capture/input_fakes.py``) keep what
the fake mode's converter kept: which tensors share memory (an in-place change of one is
seen through the others), ``isinstance(p, nn.Parameter)``, a buffer's marks. Results
must be eager's, call after call (each call writes in place).
"""

import pytest
import torch
import torch.nn as nn

import dtcompile


class SharedBuffers(nn.Module):
    """Two buffers of one storage, in the order given: the whole tensor and a view of it
    (at an offset, maybe of another dtype)."""

    def __init__(self, view_first: bool, dtype_view: bool):
        super().__init__()
        whole = torch.arange(8.0)
        part = whole.view(torch.int32)[2:] if dtype_view else whole[2:]
        pairs = [("part", part), ("whole", whole)] if view_first else [("whole", whole), ("part", part)]
        for name, t in pairs:
            self.register_buffer(name, t)
        self.w = nn.Parameter(torch.ones(6))

    def forward(self, x):
        self.whole.add_(1)  # seen through ``part``
        part = self.part.float() if self.part.dtype != torch.float32 else self.part
        return x * part + self.w


@pytest.mark.parametrize("view_first", [False, True], ids=["whole first", "view first"])
@pytest.mark.parametrize("dtype_view", [False, True], ids=["same dtype", "int32 view"])
def test_tensors_sharing_storage_stay_aliased(view_first, dtype_view):
    model, reference = SharedBuffers(view_first, dtype_view), SharedBuffers(view_first, dtype_view)
    jitted = dtcompile.jit(model)
    x = torch.randn(6)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(jitted(x), reference(x), rtol=0, atol=0)
    torch.testing.assert_close(model.whole, reference.whole, rtol=0, atol=0)


class ParameterCheck(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.b = nn.Buffer(torch.randn(4), persistent=False)

    def forward(self, x):
        scale = 2.0 if isinstance(self.w, nn.Parameter) else 3.0
        shift = 1.0 if getattr(self.b, "persistent", True) is False else 5.0
        return x * self.w * scale + self.b + shift


@pytest.mark.parametrize("grad", [False, True])
def test_parameters_and_buffers_look_as_in_eager(grad):
    model = ParameterCheck()
    x = torch.randn(4)
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(dtcompile.jit(model)(x), model(x), rtol=0, atol=0)


class Tagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.w.tag = "double"

    def forward(self, x):
        scale = 2.0 if getattr(self.w, "tag", None) == "double" else 1.0
        return x * self.w * scale


def test_a_tensor_attribute_is_read_as_in_eager_and_guarded():
    model = Tagged()
    jitted = dtcompile.jit(model)
    x = torch.randn(4)
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
        model.w.tag = "single"  # a new value: a new entry
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
        del model.w.tag
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
    assert dtcompile.cache_misses(jitted) == 3


def test_an_attribute_set_after_compiling_is_seen():
    """On a parameter that had none, and on an argument: a new entry reads it."""
    model = Tagged()
    del model.w.tag
    jitted = dtcompile.jit(model)
    x = torch.randn(4)
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)
        model.w.tag = "double"
        torch.testing.assert_close(jitted(x), model(x), rtol=0, atol=0)

    def scaled(t):
        return t * (3.0 if getattr(t, "scale_me", False) else 1.0)

    jitted = dtcompile.jit(scaled)
    y = torch.randn(4)
    torch.testing.assert_close(jitted(y), scaled(y), rtol=0, atol=0)
    y.scale_me = True
    torch.testing.assert_close(jitted(y), scaled(y), rtol=0, atol=0)
    assert dtcompile.cache_misses(jitted) == 2


def test_an_attribute_named_as_a_traced_tensor_s_own_is_refused():
    model = Tagged()
    model.w.label = "mine"  # a traced tensor's own attribute: reading it would give the trace's
    with pytest.raises(dtcompile.TracingError, match=r"params\['w'\] holds the Python attribute 'label'"):
        dtcompile.jit(model)(torch.randn(4))


def _alike_inputs(a, b, c, d):
    """Under symbolic values, ``b`` and ``c`` are like ``a`` (equal sizes and strides)
    and take its symbols; ``d`` is ``c[1:]`` or a tensor like it."""
    c.add_(1)
    return a * 2 + b, (c[1:] + d).sum(0), b.t().contiguous()


@pytest.mark.parametrize("view", ["a view of c", "its own"])
def test_inputs_alike_under_symbolic_values_are_guarded_alike(view):
    """Tensors with one another's sizes and strides share symbols (the fake mode's duck
    sizing, made once for all of them): a later call where they differ must not run the
    program that assumed them equal, and in-place writes and views keep eager's values."""
    jitted = dtcompile.jit(_alike_inputs, cache="symbolic values")
    calls = [((4, 8), (4, 8), (4, 8)), ((6, 8), (6, 8), (6, 8)), ((4, 8), (6, 8), (4, 8)), ((5, 3), (5, 3), (5, 6))]
    for shapes in calls:
        args = [torch.randn(s) for s in shapes]
        mine, theirs = [t.clone() for t in args], [t.clone() for t in args]
        for inputs in (mine, theirs):
            inputs.append(inputs[2][1:] if view == "a view of c" else inputs[2][1:].clone().mul_(3))
        if args[0].shape != args[1].shape:
            with pytest.raises(RuntimeError):  # eager's own error, where the sizes differ
                _alike_inputs(*theirs)
            with pytest.raises(RuntimeError):
                jitted(*mine)
            continue
        expected, got = _alike_inputs(*theirs), jitted(*mine)
        for e, g in zip(expected, got):
            assert g.shape == e.shape and g.stride() == e.stride() and torch.equal(g, e)
        assert all(torch.equal(m, t) for m, t in zip(mine, theirs))
