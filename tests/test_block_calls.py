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
    program = _trained_with_calls(model_fn, cache)
    called = calls_in(program)
    forwards = {name for name in called if not name.endswith(("_backward", "_backward_2"))}
    backwards = set(called) - forwards
    assert forwards and backwards, program
    # Passed and lowered once each: as recorded, after each pass, lowered.
    stages = 1 + len(pipelines.block_training_passes(cache == "symbolic values")) + 1
    for name in set(called):
        assert len(re.findall(rf"^def {name}\(", program, re.M)) == stages, name


def _trained_with_calls(model_fn, cache: str) -> str:
    """Every stage's program of a training call with blocks called, whose loss and
    gradients must be those of every block traced, bit for bit, and eager's."""
    x = torch.randn(8, 8)
    loss, grads, x_grad, program, _ = _train(model_fn, x, True, calls=True, cache=cache)
    traced_loss, traced_grads, traced_x_grad, _, _ = _train(model_fn, x, False, cache=cache)
    assert torch.equal(loss, traced_loss)
    for got, traced in zip([*grads, x_grad], [*traced_grads, traced_x_grad]):
        assert torch.equal(got, traced)
    reference = model_fn()
    x_ref = x.clone().requires_grad_()
    reference(x_ref).pow(2).sum().backward()
    for got, want in zip([*grads, x_grad], [*(p.grad for p in reference.parameters()), x_ref.grad]):
        torch.testing.assert_close(got, want)
    return program


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


class ReturnsAViewOfWhatItSaves(Block):
    def forward(self, x):
        h = torch.relu(self.up(x))  # relu's backward reads h
        return self.down(h) + h[..., :8].reshape(x.shape)  # and the output is a view-free sum


class SavesAnInPlaceResult(Block):
    def forward(self, x):
        h = self.up(x) * 1.5
        h.relu_()  # the backward reads what the in-place op wrote
        return x + self.down(h) * (1 + self.eps)


class SavesAViewOfItsInput(Block):
    def forward(self, x):
        gram = x.transpose(-1, -2) @ x  # the backward reads x's transposed view
        return x + self.down(self.up(x @ gram / 8))


class TwoOutputs(Block):
    def forward(self, x):
        h = self.up(x) * 1.5
        return x + self.down(torch.tanh(h)) * (1 + self.eps), h  # the second output gets no gradient


class TwoOutputStack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(TwoOutputs(i) for i in range(4))

    def forward(self, x):
        for layer in self.layers:
            x, _ = layer(x)
        return x


def _stack_of(kind):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(*[kind(i) for i in range(4)])

    return make


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize(
    "model_fn",
    [
        _stack_of(ReturnsAViewOfWhatItSaves),
        _stack_of(SavesAnInPlaceResult),
        _stack_of(SavesAViewOfItsInput),
        TwoOutputStack,
    ],
    ids=[
        "output beside a saved value",
        "in-place result saved",
        "view of the input saved",
        "an output without gradient",
    ],
)
def test_training_blocks_that_save_views_and_in_place_results(model_fn, cache):
    """What a block's backward reads of its forward, in the ways a forward program must
    return it or the backward make it again: results bit for bit those of every block
    traced, and eager's."""
    program = _trained_with_calls(model_fn, cache)
    assert any("_backward" in name for name in calls_in(program)), program


class EndsInSigmoid(Block):
    def forward(self, x):
        return torch.sigmoid(x + self.down(self.up(x)))  # sigmoid's backward reads its output


class ChangesACalledBlocksOutput(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(EndsInSigmoid(i) for i in range(3))

    def forward(self, x):
        x = self.layers[1](self.layers[0](x))
        y = self.layers[2](x)
        y.mul_(2)  # what the called block's backward reads: eager's autograd raises
        return y


def test_a_called_blocks_saved_output_changed_in_place_raises_as_eager():
    x = torch.randn(3, 8)
    model = ChangesACalledBlocksOutput()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x.clone().requires_grad_()).sum().backward()
    jitted = dtcompile.jit(ChangesACalledBlocksOutput())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        jitted(x.clone().requires_grad_()).sum().backward()
