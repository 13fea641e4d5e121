"""Repeated blocks recorded once and replayed (``capture/blocks.py``), in one process.

The program recorded with replay must be the one recorded without (the printed traces are
compared), a block that differs in any way its code can see must be traced on its own,
and every result must be eager's.
"""

import array
import collections
import re
import types

import pytest
import torch
import torch.nn as nn

import dtcompile
from dtcompile.capture import block_calls, tracer


class Block(nn.Module):
    def __init__(self, index: int, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.eps = 1e-5

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x))) * (1 + self.eps)


def blocks(n: int = 4, **kwargs) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(i, **kwargs) for i in range(n)])


def compiled(
    model, *args, replay: bool = True, cache: str = "constant values", stages: bool = False, calls: bool = False
):
    """(output, printed trace) of a first compiled call without gradients; with
    ``stages``, the printed traces of every stage (recorded, passes, lowered) in one text.
    Replayed blocks are recorded again, not called, unless ``calls`` (``test_block_calls.py``)."""
    saved = tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS
    tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS = replay, calls
    try:
        with torch.no_grad():
            jitted = dtcompile.jit(model, cache=cache)
            out = jitted(*args)
    finally:
        tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS = saved
    traces = dtcompile.last_traces(jitted)
    return out, "\n".join(map(str, traces if stages else traces[:1]))


def replay_lines(trace: str) -> list[str]:
    return [line for line in trace.splitlines() if "recorded once, replayed" in line]


def without_replay_lines(trace: str) -> str:
    return "\n".join(line for line in trace.splitlines() if "recorded once, replayed" not in line)


def assert_eager(model, args, out):
    with torch.no_grad():
        expected = model(*args)
    for got, want in zip(
        out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple) else (expected,)
    ):
        assert got.shape == want.shape and got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_replayed_program_is_the_traced_one(cache):
    model = blocks()
    x = torch.randn(3, 5, 8)
    out, trace = compiled(model, x, cache=cache, stages=True)
    _, traced = compiled(model, x, replay=False, cache=cache, stages=True)
    assert without_replay_lines(trace) == without_replay_lines(traced)  # every stage's program
    assert replay_lines(trace), trace  # the later blocks were replayed
    assert not replay_lines(traced)
    assert_eager(model, (x,), out)


def test_a_block_of_another_shape_is_traced():
    model = blocks()
    model[2] = Block(2, hidden=24)
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    (line,) = replay_lines(trace)
    assert "replayed for 2 more (1, 3)" in line
    assert_eager(model, (x,), out)


def test_an_attribute_the_code_reads_differs():
    model = blocks()
    model[2].eps = 0.5
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    assert "(1, 3)" in replay_lines(trace)[0]
    assert_eager(model, (x,), out)


class Numbered(Block):
    def __init__(self, index: int):
        super().__init__(index)
        self.layer_id = index  # read by no code a call runs: blocks still differ


