"""Single process: symbolic values against eager: one compilation for many sizes, guards,
strides."""

import copy
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import assert_same_result, assert_same_tensor

import dtcompile
from dtcompile.core.symbolic import is_symbolic

SYMBOLIC = "symbolic values"


@pytest.fixture(autouse=True)
def no_grad():
    # Inference; the training tests turn grad mode on themselves.
    with torch.no_grad():
        yield


def _reads(trace, label: str) -> list:
    """The symbols that read the value called ``label``."""
    return [b for b in trace.bound_symbols if any(p.label == label for p in b.input_proxies())]


# ---------------------------------------------------------------------------------------
# One compilation, many sizes, eager's values


def _causal_softmax(x):
    seq = x.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    return (x @ x.transpose(-1, -2)).masked_fill(~mask, float("-inf")).softmax(-1)


def _causal_triu(x):
    seq = x.shape[-2]
    future = torch.triu(torch.ones(seq, seq), diagonal=1).bool()
    return x.matmul(x.transpose(-2, -1)).masked_fill(future, -1e9)


def _attention(q, k, v):
    batch, seq, dim = q.shape
    scores = q @ k.transpose(-2, -1) / dim**0.5  # a SymFloat scale, not math.sqrt: that specializes dim
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (weights @ v).transpose(1, 2).reshape(batch, -1), batch * seq


