"""The nvFuser executor in one process, without a GPU: its reference backend against eager.

What is tested here is what the executor does before nvFuser sees anything: which ops
form regions and where they end, the fusion programs (ops translated into primitives,
symbolic sizes, the input descriptions the cache is keyed by), the layout of fused
outputs, and that on a machine without CUDA nvFuser is reported unavailable and never
imported. ``test_nvfuser_cuda_*`` run nvFuser itself and are skipped without a GPU.
"""

import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from support import assert_same_result

import dtcompile
from dtcompile.executors import FusionExecutor
from dtcompile.executors.fusion import CACHE, FusionRegion
from dtcompile.executors.fusion.layout import dense_order, dense_strides, stride_order, tensor_descriptor

REFERENCE = ["nvfuser:reference", "torch"]


@pytest.fixture(autouse=True)
def fresh_cache():
    CACHE.clear()
    yield


def _fusions(jitted) -> list:
    execution = dtcompile.last_traces(jitted)[-1]
    return [b for b in execution.bound_symbols if isinstance(b.symbol, FusionRegion)]


def _fused_programs(jitted) -> list:
    return [b.symbol.globals[0][1].program for b in _fusions(jitted)]


def _norm_mlp(x, w, scale):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    u = h @ w
    return torch.softmax(F.silu(u) * 0.5, dim=-1), F.gelu(u).sum(0), torch.ones_like(u.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfuser_reference_matches_eager(dtype):
    x, w, scale = torch.randn(6, 16, dtype=dtype), torch.randn(16, 8, dtype=dtype), torch.rand(16, dtype=dtype)
    jitted = dtcompile.jit(_norm_mlp, executors=REFERENCE)
    with torch.no_grad():
        got, expected = jitted(x, w, scale), _norm_mlp(x, w, scale)
    # Fusions keep float32 intermediates where eager rounds each op to bf16.
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape and g.stride() == e.stride()
        torch.testing.assert_close(g, e, **tolerance)
    # The norm before the matmul, and the activations after it: two fusions around mm.
    assert len(_fusions(jitted)) == 2
    text = str(dtcompile.last_traces(jitted)[-1])
    assert "fusion0: reference fusion of" in text and "torch.mm" in text


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 6, 5),
        lambda: torch.randn(4, 6, 5).permute(2, 0, 1),
        lambda: torch.randn(4, 7, 5)[:, 1:].permute(1, 2, 0),
        lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: torch.randn(4, 1, 5).transpose(0, 2),
    ],
    ids=["contiguous", "permuted", "sliced-permuted", "channels-last", "size-1-transposed"],
)
def test_nvfuser_outputs_have_eagers_strides(make):
    def fn(x):
        return torch.ones_like(x) * 2, torch.full_like(x, 3.0) + x, (x * 2).exp(), torch.zeros_like(x) - x.abs()

    x = make()
    jitted = dtcompile.jit(fn, executors=[FusionExecutor("reference", min_ops=1), "torch"])
    with torch.no_grad():
        assert_same_result(jitted(x), fn(x))
    assert _fusions(jitted)


def _clone_of_a_view(x):
    a = x * 2
    return a, a.view(-1).clone(), a.clone()


@pytest.mark.parametrize(
    "fn, x",
    [
        (_clone_of_a_view, torch.randn(4, 8)),
        (lambda x: (x * 1 == 0.1, x * 1 > 0.1), torch.full((4,), 0.1, dtype=torch.float16)),
        (lambda x: ((x * 2).var(-1), F.layer_norm(x * 2, (8,))), torch.randn(3, 8, dtype=torch.bfloat16)),
        (lambda x: torch.add(x * 2, 2, alpha=3) - torch.sub(x, 1.5, alpha=2), torch.randn(5)),
        (lambda x: (x * 2).sum(0) + 1, torch.tensor(3.0)),
        # a softmax over an empty dim is empty (the reference's max over no element raised)
        (lambda x: x.softmax(-1) * 2, torch.randn(1, 0)),
        (lambda x: x.log_softmax(0) + 1, torch.randn(0, 3)),
    ],
    ids=[
        "clone-of-a-view",
        "half-compared-with-a-scalar",
        "bf16-var-and-layer-norm",
        "scalar-alpha",
        "0-d-sum",
        "softmax-over-an-empty-dim",
        "log-softmax-over-an-empty-dim",
    ],
)
def test_nvfuser_edge_cases_match_eager(fn, x):
    jitted = dtcompile.jit(fn, executors=[FusionExecutor("reference", min_ops=1), "torch"])
    with torch.no_grad():
        got, expected = jitted(x), fn(x)
    assert_same_result(got, expected)
    assert _fusions(jitted)
    # Each output has memory of its own, as eager's do.
    storages = [t.untyped_storage().data_ptr() for t in (got if isinstance(got, tuple) else (got,))]
    assert len(set(storages)) == len(storages)


