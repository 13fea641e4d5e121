"""Single process: compiled training (a forward and a backward program) against eager autograd."""

import copy
import re

import pytest
import torch
import torch.nn as nn
from support import assert_same_result, assert_same_tensor
from torch.utils._pytree import tree_flatten, tree_map

import dtcompile
from dtcompile.core import Trace

# ---------------------------------------------------------------------------------------
# Training: a forward and a backward program, compared with eager autograd


def _execution_traces(jitted) -> tuple[Trace, Trace]:
    """The forward and backward execution traces of the last (training) compilation."""
    runs = [t for t in dtcompile.last_traces(jitted) if t.title.startswith("execution trace")]
    assert [t.fn_name for t in runs] == ["forward", "backward"]
    return runs[0], runs[1]


def _saved_header(forward: Trace) -> tuple[int, str, list[str]]:
    """(count, MiB as printed, names) from the forward's "saved for the backward" line."""
    lines = [line for line in str(forward).splitlines() if line.startswith("# saved for the backward:")]
    assert len(lines) == 1, str(forward)
    match = re.fullmatch(
        r"# saved for the backward: (\d+) tensors? holding ([\d.]+) MiB beyond the inputs: (.*)", lines[0]
    )
    assert match, lines[0]
    names = [] if match[3] == "none" else match[3].split(", ")
    return int(match[1]), match[2], names


def _saved_by_the_forward(backward: Trace) -> list[str]:
    """The backward's inputs the forward saved (the others are cotangents)."""
    return [p.label for p in backward.inputs if backward.input_notes.get(p.label) == "saved by the forward"]