def _heads(x):
    batch, seq, width = x.shape
    heads = x.view(batch, seq, 2, width // 2).transpose(1, 2)
    return heads.reshape(batch * 2, seq, -1).softmax(-1)


def _shape_arithmetic(x):
    rows = x.shape[0] * x.shape[1]
    return x.reshape(rows, -1) * 2, x.shape[1] * 3 - 1, x.shape[2] // 2, x.numel() / x.shape[0]


def _expand_and_factories(x, y):
    grid = x.unsqueeze(1).expand(x.shape[0], y.shape[0], x.shape[1])
    rows = torch.arange(x.shape[0], dtype=x.dtype)[:, None, None]
    return grid + y[None, :, None] + rows, x.new_zeros(x.shape[0] * 2, x.shape[1]), torch.full((y.shape[0], 2), 3.0)


def _split_chunk_cat(x, y):
    left, right = torch.split(x, [x.shape[1] - 2, 2], dim=1)
    top, bottom = x.chunk(2, dim=0)
    joined = torch.cat([x, y], dim=0).transpose(0, 1)
    return left * 2, right + 1, top.sum(0), bottom.sum(0), joined, torch.stack([x, x], 1).view(x.shape[0] * 2, -1)


def _slices_and_pads(x):
    return x[: x.shape[0] // 2] * 2, x[-3:] + 1, F.pad(x, (1, 2)), x.narrow(0, 1, x.shape[0] - 2).cumsum(0), x.flatten()


def _sizes_returned(x):  # (a comparison of sizes is Python's bool, a guard: another entry per outcome)
    return x.shape, x.size(1), x.shape[1:], torch.Size([x.shape[0], 3]), x.numel(), list(x.shape)


CASES = [
    (_causal_softmax, lambda s: (torch.randn(*s),)),
    (_causal_triu, lambda s: (torch.randn(*s),)),
    (_attention, lambda s: tuple(torch.randn(*s) for _ in range(3))),
    (_heads, lambda s: (torch.randn(s[0], s[1], 2 * s[2]),)),
    (_shape_arithmetic, lambda s: (torch.randn(*s),)),
    (_expand_and_factories, lambda s: (torch.randn(s[0], s[2]), torch.randn(s[1]))),
    (_split_chunk_cat, lambda s: (torch.randn(s[0], s[2]), torch.randn(s[1], s[2]))),
    (_slices_and_pads, lambda s: (torch.randn(s[1] + 2, s[2]),)),  # rows // 2 >= 2, rows > 3
    (_sizes_returned, lambda s: (torch.randn(*s),)),
]
# Distinct sizes >= 2 within each call (equal ones would share a symbol, 1s would be constants).
SHAPES = [(3, 5, 4), (6, 7, 8), (2, 9, 4), (5, 3, 6), (7, 4, 9)]


@pytest.mark.parametrize("fn, make", CASES, ids=[fn.__name__.strip("_") for fn, _ in CASES])
def test_one_compilation_serves_every_size(fn, make):
    torch.manual_seed(0)
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for shape in SHAPES:
        inputs = make(shape)
        assert_same_result(jitted(*inputs), fn(*inputs))
    assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (1, len(SHAPES) - 1)


def test_modules_keep_static_parameter_shapes():
    torch.manual_seed(0)
    module = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).eval()
    jitted = dtcompile.jit(module, cache=SYMBOLIC)
    for batch, seq in ((3, 5), (6, 2), (2, 9)):
        x = torch.randn(batch, seq, 8)
        assert_same_tensor(jitted(x), module(x))
    assert dtcompile.cache_misses(jitted) == 1
    recorded = dtcompile.last_traces(jitted)[0]
    x_proxy, *params = recorded.inputs
    assert [is_symbolic(s) for s in x_proxy.shape] == [True, True, False]  # 8: layer_norm's normalized shape
    assert [tuple(p.shape) for p in params] == [tuple(p.shape) for p in module.parameters()]
    assert not any(is_symbolic(s) for p in params for s in (*p.shape, *p.stride()))
    assert "f32[16, 8]" in str(dtcompile.last_traces(jitted)[-1])
    # The parameters' static metadata is checked in one batch (TensorGuards): a weight with
    # other strides is a new entry.
    assert "TENSOR_GUARDS" in dtcompile.last_prologue(jitted).source
    module[3].weight = nn.Parameter(module[3].weight.detach().t().contiguous().t())
    x = torch.randn(2, 4, 8)
    assert_same_tensor(jitted(x), module(x))
    assert dtcompile.cache_misses(jitted) == 2


@torch.enable_grad()
def test_training_under_symbolic_values_gives_eager_gradients():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
    eager = copy.deepcopy(module)
    jitted = dtcompile.jit(module, cache=SYMBOLIC)
    for batch, seq in ((5, 4), (3, 7), (2, 2), (6, 3)):
        x = torch.randn(batch, seq, 6)
        x_jit, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = jitted(x_jit), eager(x_eager)
        assert_same_tensor(out.detach(), expected.detach())
        cotangent = torch.randn_like(expected)
        out.backward(cotangent)
        expected.backward(cotangent)
        assert_same_tensor(x_jit.grad, x_eager.grad)
        for p, q in zip(module.parameters(), eager.parameters()):
            assert_same_tensor(p.grad, q.grad)
    assert dtcompile.cache_misses(jitted) == 1
    titles = [t.title for t in dtcompile.last_traces(jitted)]
    assert titles.count("forward, with its sizes computed in the trace") == 1
    assert titles.count("backward, with its sizes computed in the trace") == 1


@torch.enable_grad()
def test_training_a_function_of_sizes_gives_eager_gradients():
    def fn(x, w):
        pairs = x.view(x.shape[0], 2, -1) * w
        causal = torch.ones(x.shape[0], x.shape[0]).tril()
        return (causal @ pairs.reshape(-1, x.shape[1]).tanh()).sum(), x.shape

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for rows, cols in ((3, 4), (5, 6), (2, 8), (4, 10)):
        x, w = torch.randn(rows, cols), torch.randn(cols // 2)
        ours = [t.clone().requires_grad_() for t in (x, w)]
        theirs = [t.clone().requires_grad_() for t in (x, w)]
        (loss, shape), (expected, expected_shape) = jitted(*ours), fn(*theirs)
        assert_same_tensor(loss.detach(), expected.detach())
        assert type(shape) is torch.Size and shape == expected_shape
        loss.backward()
        expected.backward()
        for a, b in zip(ours, theirs):
            assert_same_tensor(a.grad, b.grad)
    assert dtcompile.cache_misses(jitted) == 1


# ---------------------------------------------------------------------------------------
# Guards


def _calls(jitted, fn, shapes) -> list[int]:
    """Call with a tensor of each shape, check against eager; the misses after each call."""
    misses = []
    for shape in shapes:
        x = torch.randn(*shape)
        assert_same_result(jitted(x), fn(x))
        misses.append(dtcompile.cache_misses(jitted))
    return misses


def test_a_rank_change_is_a_miss():
    def fn(x):
        return x * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(3, 4), (5, 6), (3, 4, 5), (6, 7, 8), (2, 3)]) == [1, 1, 2, 2, 2]
    assert "v1.dim() != 3" in dtcompile.last_prologue(jitted).source


