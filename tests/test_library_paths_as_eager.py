"""torch's modules whose paths under torch.compile differ from eager's see torch as eager
does while dtcompile traces (``core/compiling.py``): torch.optim's functional optimizers
(Adam's bias corrections as Python floats, not float32 tensors), the fused inference
kernels of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``; the nested-tensor
fast path of ``nn.TransformerEncoder``, which tracing cannot follow, is refused."""

import contextlib

import pytest
import torch
from torch.optim.adam import adam
from torch.optim.adamw import adamw

import dtcompile

CACHES = ["constant values", "symbolic values"]


def _functional_steps(compiled: bool, cache: str, step_fn, foreach: bool) -> list:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8))
    m, v, step = torch.zeros(8), torch.zeros(8), torch.tensor(0.0)

    @torch.no_grad()
    def update():
        step_fn(
            [w], [w.grad], [m], [v], [], [step], foreach=foreach, capturable=False, differentiable=False,
            fused=None, grad_scale=None, found_inf=None, has_complex=False, amsgrad=False,
            beta1=0.9, beta2=0.999, lr=0.1, weight_decay=0.01, eps=1e-8, maximize=False,
        )  # fmt: skip

    run = dtcompile.jit(update, cache=cache) if compiled else update
    weights = []
    for _ in range(3):
        (w * w).sum().backward()
        run()
        w.grad = None
        weights.append(w.detach().clone())
    return [*weights, step.clone(), m.clone(), v.clone()]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("step_fn", [adam, adamw])
@pytest.mark.parametrize("foreach", [False, True])
def test_functional_optimizers_step_as_eager(cache, step_fn, foreach):
    expected = _functional_steps(False, cache, step_fn, foreach)
    for got, want in zip(_functional_steps(True, cache, step_fn, foreach), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("cache", CACHES)
def test_fused_inference_kernels_as_eager(cache):
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    jitted_attention = dtcompile.jit(lambda a: attention(a, a, a)[0], cache=cache)
    jitted_layer = dtcompile.jit(layer, cache=cache)
    with torch.no_grad():
        for _ in range(2):  # (compiled, not run eagerly after a failed trace)
            torch.testing.assert_close(jitted_attention(x), attention(x, x, x)[0], rtol=0, atol=0)
            torch.testing.assert_close(jitted_layer(x), layer(x), rtol=0, atol=0)
    for jitted in (jitted_attention, jitted_layer):
        assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (1, 1)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("nested", [True, False], ids=["nested fast path", "enable_nested_tensor=False"])
def test_a_transformer_encoder_with_a_padding_mask(cache, nested):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=nested)
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[False, False, False, True, True], [False] * 5])
    with torch.no_grad():
        encoder.train()
        torch.testing.assert_close(
            dtcompile.jit(encoder, cache=cache)(x, src_key_padding_mask=mask), encoder(x, src_key_padding_mask=mask)
        )
        encoder.eval()
    with torch.enable_grad():  # (eval with gradients: eager's dense path, not refused)
        got = dtcompile.jit(encoder, cache=cache)(x, src_key_padding_mask=mask)
        torch.testing.assert_close(got, encoder(x, src_key_padding_mask=mask), rtol=0, atol=0)
    with torch.no_grad():
        if nested:  # eager's padded positions are zeros, which the traced dense path would not give
            with pytest.raises(dtcompile.TracingError, match="nested-tensor fast path"):
                dtcompile.jit(encoder, cache=cache)(x, src_key_padding_mask=mask)
        else:  # (bit for bit where torch can trace the fused layer: torch 2.10 has no meta kernel for it)
            got = dtcompile.jit(encoder, cache=cache)(x, src_key_padding_mask=mask)
            exact = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_transformer_encoder_layer_fwd", "Meta")
            tolerance = {"rtol": 0, "atol": 0} if exact else {}
            torch.testing.assert_close(got, encoder(x, src_key_padding_mask=mask), **tolerance)


