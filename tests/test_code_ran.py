"""User functions a library holds in its own table and calls while the call is traced
(``capture/code_ran.py``): nothing the code reads names them, so what they read was baked
in, and a function registered in their place was not seen. Each case compared against eager
at every call, a global they read and the registration changed between calls."""

import pytest
import torch
from torch.distributions import Normal, kl_divergence, register_kl

import dtcompile

CACHES = ["constant values", "symbolic values"]
BETA = 1.0
SOFTCAP = None


class _Located(Normal):
    pass


@register_kl(_Located, _Located)
def _kl_scaled(p, q):
    return BETA * (p.loc - q.loc) ** 2


def _kl_doubled(p, q):
    return 2 * (p.loc - q.loc) ** 2


def _kl_loss(x):
    return kl_divergence(_Located(x, 1.0), _Located(torch.zeros_like(x), 1.0)).sum()


@pytest.mark.parametrize("cache", CACHES)
def test_a_kl_divergence_registered_with_torch_reads_and_registration_are_guarded(cache):
    global BETA
    jitted = dtcompile.jit(_kl_loss, cache=cache)
    try:
        for beta, registered in ((1.0, _kl_scaled), (2.0, _kl_scaled), (2.0, _kl_doubled), (3.0, _kl_scaled)):
            BETA = beta
            register_kl(_Located, _Located)(registered)
            x = torch.arange(3.0)
            assert torch.equal(jitted(x), _kl_loss(x))
    finally:
        BETA = 1.0
        register_kl(_Located, _Located)(_kl_scaled)


def _softcapped_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return (out if SOFTCAP is None else torch.tanh(out / SOFTCAP) * SOFTCAP), weights


def _halved_attention(module, query, key, value, attention_mask, **kwargs):
    out, weights = _softcapped_attention(module, query, key, value, attention_mask, **kwargs)
    return out / 2, weights


@pytest.mark.parametrize("cache", CACHES)
def test_a_hugging_face_attention_registered_by_name_reads_and_registration_are_guarded(cache):
    global SOFTCAP
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("dtc_softcapped", _softcapped_attention)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    config._attn_implementation = "dtc_softcapped"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    jitted = dtcompile.jit(model, cache=cache)
    ids = torch.randint(0, 64, (1, 6))
    try:
        for cap, registered in (
            (None, _softcapped_attention),
            (0.05, _softcapped_attention),
            (0.05, _halved_attention),
        ):
            SOFTCAP = cap
            AttentionInterface.register("dtc_softcapped", registered)
            with torch.no_grad():
                assert torch.equal(jitted(ids).logits, model(ids).logits)
    finally:
        SOFTCAP = None


class _Weighted:
    def __init__(self):
        self.beta = 1.0

    def kl(self, p, q):
        return self.beta * (p.loc - q.loc) ** 2


class _Scaled(Normal):
    pass


def _scaled_kl_loss(x):
    return kl_divergence(_Scaled(x, 1.0), _Scaled(torch.zeros_like(x), 1.0)).sum()


@pytest.mark.parametrize("cache", CACHES)
def test_a_method_registered_with_a_library_reads_its_objects_attributes(cache):
    weighted = _Weighted()
    register_kl(_Scaled, _Scaled)(weighted.kl)
    jitted = dtcompile.jit(_scaled_kl_loss, cache=cache)
    for beta in (1.0, 2.0, 5.0):
        weighted.beta = beta
        x = torch.arange(3.0)
        assert torch.equal(jitted(x), _scaled_kl_loss(x))


KL_LOG = []


class _Logged(Normal):
    pass


@register_kl(_Logged, _Logged)
def _logging_kl(p, q):
    out = (p.loc - q.loc) ** 2
    KL_LOG.append(out.detach())  # once per eager call; a compiled call would append once, while tracing
    return out


def test_what_a_function_a_library_calls_changes_is_refused_and_put_back():
    def loss(x):
        return kl_divergence(_Logged(x, 1.0), _Logged(torch.zeros_like(x), 1.0)).sum()

    with pytest.raises(dtcompile.TracingError, match="KL_LOG"):
        dtcompile.jit(loss)(torch.arange(3.0))
    assert KL_LOG == []  # (not a traced tensor left in it)