def test_an_attribute_that_differs_is_traced():
    """Whether code reads an attribute cannot be known from its code (a helper, a
    descriptor, ``getattr`` with a computed name can read it): blocks whose attributes
    differ at all are traced, their submodules still replayed."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Numbered(i) for i in range(4)])
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    assert replay_lines(trace) and all("." in line.split()[1] for line in replay_lines(trace))
    assert_eager(model, (x,), out)


class Attention(nn.Module):
    """Like a grouped-query attention's projections: ``k`` and ``v`` of one shape, ``q`` of
    another, each called on the same input; and a layer's index, so that the layers differ."""

    def __init__(self, index: int, dim: int = 8):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim // 2)
        self.v = nn.Linear(dim, dim // 2)
        self.index = index

    def forward(self, x):
        return x + self.q(x) * torch.cat([self.k(x), self.v(x)], -1)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_blocks_of_one_class_and_input_with_other_tensors_are_each_replayed(cache):
    """A layer's ``k`` is unlike its ``q`` (another weight shape, the same input): it
    becomes a template of its own, which ``v`` and the later layers' ``k`` replay (each
    was traced)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Attention(i) for i in range(3)])
    x = torch.randn(3, 5, 8)
    out, trace = compiled(model, x, cache=cache, stages=True)
    _, traced = compiled(model, x, replay=False, cache=cache, stages=True)
    assert without_replay_lines(trace) == without_replay_lines(traced)
    # A layer traced as it is (its index differs from a template's) has its projections
    # become templates: constant values, "1.k recorded once, replayed for 3 more (1.v,
    # 2.k, 2.v)"; the layers' inputs differ in strides under symbolic values, the first two
    # are templates.
    lines = replay_lines(trace)
    assert any(re.match(r"# (\d)\.k recorded once, replayed for \d+ more \(\1\.v", line) for line in lines), lines
    assert_eager(model, (x,), out)


def test_a_hook_on_one_block():
    model = blocks()
    model[1].register_forward_hook(lambda module, args, output: output * 2)
    model[3].register_forward_pre_hook(lambda module, args: (args[0] - 1,))
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    assert "(2)" in replay_lines(trace)[0]
    assert_eager(model, (x,), out)


def test_hooks_over_different_values():
    model = blocks()
    for i, block in enumerate(model):
        factor = float(i + 1)
        block.register_forward_hook(lambda module, args, output, factor=factor: output * factor)
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    assert all("." in line.split()[1] for line in replay_lines(trace))  # their Linears only
    assert_eager(model, (x,), out)


def test_the_same_hook_on_every_block_is_replayed():
    model = blocks()
    for block in model:
        block.register_forward_hook(lambda module, args, output: output * (1 + module.eps))
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    assert "replayed for 3 more" in replay_lines(trace)[0]
    assert_eager(model, (x,), out)


class Branching(Block):
    def forward(self, x):
        y = super().forward(x)
        return y * 2 if self.training else y


def test_a_block_in_another_training_mode():
    torch.manual_seed(0)
    model = nn.Sequential(*[Branching(i) for i in range(4)]).eval()
    model[2].train()
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    assert "(1, 3)" in replay_lines(trace)[0]
    assert_eager(model, (x,), out)


def test_a_forward_patched_on_one_instance():
    model = blocks()
    model[2].forward = types.MethodType(lambda self, x: x - 1, model[2])
    x = torch.randn(3, 8)
    out, _ = compiled(model, x)
    assert_eager(model, (x,), out)


def test_forwards_set_on_every_instance():
    """An instance's own ``forward`` (as Hugging Face's tensor parallelism installs) is read
    by every call: closures over different values are different blocks."""
    model = blocks()
    for i, block in enumerate(model):
        original = block.forward

        def forward(x, original=original, scale=float(i + 1)):
            return original(x) * scale

        block.forward = forward
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    assert all("." in line.split()[1] for line in replay_lines(trace))  # their Linears only
    assert_eager(model, (x,), out)


class Tally(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0


class Counting(Block):
    def __init__(self, index: int, tally: Tally):
        super().__init__(index)
        self.tally = tally  # one for all blocks

    def forward(self, x):
        self.tally.calls += 1
        return super().forward(x) * self.tally.calls


def test_python_state_the_first_block_changes():
    """Each block reads an attribute the one before assigned (of a submodule they share): a
    replay of the first would read the first's value (eager's first call, traced, sees
    each block's own)."""
    torch.manual_seed(0)
    tally = Tally()
    model = nn.Sequential(*[Counting(i, tally) for i in range(4)])
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    tally.calls = 0
    out, trace = compiled(model, x)
    assert all("." in line.split()[1] for line in replay_lines(trace))  # their Linears only
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert tally.calls == 4  # the assignments are made after the call