def _eager_saved_bytes(fn, *inputs) -> int:
    """What eager autograd keeps alive for the backward beyond the inputs: each storage of a
    tensor it saves, once, except the inputs' own."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*inputs)
    inputs_storages = {t.untyped_storage().data_ptr() for t in inputs}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in inputs_storages)


def _grads_of(tensors) -> list:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def _assert_same_grads(got: list, expected: list):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert (g is None) == (e is None)
        if e is not None:
            assert_same_tensor(g, e)


@torch.enable_grad()
def test_training_mlp_with_layernorm_and_dropout_matches_eager_gradients():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Dropout(0.3), nn.Linear(8, 3)).eval()
    eager = copy.deepcopy(module)
    jitted = dtcompile.jit(module)
    for _ in range(2):  # a miss, then a hit with new data
        x = torch.randn(5, 6)
        cotangent = torch.randn(5, 3)
        x_jit, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = jitted(x_jit), eager(x_eager)
        assert_same_tensor(out.detach(), expected.detach())
        assert out.requires_grad and out.grad_fn is not None
        out.backward(cotangent)
        expected.backward(cotangent)
        _assert_same_grads(
            [x_jit.grad, *_grads_of(module.parameters())], [x_eager.grad, *_grads_of(eager.parameters())]
        )
        module.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (1, 1)
    # Dropout on: the compiled program draws the same random numbers as eager.
    module.train()
    eager.train()
    x = torch.randn(5, 6)
    torch.manual_seed(7)
    jitted(x).pow(2).sum().backward()
    torch.manual_seed(7)
    eager(x).pow(2).sum().backward()
    _assert_same_grads(_grads_of(module.parameters()), _grads_of(eager.parameters()))
    assert dtcompile.cache_misses(jitted) == 2


def _two_inputs_and_a_weight(x, y, w):
    return torch.tanh(x @ w) * y.sigmoid() + (y**2).sum(-1, keepdim=True)


@torch.enable_grad()
def test_autograd_grad_with_respect_to_inputs():
    torch.manual_seed(0)
    x, y, w = torch.randn(4, 3), torch.randn(4, 5), torch.randn(3, 5)
    jitted = dtcompile.jit(_two_inputs_and_a_weight)
    results = []
    for fn in (jitted, _two_inputs_and_a_weight):
        xs, ys, ws = (t.clone().requires_grad_() for t in (x, y, w))
        out = fn(xs, ys, ws)
        grads = torch.autograd.grad(out.pow(2).sum(), (xs, ys))
        assert ws.grad is None and xs.grad is None  # autograd.grad accumulates nothing
        results.append((out.detach(), *grads))
    for got, expected in zip(*results):
        assert_same_tensor(got, expected)
    # Only the weight needs a gradient: the same jitted function, another cache entry.
    ws = w.clone().requires_grad_()
    (grad_w,) = torch.autograd.grad(jitted(x, y, ws).sum(), ws)
    ws_eager = w.clone().requires_grad_()
    (expected_w,) = torch.autograd.grad(_two_inputs_and_a_weight(x, y, ws_eager).sum(), ws_eager)
    assert_same_tensor(grad_w, expected_w)
    assert dtcompile.cache_misses(jitted) == 2


def _three_outputs(x, w):
    h = x @ w
    return h.sin(), {"cos": h.cos()}, [h.exp(), h * 2]


@pytest.mark.parametrize(
    "loss",
    [
        lambda a, d, e: a.sum(),  # one output of several
        lambda a, d, e: (d["cos"] * e[1]).sum(),  # two, in containers
        lambda a, d, e: e[0].mean() + a.pow(2).sum(),
    ],
)
@torch.enable_grad()
def test_several_outputs_only_some_in_the_loss(loss):
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    jitted = dtcompile.jit(_three_outputs)
    results = []
    for fn in (jitted, _three_outputs):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        outs = fn(xs, ws)
        loss(*outs).backward()
        results.append((tree_map(torch.Tensor.detach, outs), xs.grad, ws.grad))
    assert_same_result(*results)


@torch.enable_grad()
def test_several_backward_calls_through_one_call_accumulate_like_eager():
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    jitted = dtcompile.jit(_three_outputs)
    grads = []
    for fn in (jitted, _three_outputs):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        a, d, e = fn(xs, ws)
        a.sum().backward(retain_graph=True)
        (e[0] * 3).sum().backward(retain_graph=True)
        d["cos"].sum().backward()
        grads.append((xs.grad, ws.grad))
    for got, expected in zip(*grads):
        assert_same_tensor(got, expected)


def _some_outputs_without_grad(x, w):
    h = x @ w
    return torch.tanh(h), h.argmax(-1), h.detach() * 2, torch.ones(3), h.sum() > 0


@torch.enable_grad()
def test_outputs_that_do_not_require_grad():
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    jitted = dtcompile.jit(_some_outputs_without_grad)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    got, expected = jitted(xs, ws), _some_outputs_without_grad(xe, we)
    assert [g.requires_grad for g in got] == [e.requires_grad for e in expected] == [True, False, False, False, False]
    assert [g.dtype for g in got] == [e.dtype for e in expected]
    assert_same_result(tuple(g.detach() for g in got), tuple(e.detach() for e in expected))
    for g in got[1:]:
        assert g.grad_fn is None
        with pytest.raises(RuntimeError, match="does not require grad"):
            g.float().sum().backward()
    got[0].sum().backward()
    expected[0].sum().backward()
    assert_same_tensor(xs.grad, xe.grad)
    assert_same_tensor(ws.grad, we.grad)
    # A call whose only output is not differentiable, though its input requires grad.
    argmax = dtcompile.jit(lambda x: (x * 2).argmax(-1))
    result = argmax(xs)
    assert_same_tensor(result, (xe * 2).argmax(-1))
    assert not result.requires_grad


def _sin_chain(x):
    return (torch.sin(x) * 2 + 1).neg()


@torch.enable_grad()
def test_the_forward_saves_only_what_the_backward_needs():
    # The backward of this chain needs only cos(x): the saved set is x, which the forward
    # received anyway; none of the intermediates is kept.
    jitted = dtcompile.jit(_sin_chain)
    x = torch.randn(64, 64, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    jitted(x).sum().backward()
    _sin_chain(x_eager).sum().backward()
    assert_same_tensor(x.grad, x_eager.grad)
    forward, backward = _execution_traces(jitted)
    assert _saved_by_the_forward(backward) == ["x"]
    count, mib, names = _saved_header(forward)
    assert (count, names) == (1, ["x"])
    assert float(mib) == 0.0 == _eager_saved_bytes(_sin_chain, x_eager)
    outputs, _ = tree_flatten(forward.output)
    assert [p.label for p in outputs][1:] == ["x"]  # the call's output, then the saved set


def _exp_of_matmul(x, w):
    return (x @ w).exp()


@torch.enable_grad()
def test_the_saved_set_header_names_the_saved_values_and_their_memory():
    # exp's backward reads its result (0.5 MiB here); mm's reads x and w, which are inputs.
    x, w = torch.randn(256, 32, requires_grad=True), torch.randn(32, 512, requires_grad=True)
    jitted = dtcompile.jit(_exp_of_matmul)
    (jitted(x, w) * 0.5).sum().backward()
    forward, backward = _execution_traces(jitted)
    count, mib, names = _saved_header(forward)
    saved = _saved_by_the_forward(backward)
    assert names == saved and count == len(saved) == 3
    assert {"x", "w"} < set(names)
    assert (
        mib
        == f"{_eager_saved_bytes(_exp_of_matmul, x.detach().requires_grad_(), w.detach().requires_grad_()) / 2**20:.3f}"
    )
    assert float(mib) == 0.5
    outputs, _ = tree_flatten(forward.output)
    assert [p.label for p in outputs][1:] == names
    # The header is part of the printed program only: the backward takes the saved values
    # in the same order, then one cotangent.
    assert [p.label for p in backward.inputs] == [*names, "cotangent0"]


def _double_backward(fn, x, w, penalty: bool):
    """A gradient penalty: the loss plus the squared norm of its gradient with respect to
    ``x``, which needs the backward's own backward (``create_graph=True``)."""
    loss = fn(x, w).sum() if not penalty else fn(x, w).pow(2).sum()
    (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + grad_x.pow(2).sum()).backward()


@pytest.mark.parametrize("penalty", [False, True], ids=["cotangent without grad", "cotangent with grad"])
@torch.enable_grad()
def test_double_backward_through_a_compiled_step_is_an_error(penalty):
    # Eager computes second derivatives here; the compiled backward is not differentiable,
    # so the call must fail, whether or not the incoming cotangent requires grad, rather
    # than give gradients without the penalty's second-order part.
    torch.manual_seed(0)
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    _double_backward(_exp_of_matmul, x, w, penalty)  # eager works
    x.grad = w.grad = None
    with pytest.raises(RuntimeError, match="create_graph|double backward|differentiate twice"):
        _double_backward(dtcompile.jit(_exp_of_matmul), x, w, penalty)