def test_sizes_0_and_1_are_constants():
    def fn(x):
        return x.sum(0) + 1

    # Traced with a 1: that dim is the constant 1, so any other size is a miss.
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(1, 4), (1, 7)]) == [1, 1]
    assert re.search(r"if size\d+\[0\] != 1: return None", dtcompile.last_prologue(jitted).source)
    assert _calls(jitted, fn, [(3, 4), (5, 7), (1, 9)]) == [2, 2, 2]
    # Traced with sizes >= 2: a call passing 1 (or 0) breaks the symbol's range.
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(3, 4), (1, 4), (0, 4), (5, 6), (1, 6)]) == [1, 2, 3, 3, 3]
    entry = dtcompile.last_prologue(jitted).source
    assert re.search(r"if size\d+\[0\] != 0: return None", entry)


def test_duck_sizing_equal_sizes_share_a_symbol():
    def fn(x):
        return x * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    # Traced with two equal sizes: one symbol, so unequal sizes are another entry.
    assert _calls(jitted, fn, [(4, 4), (6, 6)]) == [1, 1]
    duck = dtcompile.last_prologue(jitted).source
    assert _calls(jitted, fn, [(4, 5), (7, 7), (3, 8)]) == [2, 2, 2]
    general = dtcompile.last_prologue(jitted).source
    assert re.search(r"if size\d+\[1\] != s\d+: return None", duck)
    assert not re.search(r"if size\d+\[1\] != s\d+: return None", general)


def test_a_view_that_splits_a_dim_guards_divisibility():
    def fn(x):
        return x.view(x.shape[0], 2, -1) * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(3, 4), (5, 8), (2, 6), (3, 10)]) == [1, 1, 1, 1]
    prologue = dtcompile.last_prologue(jitted)
    assert re.search(r"% 2\) == 0", prologue.source)  # the ShapeEnv's divisibility guard, checked
    # An odd size is rejected by the prologue; tracing it fails as eager does.
    odd = torch.randn(3, 5)
    assert prologue.fn(None, (odd,), {}) is None
    assert prologue.fn(None, (torch.randn(3, 12),), {}) is not None
    with pytest.raises(RuntimeError):
        fn(odd)
    with pytest.raises(RuntimeError):
        jitted(odd)
    assert dtcompile.cache_misses(jitted) == 1
    # (3, 2) makes the split dim 1, which torch specializes: a new entry, still eager's values.
    assert _calls(jitted, fn, [(3, 2), (5, 2), (4, 12)]) == [2, 2, 2]


def test_a_branch_on_a_size_is_guarded():
    def fn(x):
        return x * 2 if x.shape[0] > 4 else x - 1

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(6, 3), (9, 4), (3, 4), (2, 5), (5, 5), (4, 2)]) == [1, 1, 2, 2, 2, 2]


def test_the_prologue_binds_sizes_and_checks_them():
    def fn(x, y):
        return x.view(x.shape[0], 2, -1) + y

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    x, y = torch.randn(3, 8), torch.randn(1, 4)
    assert_same_tensor(jitted(x, y), fn(x, y))
    prologue = dtcompile.last_prologue(jitted)
    source = prologue.source
    # Each symbol bound once, where it first occurs: x's two sizes and y's second.
    bound = re.findall(r"    (s\d+) = size\d+\[(\d)\]\n", source)
    assert [dim for _, dim in bound] == ["0", "1", "1"]
    assert re.search(r"if size\d+\[0\] != 1: return None", source)  # y's 1: a constant
    assert re.search(r"% 2\) == 0", source)  # x.shape[1] splits in two
    assert re.search(rf"\({bound[1][0]} // 2\) == {bound[2][0]}", source)  # ... into halves as wide as y
    assert re.search(r"if s\d+ < 2: return None", source)  # the symbols' ranges
    assert re.search(rf"if stride\d+\[0\] != {bound[1][0]}: return None", source)  # row-major strides
    for x, y in ((torch.randn(5, 6), torch.randn(1, 3)), (torch.randn(2, 10), torch.randn(1, 5))):
        assert_same_tensor(jitted(x, y), fn(x, y))
    assert dtcompile.cache_misses(jitted) == 1
    # Halves that do not match y: the prologue rejects the call, and tracing it fails as eager does.
    x, y = torch.randn(5, 6), torch.randn(1, 4)
    assert prologue.fn(None, (x, y), {}) is None
    with pytest.raises(RuntimeError):
        fn(x, y)
    with pytest.raises(RuntimeError):
        jitted(x, y)