class Reassigning(nn.Module):
    """The forward changes a block between its calls: the same block called again, and a
    block called after the first's attribute changed, must not replay what was recorded
    with the old value."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(i) for i in range(2))

    def forward(self, x):
        first, second = self.layers
        h = first(x)
        first.eps = 0.5
        h = first(h)  # the same module, now with another eps
        second.eps = 0.5
        h = second(h)  # equal to the first as it is now, not as it was recorded
        first.eps = 2.0
        h = first(h)  # changed since it was recorded, and since second was compared with it
        return h


def test_a_block_changed_between_its_calls():
    model = Reassigning()
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    with torch.no_grad():
        fresh = Reassigning()  # eager on a model in the state the compiled one started in
        expected = fresh(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert all("." in line.split()[1] for line in replay_lines(trace))  # Linears only


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y, scale=1.0):
        x.mul_(2)  # an in-place change of an argument, made by every block
        return self.lin(x) * scale + y, x


class Calls(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(TwoInputs() for _ in range(5))

    def forward(self, x, y):
        a, _ = self.layers[0](x, y)
        b, _ = self.layers[1](a, y)  # equivalent to the first: replayed
        c, _ = self.layers[2](b, b)  # the same tensor twice
        d, _ = self.layers[3](c, y, scale=3.0)  # another scale
        e, back = self.layers[4](d.clone(), y)
        return e, back


def test_arguments_that_differ():
    model = Calls()
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    out, trace = compiled(model, x.clone(), y)
    (line,) = replay_lines(trace)
    assert line.endswith("replayed for 2 more (layers.1, layers.4)")
    assert_eager(model, (x.clone(), y), out)


def test_an_argument_changed_in_place_and_returned():
    model = Calls()
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    eager_x, compiled_x = x.clone(), x.clone()
    with torch.no_grad():
        expected = model(eager_x, y)
        got = dtcompile.jit(model)(compiled_x, y)
    torch.testing.assert_close(compiled_x, eager_x, rtol=0, atol=0)  # the first block's mul_ on the input
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def _train(model_fn, x, replay: bool, calls: bool = False, cache: str = "constant values"):
    """(loss, parameter grads, input grad, every stage's program, replay lines) of one
    compiled training call. Replayed blocks are recorded again, not called, unless
    ``calls`` (``test_block_calls.py``)."""
    saved = tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS
    tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS = replay, calls
    try:
        model = model_fn()
        x = x.clone().requires_grad_()
        jitted = dtcompile.jit(model, cache=cache)
        loss = jitted(x).pow(2).sum()
        loss.backward()
    finally:
        tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS = saved
    traces = dtcompile.last_traces(jitted)
    # Without comments: the notes on the backward's symbols name the forward calls through
    # autograd nodes' metadata, which torch 2.10 does not keep on every node.
    program = "\n".join(line for line in "\n".join(map(str, traces)).splitlines() if not line.strip().startswith("#"))
    return (
        loss,
        [p.grad for p in model.parameters()],
        x.grad,
        program,
        replay_lines(str(traces[0])),
    )


class Transposing(nn.Module):
    """Each block's output is transposed before the next: the gradients reaching the
    blocks are not contiguous, unlike the cotangents the first backward template is
    recorded for, so another template is recorded from the first block's graph."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(i) for i in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).t()
        return x


@pytest.mark.parametrize("model_fn", [blocks, Transposing], ids=["stack", "transposed gradients"])
def test_training_replays_forward_and_backward(model_fn):
    x = torch.randn(8, 8)
    loss, grads, x_grad, program, lines = _train(model_fn, x, True)
    traced_loss, traced_grads, traced_x_grad, traced_program, _ = _train(model_fn, x, False)
    assert lines, "the later blocks were replayed"
    assert program == traced_program  # forward and backward, every stage
    reference = model_fn()
    x_ref = x.clone().requires_grad_()
    expected = reference(x_ref).pow(2).sum()
    expected.backward()
    for got, traced, want in zip(
        [*grads, x_grad], [*traced_grads, traced_x_grad], [*(p.grad for p in reference.parameters()), x_ref.grad]
    ):
        assert torch.equal(got, traced)
        torch.testing.assert_close(got, want)
    assert torch.equal(loss, traced_loss)


def test_a_change_after_compiling_is_a_miss():
    model = blocks()
    x = torch.randn(3, 8)
    with torch.no_grad():
        jitted = dtcompile.jit(model)
        jitted(x)
        model[3].eps = 2.0
        out = jitted(x)
    assert dtcompile.cache_misses(jitted) == 2
    assert_eager(model, (x,), out)


SETTINGS = {"scale": 1.0}


class ReadsState(nn.Module):
    """Equal blocks whose forward reads state its parent changes between them."""

    factor = 1.0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * SETTINGS["scale"] * self.factor


class ChangesState(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(ReadsState() for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == 2:
                self.layers[2].factor = self.layers[3].factor = 3.0  # over the class attribute
            x = layer(x)
        return x


class ScaleLinear(torch.overrides.TorchFunctionMode):
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * self.k if func is torch.nn.functional.linear else out


class ModePerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(ReadsState() for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            with ScaleLinear(float(i + 1)):  # a new mode per block, its id possibly reused
                x = layer(x)
        return x


class Stashing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, stash: list):
        y = self.lin(x)
        stash[0] = y  # writes into a list it received
        y.kind = "stashed"  # and sets an attribute on its output
        return y


class ReadsWhatBlocksLeft(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Stashing() for _ in range(3))

    def forward(self, x):
        stash = [x]
        total = x
        for layer in self.layers:
            y = layer(stash[0], stash)
            total = total + stash[0] * (2.0 if y.kind == "stashed" else 0.0)
        return total


class Arange(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + torch.arange(8) / 3  # a factory op, whose value tracing knows


@pytest.mark.parametrize(
    "make",
    [
        ChangesState,
        ModePerBlock,
        ReadsWhatBlocksLeft,
        lambda: torch.manual_seed(0) and nn.Sequential(*[Arange() for _ in range(3)]),
    ],
    ids=["state changed between blocks", "function mode per block", "argument and output changed", "factory op"],
)
def test_what_a_replay_cannot_see_is_traced(make):
    """Each model traced with replay on gives eager's result and the program traced with it
    off (blocks are replayed only where that holds)."""
    x = torch.randn(3, 8)
    ReadsState.factor, SETTINGS["scale"] = 1.0, 1.0
    with torch.no_grad():
        expected = make()(x)
    ReadsState.factor, SETTINGS["scale"] = 1.0, 1.0
    out, trace = compiled(make(), x, stages=True)
    ReadsState.factor, SETTINGS["scale"] = 1.0, 1.0
    _, traced = compiled(make(), x, replay=False, stages=True)
    ReadsState.factor, SETTINGS["scale"] = 1.0, 1.0
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert without_replay_lines(trace) == without_replay_lines(traced)


class ViewOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, y[0]  # an output and a view of it


class ChangesAView(nn.Module):
    """The caller changes, in place, a view a block returned, after using the block's
    other output: eager's gradients ignore it; the Function's outputs are not views."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(ViewOut() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            y, row = layer(x)
            x = y * 2
            row.mul_(3)
        return x


class SigmoidOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.sigmoid(self.lin(x))  # its backward reads its output


class ChangesASavedOutput(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(SigmoidOut() for _ in range(2))

    def forward(self, x):
        z = self.layers[1](self.layers[0](x))
        w = z * 1
        z.mul_(2)  # eager's autograd raises at the backward
        return w


def _eager_or_error(model_fn, x, jit: bool, replay: bool = True):
    saved, tracer.REPLAY_BLOCKS = tracer.REPLAY_BLOCKS, replay
    try:
        model = model_fn()
        x = x.clone().requires_grad_()
        (dtcompile.jit(model) if jit else model)(x).pow(2).sum().backward()
        return [p.grad for p in model.parameters()] + [x.grad]
    except RuntimeError as error:
        return "modified by an inplace operation" in str(error)
    finally:
        tracer.REPLAY_BLOCKS = saved


@pytest.mark.parametrize("model_fn", [ChangesAView, ChangesASavedOutput], ids=["view changed", "saved output changed"])
def test_training_changes_after_a_block(model_fn):
    """In-place changes after a block, in a call that needs gradients: eager's gradients,
    or eager's error that a value the backward needs was changed."""
    x = torch.randn(3, 4)
    expected = _eager_or_error(model_fn, x, jit=False)
    got = _eager_or_error(model_fn, x, jit=True)
    if expected is True:
        assert got is True
    else:
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)


class _Rope:
    def __init__(self):
        self.theta = 1.0


class _Config:
    def __init__(self):
        self.attention = types.SimpleNamespace(rope=_Rope(), scaling=types.SimpleNamespace(factor=1.0))


class ReadsDeepConfig(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.config = config

    def forward(self, x):
        attention = self.config.attention
        return self.lin(x) * attention.rope.theta * attention.scaling.factor


def _change_theta(config):
    config.attention.rope.theta += 1.0


def _change_factor(config):
    config.attention.scaling.factor *= 2.0


class ChangesDeepConfig(nn.Module):
    """The parent changes a value three and four levels down a config its layers share
    between their calls (and puts it back): each layer reads its own."""

    def __init__(self, change):
        super().__init__()
        torch.manual_seed(0)
        self.config, self.change = _Config(), change
        self.layers = nn.ModuleList(ReadsDeepConfig(self.config) for _ in range(4))

    def forward(self, x):
        saved = (self.config.attention.rope.theta, self.config.attention.scaling.factor)
        for layer in self.layers:
            x = layer(x)
            self.change(self.config)
        self.config.attention.rope.theta, self.config.attention.scaling.factor = saved
        return x


@pytest.mark.parametrize("change", [_change_theta, _change_factor])
def test_a_deep_config_value_changed_between_blocks(change):
    model = ChangesDeepConfig(change)
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not any(line.split()[1].count(".") == 1 for line in replay_lines(trace))  # no layers.N replayed


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)


class _ReadsConfigScale(_Scaled):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, x):
        return self.lin(x) * (self.config.scale + 0.0)  # the float is not kept alive by the trace


class _ReadsOwner(_Scaled):
    def forward(self, x):
        return self.lin(x) * self.__dict__["owner"].current  # a parent held as a plain attribute


class _ReadsArgumentTag(_Scaled):
    def forward(self, x):
        return self.lin(x) * x.tag


def _function_with(alpha):
    def act(t):
        return t

    act.alpha = alpha
    return act


class _ReadsFunctionAttribute(_Scaled):
    def __init__(self, alpha):
        super().__init__()
        self.act = _function_with(alpha)

    def forward(self, x):
        return self.act(self.lin(x)) * self.act.alpha


_BIG_TABLE = {f"k{i}": i for i in range(100)}
_BIG_TABLE["scale"] = 1.0


class _ReadsBigTable(_Scaled):
    def forward(self, x):
        return self.lin(x) * _BIG_TABLE["scale"]


class _ChangesBetweenLayers(nn.Module):
    """Four layers that read a value the parent changes before each (and puts back)."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.config, self.current = kind, types.SimpleNamespace(scale=1.0), 1.0
        make = {
            "replaced float": lambda i: _ReadsConfigScale(self.config),
            "owner attribute": lambda i: _ReadsOwner(),
            "argument attribute": lambda i: _ReadsArgumentTag(),
            "function attribute": lambda i: _ReadsFunctionAttribute(float(i + 1)),
            "big global table": lambda i: _ReadsBigTable(),
        }[kind]
        self.layers = nn.ModuleList(make(i) for i in range(4))
        for layer in self.layers:
            layer.__dict__["owner"] = self

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            self.config.scale = self.config.scale * 1.25
            self.current = _BIG_TABLE["scale"] = float(i + 1)
            x = x * 1
            x.tag = float(i + 1)
            x = layer(x)
        self.config.scale, self.current, _BIG_TABLE["scale"] = 1.0, 1.0, 1.0
        return x


@pytest.mark.parametrize(
    "kind", ["replaced float", "owner attribute", "argument attribute", "function attribute", "big global table"]
)
def test_layers_that_read_what_differs_between_them_are_not_replayed(kind):
    model = _ChangesBetweenLayers(kind)
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
    out, trace = compiled(model, x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not any(line.split()[1].count(".") == 1 for line in replay_lines(trace))  # no layers.N replayed


class _TwoInputs(_Scaled):
    def forward(self, x, y):
        return self.lin(x) * y


class _DependentInputs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = _TwoInputs(), _TwoInputs()

    def forward(self, x):
        return self.first(x, x + 1) + self.second(x * 2, x * 3)  # the first call's inputs depend


def test_a_first_block_whose_inputs_depend_on_each_other_is_not_replayed_with_gradients():
    model = _DependentInputs()
    reference = _DependentInputs()
    x = torch.randn(2, 4)
    got_x, expected_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    dtcompile.jit(model)(got_x).sum().backward()
    reference(expected_x).sum().backward()
    torch.testing.assert_close(got_x.grad, expected_x.grad, rtol=0, atol=0)
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, rtol=0, atol=0)


class _Mode(str):
    pass


class _ModeBlock(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.mode = mode

    def forward(self, x):
        y = self.lin(x)
        return y.relu() if self.mode == "relu" else -y


def test_blocks_differing_only_in_a_str_subclass_attribute():
    """A value of a subclass of str (or int) is compared by its value: the second block
    is not replayed from the first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_ModeBlock(_Mode("relu")), _ModeBlock(_Mode("neg")))
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(dtcompile.jit(model)(x), model(x), rtol=0, atol=0)


class _Slotted:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _Scales(list):
    pass


def _nested(value, levels):
    for _ in range(levels):
        value = types.SimpleNamespace(inner=value)
    return value


def _innermost(value):
    while isinstance(value, types.SimpleNamespace):
        value = value.inner
    return value


# How the third of four blocks' settings differ from the others': (make the settings of
# block i, read a scale from them).
SETTINGS = {
    "defaultdict factory": (
        lambda i: collections.defaultdict((lambda: 2.0) if i == 2 else (lambda: 1.0)),
        lambda s: s.copy()["missing"],
    ),
    "list subclass attribute": (
        lambda i: _Scales([1.0]) if i != 2 else _with(_Scales([1.0]), factor=2.0),
        lambda s: getattr(s, "factor", 1.0) * s[0],
    ),
    "OrderedDict": (lambda i: collections.OrderedDict(a=1.0 + (i == 2)), lambda s: s["a"]),
    "int or float key": (lambda i: {(1.0 if i == 2 else 1): 0}, lambda s: next(iter(s))),
    "bytearray": (lambda i: bytearray([1 + (i == 2)]), lambda s: float(s[0])),
    "array.array": (lambda i: array.array("d", [1.0 + (i == 2)]), lambda s: s[0]),
    "a slot": (lambda i: _Slotted(1.0 + (i == 2)), lambda s: s.value),
    "ten objects down": (lambda i: _nested(1.0 + (i == 2), 10), _innermost),
    "an item of a list of 60": (lambda i: [1.0] * 59 + [1.0 + (i == 2)], lambda s: s[59]),
}


def _with(value, **attributes):
    for name, item in attributes.items():
        setattr(value, name, item)
    return value


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_blocks_differing_in_settings_of_any_class_or_depth(kind):
    make, read = SETTINGS[kind]

    class Configured(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.settings = make(i)

        def forward(self, x):
            return self.lin(x) * read(self.settings)

    torch.manual_seed(0)
    model = nn.Sequential(*[Configured(i) for i in range(4)])
    x = torch.randn(3, 8)
    out, trace = compiled(model, x)
    assert_eager(model, (x,), out)
    assert not any("(1, 2, 3)" in line for line in replay_lines(trace))


class KeyTyped(nn.Module):
    """Reads the type of its dict argument's key: ``1``, ``1.0`` and ``True`` are one key
    to a dict, not to this code."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, d):
        return self.lin(x) * {int: 1.0, bool: 3.0, float: 5.0}[type(next(iter(d)))]


class KeyedStack(nn.Module):
    def __init__(self, keys):
        super().__init__()
        self.keys = keys
        self.layers = nn.ModuleList(KeyTyped() for _ in keys)

    def forward(self, x):
        for key, layer in zip(self.keys, self.layers):
            x = layer(x, {key: 0})
        return x


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("keys", [[1, 1, True], [True, True, 1], [1, 1, 1.0], [0.0, 0.0, -0.0]])
def test_dict_arguments_whose_keys_are_equal_but_of_other_types(keys, cache):
    """The later block replayed the first's program: the arguments' structure compared
    dict keys by ``==``."""
    torch.manual_seed(0)
    model = KeyedStack(keys)
    x = torch.randn(3, 8)
    out, _ = compiled(model, x, cache=cache)
    assert_eager(model, (x,), out)


class _HookedLayer(nn.Module):
    """A layer whose forward registers a gradient hook, scaling by the layer's index, on
    its output, on its input, or through a partial."""

    def __init__(self, index: int, where: str):
        super().__init__()
        self.index, self.where = index, where
        self.lin = nn.Linear(8, 8)

    def scale(self, grad):
        return grad * (self.index + 1)

    def forward(self, x):
        if self.where == "input":
            x = x * 1.0
            x.register_hook(lambda grad: grad * (self.index + 2))
        y = torch.tanh(self.lin(x))
        if self.where == "output":
            y.register_hook(lambda grad: grad * (self.index + 1))
        elif self.where == "bound method":
            y.register_hook(self.scale)
        return y


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("where", ["output", "input", "bound method"])
def test_gradient_hooks_each_layer_registers_run_in_its_own_backward(where, cache):
    """A hook a layer registers on a tensor runs in the backward: each layer's is its own
    Python (here its index), so neither a block that registers one nor the backward of a
    block whose input holds one is replayed for the next layers."""

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*(_HookedLayer(i, where) for i in range(4)))

    eager, traced = model(), model()
    jitted = dtcompile.jit(traced, cache=cache)
    for rows in (2, 3):
        x = torch.randn(rows, 8)
        x_eager, x_traced = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager(x_eager).pow(2).sum().backward()
        jitted(x_traced).pow(2).sum().backward()
        for (name, want), got in zip(eager.named_parameters(), traced.parameters()):
            torch.testing.assert_close(got.grad, want.grad, msg=name)
        torch.testing.assert_close(x_traced.grad, x_eager.grad)


class _CheckpointedLayer(nn.Module):
    """Two linears around a dropout, checkpointed without the RNG state: the backward's
    recompute draws another mask, and every gradient is the recomputed values'."""

    def __init__(self):
        super().__init__()
        self.lin, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def body(self, x):
        return x + self.lin2(torch.nn.functional.dropout(self.lin(x), 0.5, True))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False, preserve_rng_state=False)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_blocks_under_activation_checkpointing_take_the_recomputed_values(cache):
    """A replayed block's backward reads what its forward saved; under checkpointing's
    saved-tensor hooks eager's reads what the recompute gives back: not replayed there."""

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*(_CheckpointedLayer() for _ in range(4)))

    eager, traced = model(), model()
    jitted = dtcompile.jit(traced, cache=cache)
    for rows in (2, 3):
        x = torch.randn(rows, 3, 8)
        torch.manual_seed(1)
        eager(x).pow(2).sum().backward()
        torch.manual_seed(1)
        jitted(x).pow(2).sum().backward()
        for (name, want), got in zip(eager.named_parameters(), traced.parameters()):
            torch.testing.assert_close(got.grad, want.grad, msg=name)


