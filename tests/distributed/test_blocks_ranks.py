"""Repeated tensor-parallel blocks recorded once and replayed (``capture/blocks.py``), on
Gloo ranks: the program is the one recorded without replay, a block that differs is
traced on its own, and results are eager's."""

import re

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import dtcompile
from dtcompile.capture import block_calls, tracer
from dtcompile.testing.models import LlamaModel, llama_plan, parallel_block, parallel_llama


def _first_call(model, args: tuple, kwargs: dict, replay: bool, cache: str, calls: bool = False):
    """Replayed blocks recorded again, unless ``calls``: one program called per block."""
    saved = tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS
    tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS = replay, calls
    try:
        with torch.no_grad():
            jitted = dtcompile.jit(model, cache=cache)
            out = jitted(*args, **kwargs)
    finally:
        tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS = saved
    return out, "\n".join(map(str, dtcompile.last_traces(jitted)))  # every stage's program


def _local(value):
    value = getattr(value, "logits", value)
    return value.to_local() if isinstance(value, DTensor) else value


def _replays(trace: str) -> list[str]:
    """The replay lines of the recorded trace (each stage repeats them)."""
    return list(dict.fromkeys(line for line in trace.splitlines() if "recorded once, replayed" in line))


def _without_replays(trace: str) -> str:
    return "\n".join(line for line in trace.splitlines() if "recorded once, replayed" not in line)


def _compare(model, args: tuple, kwargs: dict, cache: str) -> tuple[list[str], list[str]]:
    """Checks the program and the results, with blocks recorded again and called; returns
    the replay lines of the trace, and the blocks the called program calls."""
    out, trace = _first_call(model, args, kwargs, True, cache)
    _, traced = _first_call(model, args, kwargs, False, cache)
    assert _without_replays(trace) == _without_replays(traced)
    called, called_trace = _first_call(model, args, kwargs, True, cache, calls=True)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    torch.testing.assert_close(_local(out), _local(expected), rtol=0, atol=0)
    torch.testing.assert_close(_local(called), _local(expected), rtol=0, atol=0)
    return _replays(trace), re.findall(r"= (block_\w+)\(", called_trace.split("\n\n# ")[0])


def llama_case(cache):
    mesh = init_device_mesh("cpu", (2,))
    model = parallel_llama(mesh, layers=4, dim=64, hidden=128, n_heads=4)
    return _compare(model, (torch.randint(0, 512, (2, 8)),), {}, cache)


def sequence_parallel_case(cache):
    mesh = init_device_mesh("cpu", (2,))
    model = nn.Sequential(
        *[parallel_block(mesh, dim=32, n_heads=4, hidden=64, sequence_parallel=True, seed=i) for i in range(3)]
    )
    torch.manual_seed(1)
    return _compare(model, (torch.randn(2, 4, 32),), {}, cache)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_tensor_parallel_blocks_are_replayed(cache, ranks2):
    lines, calls = ranks2.run(llama_case, cache)[0]
    assert "layers.0 recorded once, replayed for 3 more (layers.1, layers.2, layers.3)" in lines[0]
    assert calls == ["block_layers_0"] * 4  # every layer a call of one program


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_sequence_parallel_blocks_are_replayed(cache, ranks2):
    lines, calls = ranks2.run(sequence_parallel_case, cache)[0]
    assert any("replayed for" in line for line in lines)
    assert len(calls) >= 2 and len(set(calls)) == 1  # the first block, taking the call's input, is keyed apart


def differing_layer_case(kind):
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = LlamaModel(dim=64, hidden=128, n_heads=4, layers=4)
    plan = llama_plan(4)
    if kind == "unsharded":  # layer 2 is not parallelized: plain tensors
        plan = {k: v for k, v in plan.items() if not k.startswith("layers.2.")}
    elif kind == "style":  # layer 2's MLP keeps DTensors between its linears
        plan["layers.2.mlp.gate"] = ColwiseParallel(use_local_output=False)
        plan["layers.2.mlp.up"] = ColwiseParallel(use_local_output=False)
    model = parallelize_module(model, mesh, plan)
    if kind == "hook":
        model.layers[2].register_forward_hook(lambda module, args, output: output * 0.5)
    return _compare(model, (torch.randint(0, 512, (2, 8)),), {}, "constant values")


@pytest.mark.parametrize("kind", ["unsharded", "hook", "style"])
def test_a_layer_that_differs_is_traced(kind, ranks2):
    lines, calls = ranks2.run(differing_layer_case, kind)[0]
    assert "layers.0 recorded once, replayed for 2 more (layers.1, layers.3)" in lines[0]
    assert calls.count("block_layers_0") == 3