def test_compiling_adds_no_guard_of_its_own():
    def fn(x):
        return x * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    assert _calls(jitted, fn, [(3, 4), (5, 2), (2, 9)]) == [1, 1, 1]
    source = dtcompile.last_prologue(jitted).source
    assert "%" not in source and "not (" not in source
    assert not re.search(r"size\d+\[\d\] != s", source)  # no equal sizes assumed
    checks = [line for line in source.splitlines() if re.search(r"\bs\d+\b", line) and "return None" in line]
    ranges = rf"s\d+ < 2|s\d+ > {2**53}"  # a symbol stands for sizes 2 to 2**53
    assert checks and all(re.search(rf"if ({ranges}|stride\d+\[0\] != s\d+): return None", c) for c in checks), checks


def test_a_storage_offset_the_program_reads_is_guarded():
    # The input's storage offset is a symbol too (torch gives it one whenever the sizes are
    # symbolic, duck-sized: here the same symbol as y's size, 3); a program that reads it
    # must not serve a call with another offset.
    def fn(x, y):
        return y.new_zeros(x.storage_offset()), x * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for offset in (3, 4, 5):
        x, y = torch.randn(10)[offset:], torch.randn(3)
        assert_same_result(jitted(x, y), fn(x, y))


# ---------------------------------------------------------------------------------------
# Strides