def test_nvfuser_views_of_fused_values_run_after_the_fusion():
    def fn(x):
        y = (x * 2).exp()
        return y, y.t(), y.view(-1)[:3]

    x = torch.randn(4, 5)
    jitted = dtcompile.jit(fn, executors=REFERENCE)
    with torch.no_grad():
        got = jitted(x)
    assert_same_result(got, fn(x))
    # Eager's views share memory with their base; so do the compiled ones.
    base = got[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in got[1:])
    (fusion,) = _fusions(jitted)
    assert len(fusion.output) == 1  # the base only: the views are taken from it afterwards


def test_nvfuser_unsupported_ops_and_single_ops_end_regions():
    def fn(x):
        a = torch.tanh(x * 3)
        b = torch.cumsum(a, 0)  # not translated: ends the region
        return torch.sigmoid(b - 1) * 2, torch.neg(b)

    x = torch.randn(5, 4)
    jitted = dtcompile.jit(fn, executors=REFERENCE)
    with torch.no_grad():
        assert_same_result(jitted(x), fn(x))
    names = [b.symbol.name for b in dtcompile.last_traces(jitted)[-1].bound_symbols]
    assert names == ["fusion0", "aten.cumsum.default", "fusion1"]


def test_nvfuser_min_ops_and_matmuls():
    def one_op(x):
        return x.exp()

    def matmul_epilogue(x, w):
        return torch.relu(x @ w) * 2

    x, w = torch.randn(4, 8), torch.randn(8, 3)
    with torch.no_grad():
        plain = dtcompile.jit(one_op, executors=REFERENCE)
        assert_same_result(plain(x), one_op(x))
        assert not _fusions(plain)  # one op gains nothing from a fusion
        for fuse_matmul, primitives in ((False, set()), (True, {"matmul"})):
            executor = FusionExecutor("reference", fuse_matmul=fuse_matmul)
            jitted = dtcompile.jit(matmul_epilogue, executors=[executor, "torch"])
            assert_same_result(jitted(x, w), matmul_epilogue(x, w))
            (program,) = _fused_programs(jitted)
            assert {op.primitive for op in program.ops} & {"matmul"} == primitives


def test_nvfuser_symbolic_sizes_are_symbolic_dims():
    def fn(x, scale):
        y = F.layer_norm(x, (x.shape[-1],)) * scale
        heads = torch.softmax(y, dim=1).reshape(x.shape[0], x.shape[1], 2, 4) * 2
        return heads, y.mean(1)

    jitted = dtcompile.jit(fn, cache="symbolic values", executors=REFERENCE)
    scale = torch.rand(8)
    with torch.no_grad():
        for seq in range(3, 11):
            x = torch.randn(2, seq, 8)
            assert_same_result(jitted(x, scale), fn(x, scale))
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (1, 7)
    programs = _fused_programs(jitted)
    text = "\n".join(p.text() for p in programs)
    # The layer norm divides by a size read from the tensor at run time; the reshape takes
    # the sizes the trace computed (prims.shape) as number inputs.
    assert "= size(" in text and ": int" in text
    assert re.search(r"reshape\(\w+, \[in\d+, in\d+, 2, 4\]\)", text), text  # no traced size baked in


def test_nvfuser_cache_is_keyed_by_program_and_input_layout():
    def fn(x):
        return torch.tanh(x) * 2 + 1

    with torch.no_grad():
        for x in (torch.randn(4, 6), torch.randn(3, 5)):  # a new shape: the same fusion
            dtcompile.jit(fn, executors=REFERENCE)(x)
        assert (len(CACHE), CACHE.misses, CACHE.hits) == (1, 1, 1)
        dtcompile.jit(fn, executors=REFERENCE)(torch.randn(4, 6).t())  # another stride order
        dtcompile.jit(fn, executors=REFERENCE)(torch.randn(4, 6, dtype=torch.float64))  # another dtype
        dtcompile.jit(fn, executors=REFERENCE)(torch.randn(4, 1))  # a broadcast dim
    assert len(CACHE) == 4
    texts = [text for _, text in CACHE.fusions]
    assert sum("stride_order=(0, 1)" in t for t in texts) == 1
    assert sum("f64[" in t for t in texts) == 1