def hf_case(cache):
    from transformers import StaticCache

    from dtcompile.testing.models import parallel_hf_llama

    mesh = init_device_mesh("cpu", (2,))
    model, config = parallel_hf_llama(mesh, vocab=128, hidden=64, layers=3, heads=4, kv_heads=2, max_positions=64)
    prompt = torch.randint(0, 128, (1, 6))
    lines = []
    for replay in (True, False):
        static = StaticCache(config=config, max_cache_len=16)
        _, trace = _first_call(model, (), dict(input_ids=prompt, cache=static, use_cache=True), replay, cache)
        lines.append(trace)
    assert _without_replays(lines[0]) == _without_replays(lines[1])
    static, eager_cache = StaticCache(config=config, max_cache_len=16), StaticCache(config=config, max_cache_len=16)
    jitted = dtcompile.jit(model, cache=cache)
    tokens, eager_tokens = prompt, prompt
    with torch.no_grad():
        for _ in range(3):  # the prefill, then decode steps
            logits = jitted(input_ids=tokens, cache=static, use_cache=True).logits
            expected = model(input_ids=eager_tokens, cache=eager_cache, use_cache=True).logits
            torch.testing.assert_close(_local(logits), _local(expected))  # as test_hf_llama.py: not bit-equal
            tokens = eager_tokens = expected[:, -1:].argmax(-1)
    return _replays(lines[0])


def test_hugging_face_layers_parts_are_replayed(ranks2):
    """A decoder layer reads its own cache layer (``self.layer_idx``): not replayed; its
    MLP, norms and projections are."""
    lines = ranks2.run(hf_case, "symbolic values")[0]
    assert any("model.layers.0.mlp recorded once, replayed for 2 more" in line for line in lines)
    assert not any(line.startswith("# model.layers.0 recorded") for line in lines)


def _train(make, x, replay: bool, cache: str, calls: bool = False):
    """Replayed blocks recorded again, unless ``calls``: a forward and a backward program
    called per block."""
    saved = tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS
    tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS = replay, calls
    try:
        model = make()
        jitted = dtcompile.jit(model, cache=cache)
        loss = _local(jitted(x)).pow(2).mean()
        loss.backward()
    finally:
        tracer.REPLAY_BLOCKS, block_calls.BLOCK_CALLS = saved
    program = "\n".join(map(str, dtcompile.last_traces(jitted)))
    return loss, [_local(p.grad) for p in model.parameters()], program


def training_case(kind, cache):
    mesh = init_device_mesh("cpu", (2,))
    if kind == "llama":

        def make():
            return parallel_llama(mesh, layers=4, dim=64, hidden=128, n_heads=4)

        x = torch.randint(0, 512, (2, 8))
    else:

        def make():
            blocks = [
                parallel_block(mesh, dim=32, n_heads=4, hidden=64, sequence_parallel=True, seed=i) for i in range(4)
            ]
            return nn.Sequential(*blocks)

        torch.manual_seed(1)
        x = torch.randn(2, 4, 32)
    loss, grads, program = _train(make, x, True, cache)
    traced_loss, traced_grads, traced_program = _train(make, x, False, cache)
    assert _without_replays(program) == _without_replays(traced_program)  # forward and backward, every stage
    called_loss, called_grads, called_program = _train(make, x, True, cache, calls=True)
    called = set(re.findall(r"= (block_\w+)\(", called_program))
    assert any(name.endswith("_backward") for name in called) and len(called) >= 2, called
    reference = make()
    _local(reference(x)).pow(2).mean().backward()
    for got, traced, param in zip(grads + called_grads, traced_grads * 2, [*reference.parameters()] * 2):
        assert torch.equal(got, traced)
        torch.testing.assert_close(got, _local(param.grad))
    assert torch.equal(loss, traced_loss) and torch.equal(called_loss, traced_loss)
    return _replays(program)


@pytest.mark.parametrize("kind, cache", [("llama", "constant values"), ("sequence parallel", "symbolic values")])
def test_training_replays_blocks_forward_and_backward(kind, cache, ranks2):
    lines = ranks2.run(training_case, kind, cache)[0]
    assert any("recorded once, replayed for" in line for line in lines)