@pytest.mark.parametrize(
    "fn",
    [
        torch.ones_like,
        lambda x: torch.empty_like(x).fill_(1.0) + x,
        lambda x: x.transpose(0, 1),
        lambda x: x.transpose(1, 2) * 2,
        lambda x: x.permute(2, 0, 1).contiguous(),
        lambda x: x.transpose(0, 1).reshape(x.shape[1], -1),
        lambda x: x.mT @ x,
        lambda x: x.new_ones(x.shape[2], x.shape[0]).t(),
    ],
    ids=["ones_like", "empty_like", "transpose", "transpose-mul", "contiguous", "reshape", "mT-matmul", "new_ones-t"],
)
def test_outputs_have_eager_strides(fn):
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for shape in ((3, 4, 5), (5, 6, 7), (2, 3, 4)):
        x = torch.randn(*shape).permute(1, 2, 0)  # not row-major
        assert_same_result(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 1
    # The strides' relations to the sizes are guarded: a row-major input is another entry.
    for shape in ((4, 5, 3), (6, 7, 5)):
        x = torch.randn(*shape)
        assert_same_result(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 2


def test_a_size_only_a_stride_holds_is_computed():
    # A column slice of a wider tensor: its row stride is a symbol of its own, which no
    # tensor's shape holds.
    def fn(x):
        return x.new_zeros(x.stride(0)) + 1, x.stride(), x.t() * 2

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for wide, cols in (((4, 10), 3), ((5, 12), 7), ((3, 9), 2)):
        x = torch.randn(*wide)[:, :cols]
        assert_same_result(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 1


# The user's code turning a symbolic size into text, or hashing it: eager sees the
# number, so the program is guarded on it (a compilation per size, each eager's).
SIZE_AS_TEXT = {
    "str": lambda x: x * len(str(x.shape[0])),
    "f-string": lambda x: x * len(f"{x.shape[0]}"),
    "format spec": lambda x: x * len(f"{x.shape[0]:04d}") * int(f"{x.shape[0]:x}", 16),
    "repr": lambda x: x * len(repr(x.shape[0])),
    "str of the shape": lambda x: x * len(str(x.shape)),
    "dict key": lambda x: x * {6: 1.0, 100: 5.0}.get(x.shape[0], 0.5),
    "hash": lambda x: x * (hash(x.shape[0]) % 3),
}


@pytest.mark.parametrize("case", list(SIZE_AS_TEXT))
def test_a_size_the_code_turns_into_text_or_hashes_is_its_value(case):
    fn = SIZE_AS_TEXT[case]
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for n in (6, 100, 7, 6):
        x = torch.arange(n * 2.0).reshape(n, 2)
        assert_same_tensor(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) == 3  # one per size: the code read its value


def test_sizes_printed_by_library_code_stay_symbolic():
    # torch formats shapes while tracing (error messages, FakeTensor's reprs): one
    # compilation still serves every size.
    jitted = dtcompile.jit(lambda x: torch.cat([x, x]).view(-1, 2) * 2, cache=SYMBOLIC)
    for n in (6, 100, 7):
        x = torch.randn(n, 2)
        assert_same_tensor(jitted(x), torch.cat([x, x]).view(-1, 2) * 2)
    assert dtcompile.cache_misses(jitted) == 1


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.zeros(math.ceil(x.shape[0] / 3)),
        lambda x: torch.zeros(math.floor(x.shape[0] / 3)) + x.shape[0] % 4,
        lambda x: (math.ceil(x.shape[0] / 3), math.trunc(x.shape[0] / 4), int(x.shape[0] * 0.7)),
        lambda x: F.pad(x, (0, math.ceil(x.shape[0] / 4) * 4 - x.shape[0])).view(-1, 4),
        lambda x: x * 2 if math.floor(x.shape[0] / 3) == 3 else x * 3,
    ],
)
def test_math_of_sizes_runs_in_the_program_and_its_guards(fn):
    """``math.ceil``/``floor``/``trunc`` of sizes print as ``math`` calls in the program and
    the prologue, which have ``math`` to call."""
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for n in (9, 10, 16, 2, 3, 11):
        x = torch.randn(n)
        assert_same_result(jitted(x), fn(x))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x * float((x.shape[0] * 1.5) % 2),
        lambda x: x * float((-x.shape[0] * 1.5) % 2),
        lambda x: x * float(x.shape[0] // 2.5),
        lambda x: x * float((x.shape[0] / 3) % 1),
        lambda x: x * float((x.shape[0] * 0.7) // 1.5) if (x.shape[0] * 0.3) % 1 > 0.5 else x,
    ],
)
def test_float_remainders_and_floor_quotients_of_sizes_are_pythons(fn):
    """``%`` and ``//`` of a float computed from a size, specialized by ``float()`` or a
    branch: sympy's ``Mod`` took ``Eq((n * 1.5) % 2, 1.5)`` to be False (the new entry's
    guard refused its own call), and torch's range analysis raised on ``n // 2.5``."""
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for n in (4, 5, 3, 6, 7, 11, 5):
        x = torch.randn(n, 2)
        assert_same_result(jitted(x), fn(x))
    assert dtcompile.cache_misses(jitted) >= 1  # compiled (not run eagerly, torch's error caught)


def _padded_to_four(x):
    n = x.shape[1]
    return F.pad(x, (0, 0, 0, -(-n // 4) * 4 - n))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: (_padded_to_four(x).reshape(-1, 4), _padded_to_four(x).stride()),
        lambda x: _padded_to_four(x).contiguous(),
        lambda x: F.pad(x, (0, 0, -(x.shape[1] % 2), 0)) * 2,  # cropped by 1 at odd lengths, else a clone
        lambda x: F.pad(x.unsqueeze(0), (0, 0, 0, (-x.shape[1]) % 3)).reshape(-1),
    ],
)
def test_pad_by_sizes_that_can_be_zero_keeps_eagers_layout(fn):
    """Where no pad is positive, eager's constant pad is a clone of the (narrowed) input,
    a transposed one stays transposed; torch's meta makes a new row-major tensor for any
    symbolic pad, so an entry traced at one length gave other strides (and a ``view``
    that raised) at a length padded by 0."""
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for n in (7, 4, 8, 5, 12, 3):
        x = torch.randn(n, 2, 4).transpose(0, 1)
        assert_same_result(jitted(x), fn(x))


def test_sizes_beyond_exact_floats_are_constants():
    """torch simplifies ``int(n / 3)`` to ``n // 3``, exact only below 2**53: a larger
    size is traced as a constant, and a symbol stands for sizes up to 2**53 only."""

    def fn(x):
        return x.shape[0] / 3, int(x.shape[0] / 3), x.shape[0] // 3

    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for n in (10, 2**53 + 1, 2**60 + 3, 11):
        x = torch.ones(1).expand(n)
        assert jitted(x) == fn(x)


def test_a_size_of_zero_after_an_entry_whose_guards_divide_by_a_size():
    """The entry traced at length 5 checked ``(s * 4) % (2 * s) == 0`` before its range
    ``s >= 2``: a call at length 0 raised ZeroDivisionError from the prologue."""

    def fn(x):
        if x.shape[0] == 0:
            return x.clone()
        return x.view(x.shape[0], -1, 2).sum(-1)

    jitted = dtcompile.jit(fn, cache="symbolic values")
    for n in (5, 0, 7, 0):
        x = torch.randn(n, 4)
        got, expected = jitted(x), fn(x)
        assert got.shape == expected.shape and torch.equal(got, expected)


def _heads_merged(a, w):
    """What an attention does with SDPA's output for one decode token: heads moved next to
    the features, merged, then its output projection (no bias: a bias takes ``addmm``)."""
    return F.linear(a.transpose(1, 2).reshape(a.shape[0], 1, -1), w)


@pytest.mark.parametrize("grad", [False, True])
def test_a_size_one_dims_stride_is_eagers_inside_the_program(grad):
    """A reshape's dim of size 1 gets eager's stride (the next dim's stride times its
    size), not the source's: ``matmul`` folds a ``[b, 1, k]`` input into one ``mm`` only
    then, and ran a ``bmm`` under symbolic values, rounding otherwise."""
    torch.manual_seed(0)
    jitted = dtcompile.jit(_heads_merged, cache=SYMBOLIC)
    w = torch.randn(24, 32, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        for batch in (2, 3, 5, 2):  # (2: as many as the heads, which then share a symbol)
            a = torch.randn(batch, 2, 1, 16, requires_grad=grad)
            inputs = [(a, w), (a.detach().clone().requires_grad_(grad), w.detach().clone().requires_grad_(grad))]
            got, expected = jitted(*inputs[0]), _heads_merged(*inputs[1])
            assert_same_tensor(got, expected)
            assert "bmm" not in str(dtcompile.last_traces(jitted)[-1])
            if grad:
                grads = [
                    torch.autograd.grad(out.pow(2).sum(), xs) for out, xs in ((got, inputs[0]), (expected, inputs[1]))
                ]
                for g, e in zip(*grads):
                    assert_same_tensor(g, e)
    assert dtcompile.cache_misses(jitted) == 2  # (a batch of 2, then of another size than the heads)


_FLAGS_FROM_SIZES = {
    "keepdim": lambda x: x.sum(1, keepdim=x.shape[1] > 4),
    "unbiased": lambda x: x.std(1, unbiased=x.shape[1] > 1),
    "descending": lambda x: torch.sort(x, 1, descending=x.shape[1] % 2 == 0).values,
    "is_causal": lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=x.shape[1] > 1),
    "flags combined": lambda x: x * ((x.shape[1] > 4) ^ (x.shape[1] > 8)),
    "isinstance": lambda x: x * 2 if isinstance(x.shape[1] > 4, bool) else x,
}


@pytest.mark.parametrize("name", list(_FLAGS_FROM_SIZES))
def test_a_comparison_of_sizes_is_a_bool_torch_takes_as_a_flag(name):
    # A SymBool: torch's argument parsing refused it (a raw TypeError, raised on every rank;
    # in one process the call ran eagerly, traced again at every call).
    fn = _FLAGS_FROM_SIZES[name]
    jitted = dtcompile.jit(fn, cache=SYMBOLIC)
    for n in (6, 7, 9, 3, 6):
        x = torch.randn(2, n, 8)
        assert_same_result(jitted(x), fn(x))
    assert dtcompile.cache_hits(jitted) >= 1