class _NormalizingLayer(nn.Module):
    """Normalises its weight in place through ``.data`` (or ``detach()``), then applies it."""

    def __init__(self, through: str):
        super().__init__()
        self.lin, self.through = nn.Linear(8, 8), through

    def forward(self, x):
        weight = self.lin.weight.data if self.through == "data" else self.lin.weight.detach()
        weight.div_(weight.norm(dim=1, keepdim=True))
        return x + self.lin(x)


@pytest.mark.parametrize("through", ["data", "detach"])
def test_blocks_writing_their_weights_through_a_detached_alias_in_training(through):
    """A replayed ``detach`` was made like the first block's output, a view of a weight
    that requires grad: the write through it raised torch's leaf error."""

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*(_NormalizingLayer(through) for _ in range(4)))

    eager, traced = model(), model()
    jitted = dtcompile.jit(traced)
    for _ in range(2):
        x = torch.randn(2, 3, 8)
        want, got = eager(x), jitted(x)
        want.pow(2).sum().backward()
        got.pow(2).sum().backward()
        torch.testing.assert_close(got, want)
        for (name, a), b in zip(eager.named_parameters(), traced.parameters()):
            torch.testing.assert_close(b, a, msg=name)
            torch.testing.assert_close(b.grad, a.grad, msg=name)