class _GatheringBlock(nn.Module):
    """A block given its input sharded on the sequence dim, which it gathers: the size it
    gathers to (``s``) is held by none of its inputs (their local shard is ``ceil(s/2)``)."""

    def __init__(self, mesh, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.mesh = mesh
        self.w = nn.Parameter(distribute_tensor(torch.randn(16, 16) / 4, mesh, [Shard(1)]))

    def forward(self, x):
        return torch.tanh(x.redistribute(self.mesh, [Replicate()]) @ self.w)


class _SequenceShardedBetweenLayers(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.layers = nn.ModuleList(_GatheringBlock(mesh, seed) for seed in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).redistribute(self.mesh, [Shard(1)])
        return x


def gathering_case(grad: bool):
    mesh = init_device_mesh("cpu", (2,))
    model = _SequenceShardedBetweenLayers(mesh)
    jitted = dtcompile.jit(model, cache="symbolic values")
    for length in (8, 11, 12):
        torch.manual_seed(length)
        x = distribute_tensor(torch.randn(2, length, 16), mesh, [Replicate()])
        with torch.set_grad_enabled(grad):
            out, expected = jitted(x), model(x)
            torch.testing.assert_close(out.full_tensor(), expected.full_tensor(), rtol=0, atol=0)
        if grad:
            got = torch.autograd.grad(out.full_tensor().pow(2).sum(), list(model.parameters()))
            want = torch.autograd.grad(expected.full_tensor().pow(2).sum(), list(model.parameters()))
            for a, b in zip(got, want):
                torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-5, atol=1e-6)
    return _replays("\n".join(map(str, dtcompile.last_traces(jitted))))


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_blocks_that_gather_a_sequence_sharded_input_under_symbolic_values(grad, ranks2):
    """Each layer gathers its sequence-sharded input: the sizes its program needs are not
    its inputs' (once a crash in the block program's passes); eager's results."""
    lines = ranks2.run(gathering_case, grad)[0]
    assert any("recorded once, replayed for" in line for line in lines), lines


def hf_layers_case(cache):
    """A generation with six decoder layers: each layer picks its KV-cache layer by its
    ``layer_idx`` and updates it in place, so it is traced as it is; the second and third
    are logged, the later ones checked (``capture/verified.py``), and all six call one
    program (``capture/outlining.py``)."""
    from transformers import StaticCache

    from dtcompile.capture import outlining, verified
    from dtcompile.testing.models import parallel_hf_llama

    mesh = init_device_mesh("cpu", (2,))
    model, config = parallel_hf_llama(mesh, vocab=128, hidden=64, layers=6, heads=4, kv_heads=2, max_positions=64)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    runs = []
    for outlined in (True, False):
        saved = outlining.ENABLED, verified.ENABLED
        outlining.ENABLED = verified.ENABLED = outlined
        try:
            static = StaticCache(config=config, max_cache_len=16)
            jitted = dtcompile.jit(model, cache=cache)
            tokens, outs = prompt, []
            with torch.no_grad():
                for _ in range(4):  # the prefill, then decode steps
                    outs.append(_local(jitted(input_ids=tokens, cache=static, use_cache=True).logits))
                    tokens = outs[-1][:, -1:].argmax(-1)
        finally:
            outlining.ENABLED, verified.ENABLED = saved
        runs.append((outs, static, str(dtcompile.last_traces(jitted)[0]), dtcompile.cache_misses(jitted)))
    (outs, static, trace, misses), (traced_outs, traced_static, traced, _) = runs
    for got, want in zip(outs, traced_outs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same ops, in the same order
    for layer, want in zip(static.layers, traced_static.layers):
        torch.testing.assert_close(layer.keys, want.keys, rtol=0, atol=0)
        torch.testing.assert_close(layer.values, want.values, rtol=0, atol=0)
    eager_cache, tokens = StaticCache(config=config, max_cache_len=16), prompt
    with torch.no_grad():
        for got in outs:
            expected = _local(model(input_ids=tokens, cache=eager_cache, use_cache=True).logits)
            torch.testing.assert_close(got, expected)  # as test_hf_llama.py: not bit-equal
            tokens = expected[:, -1:].argmax(-1)
    return re.findall(r"= (block_\w+)\(", trace.split("\n\n# ")[0]), misses, re.findall(r"= (block_\w+)\(", traced)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_hugging_face_decoder_layers_are_one_program(cache, ranks2):
    for calls, misses, traced_calls in ranks2.run(hf_layers_case, cache):
        assert calls.count(calls[0]) == 6, calls  # the six decoder layers
        assert all(name.startswith("block_model_layers_") for name in calls)
        assert not any(name.startswith("block_model_layers_0(") for name in traced_calls)
        assert misses == 2  # the prefill and the decode steps
