"""Repeated blocks called (``capture/block_calls.py``): without gradients, a block that
repeats is one program, passed and lowered once, that the trace calls once per block.

Every result must be eager's, bit for bit; a block whose program is not a pure function
of the tensors it reads (it writes to its input, returns a view of it) is recorded again
instead. With gradients, a block is a forward program and a backward program.
"""

import re

import pytest
import torch
import torch.nn as nn
from test_blocks import Block, Transposing, _train, assert_eager, blocks, compiled

import dtcompile
from dtcompile.jit.api import _last_entry
from dtcompile.jit.check import _all_values
from dtcompile.transforms import pipelines


def calls_in(trace: str) -> list[str]:
    return re.findall(r"= (block_\w+)\(", trace)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_repeated_blocks_are_one_program_called_per_block(cache):
    model = blocks(6)
    x = torch.randn(3, 5, 8)
    out, recorded = compiled(model, x, cache=cache, calls=True)
    assert_eager(model, (x,), out)
    called = calls_in(recorded)
    assert len(called) >= 5 and len(set(called)) == 1, recorded
    _, stages = compiled(model, x, cache=cache, calls=True, stages=True)
    # Passed and lowered once: the block's program as recorded, after each pass, lowered.
    passes = pipelines.inference_passes(cache == "symbolic values")
    assert len(re.findall(rf"^def {called[0]}\(", stages, re.M)) == 1 + len(passes) + 1


def test_block_calls_serve_every_length_under_symbolic_values():
    model = blocks(4)
    with torch.no_grad():
        jitted = dtcompile.jit(model, cache="symbolic values")
        for length in (5, 7, 3):
            x = torch.randn(2, length, 8)
            assert_eager(model, (x,), jitted(x))
    assert dtcompile.cache_misses(jitted) == 1
    assert calls_in(str(dtcompile.last_traces(jitted)[0]))


class WritesItsInput(Block):
    def forward(self, x):
        x.mul_(2)  # an in-place write to what the caller passed
        return super().forward(x)


class ReturnsAView(Block):
    def forward(self, x):
        y = super().forward(x)
        return y, x[..., :4]  # a view of its input


@pytest.mark.parametrize("kind", [WritesItsInput, ReturnsAView])
def test_a_block_that_is_not_a_pure_function_is_recorded_again(kind):
    torch.manual_seed(0)
    if kind is ReturnsAView:

        class Stack(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(ReturnsAView(i) for i in range(4))

            def forward(self, x):
                views = []
                for layer in self.layers:
                    x, view = layer(x)
                    views.append(view)
                return x, *views

        model = Stack()
    else:
        model = nn.Sequential(*[kind(i) for i in range(4)])
    x = torch.randn(3, 5, 8)
    out, recorded = compiled(model, x.clone(), calls=True)
    assert not calls_in(recorded)
    assert "recorded once, replayed" in recorded  # still replayed, as symbols
    assert_eager(model, (x.clone(),), out)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("model_fn", [blocks, Transposing], ids=["stack", "transposed gradients"])
def test_training_blocks_call_a_forward_and_a_backward_program(model_fn, cache):
    """With gradients, a later block calls the first block's forward program (which also
    returns what the backward reads) and, in the backward, its backward program: one for
    contiguous incoming gradients, another made when transposed ones arrive. Results are
    those of every block traced, bit for bit, and eager's."""
    x = torch.randn(8, 8)
    loss, grads, x_grad, program, _ = _train(model_fn, x, True, calls=True, cache=cache)
    traced_loss, traced_grads, traced_x_grad, _, _ = _train(model_fn, x, False, cache=cache)
    called = calls_in(program)
    forwards = {name for name in called if not name.endswith(("_backward", "_backward_2"))}
    backwards = set(called) - forwards
    assert forwards and backwards, program
    # Passed and lowered once each: as recorded, after each pass, lowered.
    stages = 1 + len(pipelines.block_training_passes(cache == "symbolic values")) + 1
    for name in set(called):
        assert len(re.findall(rf"^def {name}\(", program, re.M)) == stages, name
    assert torch.equal(loss, traced_loss)
    for got, traced in zip([*grads, x_grad], [*traced_grads, traced_x_grad]):
        assert torch.equal(got, traced)
    reference = model_fn()
    x_ref = x.clone().requires_grad_()
    reference(x_ref).pow(2).sum().backward()
    for got, want in zip([*grads, x_grad], [*(p.grad for p in reference.parameters()), x_ref.grad]):
        torch.testing.assert_close(got, want)


def test_a_block_that_differs_is_traced_between_calls():
    model = blocks(5)
    model[3] = Block(3, hidden=24)
    x = torch.randn(3, 5, 8)
    out, recorded = compiled(model, x, calls=True)
    assert_eager(model, (x,), out)
    assert len(calls_in(recorded)) >= 3


def test_the_eager_check_runs_the_recorded_calls():
    """``check="eager"`` compares with eager at every call, and where they differ runs the
    recorded program as its reference: a call there interprets the block's program."""
    model = blocks(4)
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        jitted = dtcompile.jit(model, check="eager")
        assert_eager(model, (x,), jitted(x))
    entry = _last_entry(jitted)
    assert calls_in(str(entry.reference))
    values = _all_values(entry.reference, (x, *model.parameters()))
    with torch.no_grad():
        expected = model(x)
    assert torch.equal(values[entry.reference.output[0].label], expected)
