"""A Hugging Face ``LlamaForCausalLM`` under the usual tensor-parallel plan, generating
greedily with a KV cache object on Gloo ranks, compiled against eager DTensor."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dtcompile
from dtcompile.testing.models import parallel_hf_llama

DECODE_STEPS = 4


def _cache(kind: str, config):
    from transformers import DynamicCache, StaticCache

    if kind == "static":
        return StaticCache(config=config, max_cache_len=16)
    return DynamicCache(config=config)


def _generate(forward, kind, config, prompt):
    """Greedy tokens, the last logits, the outputs' types and the cache."""
    cache = _cache(kind, config)
    tokens, types = [], set()
    inputs = prompt
    with torch.no_grad():
        for _ in range(1 + DECODE_STEPS):
            out = forward(input_ids=inputs, cache=cache, use_cache=True)
            types.add(type(out).__name__)
            assert out.past_key_values is cache  # the caller's own cache object
            inputs = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(inputs)
    return torch.cat(tokens, dim=1), out.logits, types, cache


def generation_case(kind: str, cache_option: str):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, config = parallel_hf_llama(mesh, vocab=128, hidden=64, layers=2, heads=4, kv_heads=2)
    jitted = dtcompile.jit(model, cache=cache_option)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    expected_tokens, expected_logits, expected_types, expected_cache = _generate(model, kind, config, prompt)
    tokens, logits, types, cache = _generate(jitted, kind, config, prompt)

    assert torch.equal(tokens, expected_tokens)
    assert types == expected_types == {"CausalLMOutputWithPast"}
    torch.testing.assert_close(logits, expected_logits)
    assert len(cache.layers) == len(expected_cache.layers)
    for layer, expected in zip(cache.layers, expected_cache.layers):
        assert layer.is_initialized and expected.is_initialized
        for name in ("keys", "values"):
            got, want = getattr(layer, name), getattr(expected, name)
            assert got.shape == want.shape and got.stride() == want.stride()
            torch.testing.assert_close(got, want)
        if kind == "static":
            assert torch.equal(layer.cumulative_length, expected.cumulative_length)

    inputs = {str(p.provenance) for p in dtcompile.last_traces(jitted)[0].inputs}
    assert "kwargs['cache'].layers[1].keys" in inputs
    return dtcompile.cache_misses(jitted)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("cache_option", ["constant values", "symbolic values"])
def test_generation_equals_eager(ranks2, kind, cache_option):
    misses = ranks2.run(generation_case, kind, cache_option, timeout=300)
    if kind == "dynamic" and cache_option == "constant values":
        expected = 1 + DECODE_STEPS  # the cache grows: every decode step has new sizes
    else:
        expected = 2  # the prefill, and one program for every decode step
    assert misses == [expected, expected]


def generation_without_cache(cache_option: str):
    """Greedy decoding with ``use_cache=False``: the whole sequence at every step. Under
    symbolic values one program serves every length: Hugging Face skips its check for
    packed sequences (a Python branch on tensor data) while dtcompile traces, as it does
    under torch.compile (``torch.compiler.is_compiling()`` is True while tracing)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, _ = parallel_hf_llama(mesh, vocab=128, hidden=64, layers=2, heads=4, kv_heads=2)
    jitted = dtcompile.jit(model, cache=cache_option)
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))

    def greedy(forward):
        tokens = prompt
        with torch.no_grad():
            for _ in range(DECODE_STEPS):
                out = forward(input_ids=tokens, use_cache=False)
                tokens = torch.cat([tokens, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens, out.logits

    tokens, logits = greedy(jitted)
    expected_tokens, expected_logits = greedy(model)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits)
    assert not torch.compiler.is_compiling()  # only while tracing
    return dtcompile.cache_misses(jitted)


@pytest.mark.parametrize("cache_option", ["constant values", "symbolic values"])
def test_generation_without_a_cache_compiles_once_under_symbolic_values(ranks2, cache_option):
    expected = 1 if cache_option == "symbolic values" else DECODE_STEPS
    assert ranks2.run(generation_without_cache, cache_option, timeout=300) == [expected, expected]