class _ShapeReturning(nn.Module):
    """Returns its output with its input's ``torch.Size``; ``cache``: also given an
    object (a KV cache's way), so that its calls are checked rather than replayed."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, cache=None):
        return x + self.lin(x), (x.shape if cache is None else x.size())


class _ShapeCollecting(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_ShapeReturning() for _ in range(4))

    def forward(self, x, cache=None):
        shapes = []
        for layer in self.layers:
            x, shape = layer(x, cache)
            shapes.append(shape)
        return x, shapes


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("kind", ["replayed", "checked"])
def test_a_torch_size_later_blocks_return_is_a_torch_size(kind, cache):
    """torch's pytree rebuilds a ``torch.Size`` as a tuple: the later blocks' results were
    tuples where eager's are sizes."""
    torch.manual_seed(0)
    model = _ShapeCollecting()
    jitted = dtcompile.jit(model, cache=cache)
    extra = () if kind == "replayed" else (types.SimpleNamespace(),)
    with torch.no_grad():
        for rows in (5, 6):
            x = torch.randn(2, rows, 8)
            (got, got_shapes), (want, want_shapes) = jitted(x, *extra), model(x, *extra)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert [type(s) for s in got_shapes] == [torch.Size] * 4 and got_shapes == want_shapes


class _ViewReturning(nn.Module):
    """Returns a view of a tensor that requires grad and that it did not make: its own
    bias (``own``) or an argument (``argument``); given an object too, checked."""

    def __init__(self, of: str):
        super().__init__()
        self.lin, self.of = nn.Linear(8, 8), of

    def forward(self, x, encoded, cache=None):
        view = self.lin.bias.expand_as(x) if self.of == "own" else encoded[:, :1].transpose(0, 1)
        return x + self.lin(x), view


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("of", ["own", "argument"])
class _ViewsReturning(nn.Module):
    def __init__(self, of: str):
        super().__init__()
        self.layers = nn.ModuleList(_ViewReturning(of) for _ in range(4))

    def forward(self, x, encoded, cache=None):
        views = []
        for layer in self.layers:
            x, view = layer(x, encoded, cache)
            views.append(view)
        return x, views


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("of", ["own", "argument"])
@pytest.mark.parametrize("kind", ["replayed", "checked"])
def test_views_that_require_grad_later_blocks_return_without_gradients(kind, of, cache):
    """Under no_grad a view of a tensor that requires grad requires grad too; made again
    (a replayed block's, a memoized op's), it was no view autograd knew, and the call was
    refused as one returning a tensor made to require grad inside it."""
    torch.manual_seed(0)
    model = _ViewsReturning(of)
    extra = () if kind == "replayed" else (types.SimpleNamespace(),)
    jitted = dtcompile.jit(model, cache=cache)
    encoded = torch.randn(2, 3, 8, requires_grad=True)
    with torch.no_grad():
        for rows in (3, 4):
            x = torch.randn(2, rows, 8)
            (got, got_views), (want, want_views) = jitted(x, encoded, *extra), model(x, encoded, *extra)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            for a, b in zip(got_views, want_views):
                assert a.requires_grad == b.requires_grad and a.stride() == b.stride() and torch.equal(a, b)