@pytest.mark.parametrize("cache", CACHES)
def test_fused_kernels_turned_away_under_the_callers_function_mode(cache):
    """Under a torch function mode of the caller's (a default device), eager's fused
    kernels are not taken: nor are they in the program."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), torch.device("cpu"):
        torch.testing.assert_close(dtcompile.jit(layer, cache=cache)(x), layer(x), rtol=0, atol=0)


def _pooled_over_time(h):
    return torch.nn.functional.max_pool1d(h.transpose(1, 2), 2)


def _pooled_module(h):
    return torch.nn.MaxPool1d(3, ceil_mode=True)(h.mT)


def _pooled_to_one(x):  # (a (1, 2, 1) result: eager's strides (2, 1, 1))
    return torch.nn.functional.max_pool1d(x.mT.contiguous().mT, 2, ceil_mode=True)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("fn", [_pooled_over_time, _pooled_module, _pooled_to_one])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_max_pool1d_of_a_transposed_input_is_laid_out_as_eager(fn, requires_grad, cache):
    # max_pool1d's C++ code takes a CPU fast path with a contiguous result, but for a tensor
    # subclass (a traced one) or one needing a gradient: the compiled result followed the
    # transposed input's layout, (16, 1, 4) where eager's is (16, 4, 1).
    h = torch.randn(*(1, 2, 1) if fn is _pooled_to_one else (2, 9, 4), requires_grad=requires_grad)
    expected, got = fn(h), dtcompile.jit(fn, cache=cache)(h)
    assert torch.equal(got, expected) and got.stride() == expected.stride()
    if requires_grad:
        (eager_grad,), (grad,) = torch.autograd.grad(expected.sum(), h), torch.autograd.grad(got.sum(), h)
        assert torch.equal(grad, eager_grad) and grad.stride() == eager_grad.stride()


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss_with_padded_targets_is_eagers(reduction, cache):
    # Traced under torch's Python dispatcher, the loss ran torch's decomposition, which does
    # not stop at a target's first -1 (eager [2.78, 1.76], compiled [15.98, 6.01], gradients
    # apart too) and gives a 1-D input's unreduced loss the shape (1,) where eager's is ().
    def loss(x, target):
        return torch.nn.functional.multilabel_margin_loss(x, target, reduction=reduction)

    target = torch.tensor([[3, 0, -1, 1], [1, 2, 3, -1]])
    for x, t in ((torch.randn(2, 4), target), (torch.randn(4), target[0])):
        x.requires_grad_()
        expected, got = loss(x, t), dtcompile.jit(loss, cache=cache)(x, t)
        assert torch.allclose(got, expected) and got.shape == expected.shape
        assert torch.allclose(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(expected.sum(), x)[0])


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
def test_max_pool1d_of_integers_raises_eagers_error(dtype, cache):
    # (Our kernel laying max_pool1d out as eager's fast path ran it for integers, where eager's
    # fast path has no kernel for them.)
    x = torch.ones(1, 2, 4, dtype=dtype)
    with pytest.raises(NotImplementedError) as eager:
        torch.nn.functional.max_pool1d(x, 2)
    with pytest.raises(NotImplementedError) as compiled:
        dtcompile.jit(lambda t: torch.nn.functional.max_pool1d(t, 2), cache=cache)(x)
    assert str(compiled.value) == str(eager.value)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("form", ["the model", "its bound forward"])
def test_hugging_face_outputs_set_up_at_their_first_use_run_eagerly_once_then_compile(form, cache):
    # transformers registers its output-capturing hooks on the layers at the first call that
    # asks for hidden states (and marks the model): taken for the call changing module state,
    # it was refused at every call. That call now runs eagerly (registering them, as eager's),
    # the next compiles; also where ``model.forward`` is compiled (its model a reached module).
    model, reference = _tiny_llama(), _tiny_llama()
    compiled = model if form == "the model" else model.forward
    jitted, ids = dtcompile.jit(compiled, cache=cache), torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        for call in range(3):
            with pytest.warns(UserWarning, match="LibrarySetUp") if call == 0 else contextlib.nullcontext():
                got = jitted(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
            expected = reference(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
            assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(got, expected))
    assert len(dtcompile.compile_seconds(jitted)) == 1  # (the second call compiled, the third reused it)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("model", ["falcon", "qwen2"])
def test_hugging_face_sdpa_packs_a_one_token_querys_heads_as_eager(model, cache):
    """Hugging Face's SDPA attention packs a one-token query's heads (multi- and grouped-query
    attention) only when not compiling; traced, it repeated the key and value heads instead:
    decode logits that differed in the last bits (Falcon always, Qwen2 with a padding mask)."""
    import copy

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if model == "falcon":
        config = transformers.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
        eager = transformers.FalconForCausalLM(config).eval()
    else:
        config = transformers.Qwen2Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )  # fmt: skip
        eager = transformers.Qwen2ForCausalLM(config).eval()
    jitted = dtcompile.jit(copy.deepcopy(eager), cache=cache)
    ids, mask = torch.randint(1, 128, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0
    caches = transformers.DynamicCache(config=config), transformers.DynamicCache(config=config)
    with torch.no_grad():
        for _ in range(3):
            expected = eager(input_ids=ids, attention_mask=mask, past_key_values=caches[0]).logits
            got = jitted(input_ids=ids, attention_mask=mask, past_key_values=caches[1]).logits
            assert torch.equal(got, expected)
            ids, mask = expected[:, -1:].argmax(-1), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)


def _tiny_bert_classifier():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    return BertForSequenceClassification(config).eval()


@pytest.mark.parametrize("cache", CACHES)
def test_a_config_attribute_set_from_none_at_the_first_call_runs_eagerly_once(cache):
    # A classification model's first call with labels sets ``config.problem_type`` (from
    # None): it was refused as a change of Python state at every call. It runs eagerly once
    # (setting it, as eager's), and the next call compiles with it set.
    model, reference = _tiny_bert_classifier(), _tiny_bert_classifier()
    jitted, ids, labels = dtcompile.jit(model, cache=cache), torch.randint(1, 128, (2, 9)), torch.tensor([0, 2])
    with torch.no_grad():
        for call in range(3):
            with pytest.warns(UserWarning, match="problem_type from None") if call == 0 else contextlib.nullcontext():
                got = jitted(input_ids=ids, labels=labels)
            expected = reference(input_ids=ids, labels=labels)
            assert torch.equal(got.loss, expected.loss) and torch.equal(got.logits, expected.logits)
            assert model.config.problem_type == reference.config.problem_type == "single_label_classification"
    assert len(dtcompile.compile_seconds(jitted)) == 1


class _Configured(torch.nn.Module):
    def __init__(self, settings):
        super().__init__()
        self.settings = settings

    def forward(self, x):
        if self.settings.mode is None:
            self.settings.mode = "scaled"  # (once: later calls find it set)
        self.settings.calls += 1  # (at every call: refused)
        return x * 2


class _SetUpOnce(_Configured):
    def forward(self, x):
        if self.settings.mode is None:
            self.settings.mode = "scaled"
        return x * (2 if self.settings.mode == "scaled" else 3)


def test_only_attributes_set_from_none_count_as_a_first_calls_setup():
    import types

    settings = types.SimpleNamespace(mode=None)
    jitted = dtcompile.jit(_SetUpOnce(settings))
    with pytest.warns(UserWarning, match="mode from None"):
        assert torch.equal(jitted(torch.ones(2)), torch.full((2,), 2.0))
    assert settings.mode == "scaled"
    assert torch.equal(jitted(torch.ones(2)), torch.full((2,), 2.0)) and dtcompile.cache_misses(jitted) == 1
    settings.mode = "plain"  # (guarded: a new entry)
    assert torch.equal(jitted(torch.ones(2)), torch.full((2,), 3.0))
    settings = types.SimpleNamespace(mode=None, calls=0)
    with pytest.raises(dtcompile.TracingError, match="the traced code changed"):
        dtcompile.jit(_Configured(settings))(torch.ones(2))
    assert settings.mode is None and settings.calls == 0


def _small_llama(bidirectional: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    for layer in model.model.layers[1:] if bidirectional else ():
        layer.self_attn.is_causal = False  # (an embedding model's bidirectional layer)
    return model


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("padding", [None, 0, 2], ids=["no mask", "all-ones mask", "left padding"])
def test_hugging_face_masks_are_eagers(bidirectional, padding, cache):
    """Hugging Face skips a causal mask only when not traced (then SDPA takes the module's
    ``is_causal``): its masks are built as in eager, a padding mask read as a branch on data,
    so a layer with ``is_causal=False`` is not made causal and the logits are eager's bits."""
    model = _small_llama(bidirectional)
    jitted = dtcompile.jit(model, cache=cache)
    for length in (5, 7):
        ids = torch.randint(0, 128, (2, length))
        kwargs = dict(input_ids=ids, use_cache=False)
        if padding is not None:
            kwargs["attention_mask"] = torch.ones(2, length, dtype=torch.long)
            kwargs["attention_mask"][0, :padding] = 0
        with torch.no_grad():
            assert torch.equal(jitted(**kwargs).logits, model(**kwargs).logits)


@torch.enable_grad()
def test_hugging_face_training_with_hidden_states_runs_its_setup_eagerly_once():
    """``output_hidden_states=True`` installs Hugging Face's capturing hooks at the first call
    (and notes it in a module attribute): that call runs eagerly, in training too, and the
    next ones compile with eager's loss and gradients."""
    import copy

    model = _small_llama(False).train()
    reference = copy.deepcopy(model)
    jitted = dtcompile.jit(model)
    ids = torch.randint(0, 128, (2, 6))
    for _ in range(3):
        got = jitted(input_ids=ids, labels=ids, output_hidden_states=True)
        expected = reference(input_ids=ids, labels=ids, output_hidden_states=True)
        got.loss.backward()
        expected.loss.backward()
        assert torch.equal(got.loss, expected.loss) and len(got.hidden_states) == len(expected.hidden_states)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
    assert dtcompile.cache_misses(jitted) == 1