def test_nvfuser_training_regions_in_forward_and_backward():
    def fn(x, w):
        return (F.gelu(x @ w) * torch.sigmoid(x @ w)).softmax(-1)

    x0, w0, cotangent = torch.randn(5, 8), torch.randn(8, 6), torch.randn(5, 6)
    results = []
    for executors in (None, REFERENCE):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn_ = fn if executors is None else dtcompile.jit(fn, executors=executors)
        out = fn_(x, w)
        out.backward(cotangent)
        results.append((out.detach(), x.grad, w.grad))
        if executors is not None:
            traces = dtcompile.last_traces(fn_)
            executions = [t for t in traces if t.title.startswith("execution")]
            assert len(executions) == 2
            assert all(any(isinstance(b.symbol, FusionRegion) for b in t.bound_symbols) for t in executions)
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected)
        assert got.stride() == expected.stride()


def test_nvfuser_layout_descriptions():
    # Dim orders, outermost first, from strides; None where no dense layout has them.
    assert dense_order((2, 3, 4), (12, 4, 1)) == (0, 1, 2)
    assert dense_order((2, 3, 4), (1, 8, 2)) == (1, 2, 0)
    # Eager's own results, size-1 dims included, have a dense order that gives their strides.
    for x in (torch.randn(4, 1, 5).transpose(0, 2), torch.randn(1, 3, 1, 5).permute(2, 3, 0, 1)):
        for y in (torch.ones_like(x), x * 2, x.exp() + x):
            assert dense_strides(y.shape, dense_order(y.shape, y.stride())) == y.stride()
    assert dense_order((2, 3), (0, 1)) is None  # expanded
    assert dense_order((2, 3), (6, 1)) is None  # sliced
    # nvFuser's stride order: per dim, its rank from the innermost.
    assert stride_order((0, 1, 2)) == (2, 1, 0)
    assert stride_order((1, 2, 0)) == (0, 2, 1)
    # nvFuser's input descriptions: contiguity in memory order (None for broadcast dims,
    # False where memory has a gap) and each dim's rank from the innermost.
    assert tensor_descriptor((2, 3, 4), (12, 4, 1)) == ((True, True, True), (2, 1, 0))
    assert tensor_descriptor((2, 1, 4), (4, 4, 1)) == ((True, None, True), (2, 1, 0))
    assert tensor_descriptor((2, 3), (6, 1)) == ((False, True), (1, 0))
    assert tensor_descriptor((3, 2), (1, 3)) == ((True, True), (0, 1))
    assert tensor_descriptor((5, 1, 4), (1, 5, 5)) == ((None, True, True), (0, 2, 1))
    assert tensor_descriptor((6, 5, 4), (5, 1, 35)) == ((False, True, True), (1, 0, 2))
    assert tensor_descriptor((3, 4), (0, 1)) == ((None, True), (1, 0))  # expanded