class _Body(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Block(i) for i in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _WithHead(nn.Module):
    """A model's body under its head, as a Hugging Face ``*ForCausalLM`` holds its ``model``."""

    def __init__(self):
        super().__init__()
        self.body, self.head = _Body(), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("wrap", ["attribute", "Sequential"])
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_blocks_inside_a_body_under_a_head_are_replayed(wrap, cache):
    """The body, the one module of its class, is traced as it is, so its layers are one
    program called per layer, as when the body is jitted alone; with gradients it is as it
    was (traced whole: a replayed block's input gradient would differ in the last bits)."""
    torch.manual_seed(0)
    model = _WithHead() if wrap == "attribute" else nn.Sequential(_Body(), nn.Linear(8, 3))
    x = torch.randn(2, 5, 8)
    out, trace = compiled(model, x, cache=cache)
    assert_eager(model, (x,), out)
    (line,) = replay_lines(trace)  # (under symbolic values the first layer, given the call's input, apart)
    assert re.search(r"# body\.layers\.[01] recorded once, replayed for [23] more", line) or re.search(
        r"# 0\.layers\.[01] recorded once, replayed for [23] more", line
    )
    reference = type(model)() if wrap == "attribute" else nn.Sequential(_Body(), nn.Linear(8, 3))
    reference.load_state_dict(model.state_dict())
    jitted = dtcompile.jit(model, cache=cache)
    with torch.enable_grad():
        jitted(x).square().sum().backward()
        reference(x).square().sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad)