def test_nvfuser_unavailable_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: nvFuser may be available here")
    script = """
import sys, torch, dtcompile
fn = lambda x: torch.tanh(x) * 2 + 1
x = torch.randn(3)
for executors in (["nvfuser", "torch"], None):
    jitted = dtcompile.jit(fn, executors=executors)
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), fn(x))
    print(dtcompile.last_traces(jitted)[-1])
print("imported:", "nvfuser_direct" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "executor nvfuser unavailable: no CUDA device" in out
    assert "executors: collectives, nvfuser, torch" in out and "executors: collectives, torch" in out
    assert "fusion0" not in out
    assert out.strip().endswith("imported: False")


# --- on a GPU -------------------------------------------------------------------------------


@pytest.mark.cuda
def test_nvfuser_cuda_default_executor_fuses_with_eagers_strides():
    executor = FusionExecutor("nvfuser_direct")
    if not executor.available:
        pytest.skip(f"nvFuser unavailable: {executor.reason}")

    def fn(x, a, w, scale):
        return (torch.ones_like(x) * 2, (x * 2).exp(), *_norm_mlp(a, w, scale))

    x = torch.randn(4, 7, 5, device="cuda")[:, 1:].permute(1, 2, 0)
    a, w, scale = (torch.randn(6, 16, device="cuda"), torch.randn(16, 8, device="cuda"), torch.rand(16, device="cuda"))
    jitted = dtcompile.jit(fn)  # CUDA inputs: nvFuser by default
    with torch.no_grad():
        got, expected = jitted(x, a, w, scale), fn(x, a, w, scale)
    assert "executors: collectives, nvfuser, torch" in str(dtcompile.last_traces(jitted)[-1])
    assert _fusions(jitted)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.stride() == e.stride()
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


def _attention_scaled_by_its_width(x):
    scores = (x @ x.transpose(-1, -2)) / x.shape[-1] ** 0.5
    return scores.softmax(-1) @ x


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: (x / x.shape[-1]).exp() + 1,  # a size read at run time, in a float division
        _attention_scaled_by_its_width,  # a float made from a size
        lambda x: F.layer_norm(x * 2, x.shape[-1:]) + 1,
    ],
    ids=["divided-by-a-size", "scaled-by-sqrt-of-a-size", "layer-norm"],
)
def test_nvfuser_numbers_from_symbolic_sizes(fn):
    jitted = dtcompile.jit(fn, cache="symbolic values", executors=[FusionExecutor("reference", min_ops=1), "torch"])
    torch.manual_seed(0)
    for n in (3, 5, 8):
        x = torch.randn(2, n, n, requires_grad=True)
        got, expected = jitted(x), fn(x)
        assert_same_result(got, expected)
        got.sum().backward()
        grad, x.grad = x.grad, None
        expected.sum().backward()
        # The fusion's layer-norm backward sums in another order than torch's kernel: its
        # gradients (about 1e-5 where the sum is nearly 0) differ by rounding.
        torch.testing.assert_close(grad, x.grad, atol=1e-4, rtol=1e-4)
    assert dtcompile.cache_misses(jitted) == 1
    assert _fusions(jitted)


def test_nvfuser_number_inputs_say_their_kind():
    def fn(x):
        return x * (x.shape[0] ** 0.5) + x.shape[1]

    jitted = dtcompile.jit(fn, cache="symbolic values", executors=[FusionExecutor("reference", min_ops=1), "torch"])
    x = torch.randn(4, 3)
    assert_same_result(jitted(x), fn(x))
    texts = [key[1] for key in CACHE.fusions]
    assert any(": float" in text for text in texts) and any(": int" in text for text in texts), texts


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.softmax(x.sum() * 2, 0) + 1,
        lambda x: torch.log_softmax(x.sum() * 2, -1).exp() * 3,
        lambda x: (x.sum() * 2).transpose(0, -1) + 1,
        lambda x: (x.sum() * 2).permute([]) - 1,
        lambda x: (x.sum() * 2).sum(0).exp() + (x.sum() * 3).amax(-1),
        lambda x: (x.sum() * 2).mean() + (x.sum() * 2).var(0, correction=0),
    ],
    ids=["softmax", "log-softmax", "transpose", "permute", "sum-and-amax-over-dim", "mean-and-var"],
)
def test_nvfuser_zero_dim_tensors(fn):
    jitted = dtcompile.jit(fn, executors=[FusionExecutor("reference", min_ops=1), "torch"])
    x = torch.randn(3)
    with torch.no_grad():
        assert_same_result(jitted(x), fn(x))


class _Unbuildable:
    """A fusion backend that fails to build every program, as nvFuser may."""

    name = "unbuildable"

    def available(self):
        return True, "always"

    def supports_device(self, device):
        return True

    def compile(self, program):
        raise RuntimeError("cannot build this fusion")


def test_a_fusion_that_fails_to_build_runs_on_torch_with_a_note():
    executor = FusionExecutor("reference", min_ops=1)
    executor.backend = _Unbuildable()

    def fn(x):
        return (x * 2).exp() + 1

    jitted = dtcompile.jit(fn, executors=[executor, "torch"])
    x = torch.randn(4)
    assert_same_result(jitted(x), fn(x))
    execution = str(dtcompile.last_traces(jitted)[-1])
    assert "left unfused: unbuildable could not build it (RuntimeError: cannot build this fusion)" in execution
    assert not _fusions(jitted)


def test_nvfuser_leaves_arithmetic_on_booleans_to_torch():
    """torch keeps ``b + True`` and ``b * b`` bool; nvFuser's frontend computes them as
    integers (its own build, on CPU, disagreed with the program's dtype)."""
    fn = lambda b: ((b + True).logical_not(), b * b, (b * 2).float() + 1)  # noqa: E731
    jitted = dtcompile.jit(fn, executors=[FusionExecutor("reference", min_ops=1), "torch"])
    b = torch.tensor([[True, False], [False, True]])
    with torch.no_grad():
        assert_same_result(jitted(b), fn(b))
    fused = [op.primitive for program in _fused_programs(jitted) for op in program.ops]
    assert fused and "add" in fused  # the integer arithmetic (b * 2 + 1) is fused
    assert all(
        op.dtype is not torch.bool
        for program in _fused_programs(jitted)
        for op in program.ops
        if op.primitive in ("add", "mul")
    )