def test_a_body_called_twice_is_replayed_at_its_second_call():
    """A unique module holding repeated blocks, called twice (its weights shared): eager's
    results, the second call replaying the first."""
    torch.manual_seed(0)
    body = _Body(2)
    model = nn.Module()
    model.body = body
    model.forward = lambda x: body(body(x) * 0.5)
    x = torch.randn(2, 8)
    out, _ = compiled(model, x)
    assert_eager(model, (x,), out)


@pytest.mark.parametrize("slot", ["__name__", "__qualname__", "__module__", "__doc__"])
def test_layers_holding_functions_named_apart_are_not_alike(slot):
    """Functions of one code and one factory, renamed (``act.__name__ = "relu"``): a layer
    branching on the name is its own."""

    def make(name):
        def act(x):
            return x

        setattr(act, slot, name)
        return act

    class Layer(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.lin, self.act = nn.Linear(8, 8), act

        def forward(self, x):
            h = self.lin(x)
            return x + (torch.relu(h) if getattr(self.act, slot) == "relu" else torch.tanh(h))

    torch.manual_seed(0)
    model = nn.Sequential(*(Layer(make("relu" if i == 2 else "tanh")) for i in range(4)))
    x = torch.randn(2, 8)
    out, _ = compiled(model, x)
    assert_eager(model, (x,), out)
