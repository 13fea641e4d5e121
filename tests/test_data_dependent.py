"""Values read from tensor data (issue 14): numbers read with ``.item()`` / ``.tolist()``
and ops whose sizes come from the data are computed by the program at run time, one
compilation for every value, under both cache options; forward and with gradients,
against eager (values, shapes and strides)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dtcompile
from dtcompile.testing.compare import assert_same

CACHES = ["constant values", "symbolic values"]


def _split_in_two(generator):
    first = int(torch.randint(0, 7, (), generator=generator))
    return torch.tensor([first, 6 - first])


# name -> (function, arguments from a generator); each call draws new data.
CASES = {
    "narrow at a tensor start": (
        lambda x, s: x.narrow(0, s, 2),
        lambda g: (torch.randn(6, 3, generator=g), torch.randint(0, 5, (), generator=g)),
    ),
    "narrow at an item": (
        lambda x, s: x.narrow(0, s.item(), 2) * 2,
        lambda g: (torch.randn(6, 3, generator=g), torch.randint(0, 5, (), generator=g)),
    ),
    "tensor_split at tensor indices": (
        lambda x, i: torch.tensor_split(x, i),
        lambda g: (torch.randn(7, 2, generator=g), torch.randint(0, 7, (2,), generator=g).sort().values),
    ),
    "split by tolist": (
        lambda x, c: [p * (i + 2) for i, p in enumerate(x.split(c.tolist()))],
        lambda g: (torch.randn(6, 2, generator=g), _split_in_two(g)),
    ),
    "boolean mask": (lambda x: x[x > 0] * 2, lambda g: (torch.randn(5, 3, generator=g),)),
    "masked_select": (lambda x: torch.masked_select(x, x > 0).sum(0), lambda g: (torch.randn(5, 3, generator=g),)),
    "nonzero": (lambda x: torch.nonzero(x > 0) + 1, lambda g: (torch.randn(5, 3, generator=g),)),
    "repeat_interleave by a tensor": (
        lambda x, r: torch.repeat_interleave(x, r, dim=0),
        lambda g: (torch.randn(3, 2, generator=g), torch.randint(0, 3, (3,), generator=g)),
    ),
    "scaled by an item": (lambda x: x * x.abs().max().item(), lambda g: (torch.randn(4, generator=g),)),
    "sized by an item": (
        lambda x, c: torch.zeros(c.sum().item(), 2) + x.sum(),
        lambda g: (torch.randn(4, generator=g), torch.randint(0, 3, (3,), generator=g)),
    ),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", list(CASES))
def test_values_read_from_data_compile_once(name, cache):
    fn, make = CASES[name]
    jitted = dtcompile.jit(fn, cache=cache)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        args = make(generator)
        assert_same(jitted(*args), fn(*args), name)
    assert dtcompile.cache_misses(jitted) == 1


# name -> (function of a differentiable x and data c, arguments from a generator)
GRADIENT_CASES = {
    "split by tolist": (
        lambda x, c: [p * (i + 2) for i, p in enumerate(x.split(c.tolist()))],
        lambda g: (torch.randn(6, 2, generator=g), _split_in_two(g)),
    ),
    "scaled by an item": (
        lambda x, c: x * x.detach().abs().max().item(),
        lambda g: (torch.randn(4, generator=g), None),
    ),
    "boolean mask": (lambda x, c: x[x.detach() > 0] * 3, lambda g: (torch.randn(5, 3, generator=g), None)),
    "repeat_interleave by a tensor": (
        lambda x, c: torch.repeat_interleave(x, c, dim=0),
        lambda g: (torch.randn(3, 2, generator=g), torch.randint(0, 3, (3,), generator=g)),
    ),
}


def _backward(out) -> None:
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    torch.autograd.backward(outs, [torch.full_like(o, 0.5) for o in outs])


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_values_read_from_data_with_gradients(name, cache):
    """The backward reads the numbers the forward read (saved as numbers) or sizes its
    saved tensors hold."""
    fn, make = GRADIENT_CASES[name]
    jitted = dtcompile.jit(fn, cache=cache)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, c = make(generator)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = fn(xe, c), jitted(xc, c)
        assert_same(got, expected, name)
        _backward(expected)
        _backward(got)
        assert_same(xc.grad, xe.grad, f"{name}, gradient")
    assert dtcompile.cache_misses(jitted) == 1


def test_a_number_read_from_data_prints_as_such():
    jitted = dtcompile.jit(lambda x, c: x.split(c.tolist()))
    jitted(torch.randn(6, 2), torch.tensor([2, 4]))
    computation, execution = dtcompile.last_traces(jitted)[0], str(dtcompile.last_traces(jitted)[-1])
    numbers = [b.output for b in computation.bound_symbols if isinstance(b.output, dtcompile.core.NumberProxy)]
    assert [str(n.provenance) for n in numbers] == [
        "read from tensor data (by aten._local_scalar_dense.default; no value while tracing)"
    ] * 2
    assert execution.count("read from data at run time") == 2
    assert f".split_with_sizes([{numbers[0].label}, {numbers[1].label}])" in execution


# Branches on data (item 3): the branch taken is traced and checked at run time; a call
# that takes another branch goes to another entry, or is traced again.
BRANCHES = {
    "all": lambda x: x * 2 if (x > 0).all() else x - 1,
    "item compared": lambda x: x * 2 if x.sum().item() > 0 else x - 1,
    "two branches": lambda x: (x.exp() if x.max() > 1 else x.sin()) + (1 if x.min() < -1 else 2),
    "after other ops": lambda x: torch.relu(x * 3).sum(0) if x.mean() > 0 else torch.tanh(x).sum(0),
    # A size read from data (the count a mask selects) in what the branch reads: computed
    # now from the real inputs too.
    "after a size from data": lambda x: (lambda y: y * 2 if (y > 0.5).any() else y - 1)(x - x[x > 0].shape[0] / 12),
    "a number after a size from data": lambda x: (lambda y: y * int((y > 0).sum()))(x + torch.nonzero(x > 0).shape[0]),
    # On a size read from data itself (a mask's count, a nonzero's), as MoE code skips an
    # expert that gets no token.
    "on a mask's count": lambda x: (lambda y: y.sum() * 2 if y.numel() > 0 else x.sum() - 1)(x[x > 0]),
    "on a nonzero's count": lambda x: (lambda i: x.index_select(0, i) * 2 if i.shape[0] == x.shape[0] else x - 1)(
        torch.nonzero(x.sum(1) > 0).flatten()
    ),
}


def _signed(generator, sign: float, shape=(3, 4)):
    return sign * (torch.rand(shape, generator=generator) * 2 + 0.1)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", list(BRANCHES))
def test_branches_on_data_give_eagers_result_in_any_order(name, cache):
    fn = BRANCHES[name]
    jitted = dtcompile.jit(fn, cache=cache)
    generator = torch.Generator().manual_seed(2)
    signs = [1, -1, -1, 1, -1, 1]
    for sign in signs:
        x = _signed(generator, sign)
        assert_same(jitted(x), fn(x), f"{name}, sign {sign}")
    # Each branch compiled once, and each call after that served by one entry.
    assert dtcompile.cache_misses(jitted) <= 4 and dtcompile.cache_hits(jitted) == len(signs) - dtcompile.cache_misses(
        jitted
    )


def test_a_failed_branch_check_leaves_nothing_done():
    """The check runs before anything else: the buffer changes once per call, whichever
    branch each call takes."""

    def fn(x, buffer):
        if x.sum() > 0:
            buffer.add_(1)
        else:
            buffer.sub_(10)
        return x * 2

    jitted = dtcompile.jit(fn)
    expected, got = torch.zeros(2), torch.zeros(2)
    generator = torch.Generator().manual_seed(3)
    for sign in (1, -1, 1, -1, -1):
        x = _signed(generator, sign)
        assert_same(jitted(x, got), fn(x, expected))
        assert torch.equal(got, expected)
    assert dtcompile.cache_misses(jitted) == 2


def test_the_check_prints_in_the_program():
    jitted = dtcompile.jit(BRANCHES["all"])
    jitted(torch.ones(3))
    execution = str(dtcompile.last_traces(jitted)[-1])
    assert "raise DataCheckFailed('traced with" in execution
    body = execution.split("def computation")[1].splitlines()
    check = next(i for i, line in enumerate(body) if "DataCheckFailed" in line)
    assert not any("torch.mul" in line for line in body[:check])  # the check comes first


@pytest.mark.parametrize("cache", CACHES)
def test_branches_on_data_with_gradients(cache):
    def fn(x):
        return x * 2 if x.detach().sum() > 0 else x.sin()

    jitted = dtcompile.jit(fn, cache=cache)
    generator = torch.Generator().manual_seed(4)
    for sign in (1, -1, 1, -1):
        x = _signed(generator, sign)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = fn(xe), jitted(xc)
        assert_same(got, expected)
        _backward(expected)
        _backward(got)
        assert_same(xc.grad, xe.grad)
    assert dtcompile.cache_misses(jitted) == 2


def _add_then_branch(x):
    x.add_(1)
    return x * 2 if x.sum() > 0 else x


@pytest.mark.parametrize(
    "fn, why",
    [
        (_add_then_branch, "an in-place op before the branch"),
        (lambda x: x * 2 if torch.rand(()) > 0.5 else x, "a random op in what the branch reads"),
    ],
)
def test_branches_that_cannot_be_checked_are_refused(fn, why):
    with pytest.raises(dtcompile.TracingError, match="depends on the values in a tensor"):
        dtcompile.jit(fn)(torch.ones(3))


class _CountsThenBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1  # written before the branch, though the branch does not read it
        return x * 2 if x.sum() > 0 else x - 1


class _WritesAMadeTensorThenBranches(torch.nn.Module):
    def forward(self, x, mask):
        y = x.clone()
        y.add_(1)  # (memory made inside the call: no input's, which the branch reads)
        return y * 2 if mask.all() else y - 1


@pytest.mark.parametrize("cache", CACHES)
def test_a_branch_after_an_in_place_write_of_what_it_does_not_read_is_checked_at_run_time(cache):
    """The branch's value is computed at the program's start, before the write: it reads
    nothing the write touches (a Hugging Face TP model's mask check, after its embedding's)."""
    module = _WritesAMadeTensorThenBranches()
    jitted = dtcompile.jit(module, cache=cache)
    x = torch.randn(3)
    for mask in ([True] * 3, [True, False, True], [True] * 3, [False] * 3):
        mask = torch.tensor(mask)
        assert torch.equal(jitted(x, mask), module(x, mask))
    assert dtcompile.cache_misses(jitted) == 2


@pytest.mark.parametrize("cache", CACHES)
def test_a_branch_refused_after_an_in_place_write_of_an_input_names_the_write(cache):
    """A write of an input's memory (a step counter's) bars a branch reading another input:
    inputs may share memory the trace did not see (``m(m.calls)``)."""
    with pytest.raises(dtcompile.TracingError, match=r"after an in-place write \(Tensor.add_\(calls\)"):
        dtcompile.jit(_CountsThenBranches(), cache=cache)(torch.ones(3))

    def aliased_later(x, xv):  # traced apart, called with ``a, a.view(2, 2)``: eager reads the write
        x.add_(1)
        return xv * 2 if xv.sum() > 0 else xv * 3

    with pytest.raises(dtcompile.TracingError, match=r"after an in-place write \(Tensor.add_\(x\)"):
        dtcompile.jit(aliased_later, cache=cache)(-torch.ones(4), -torch.ones(2, 2))


class _WritesWhatItBranchesOn(torch.nn.Module):
    def forward(self, x, mask):
        kept = mask.clone()
        kept.view(-1)[0] = False  # (through a view of what the branch reads)
        return x * 2 if kept.any() else x - 1


@pytest.mark.parametrize("cache", CACHES)
def test_a_branch_on_memory_the_call_made_and_wrote_runs_as_eager(cache):
    """The write (through a view of a clone) is of memory the branch's own ops make: it
    moves with them to the program's start, and the branch is checked at each call."""
    jitted = dtcompile.jit(_WritesWhatItBranchesOn(), cache=cache)
    for mask in ([True, True, False], [True, False, False], [False, True, True], [True, False, False]):
        x, mask = torch.arange(3.0), torch.tensor(mask)
        assert torch.equal(jitted(x, mask), _WritesWhatItBranchesOn()(x, mask))


def _reads_before_a_write(x):
    y = x * 2
    z = y + 1  # reads y before the write: the write cannot move before it
    y.add_(1)
    return z if y.sum() > 0 else -z


@pytest.mark.parametrize("cache", CACHES)
def test_a_branch_refused_after_an_in_place_write_of_what_it_reads_names_the_write(cache):
    # The message blamed Python control flow on data in general, which compiles elsewhere.
    with pytest.raises(dtcompile.TracingError, match=r"after an in-place write \(Tensor.add_\(t"):
        dtcompile.jit(_reads_before_a_write, cache=cache)(torch.ones(3))
    with pytest.raises(dtcompile.TracingError, match=r"after an in-place write \(Tensor.logical_not_\(mask\)"):
        dtcompile.jit(lambda x, mask: x * 2 if mask.logical_not_().all() else x)(torch.ones(3), torch.ones(3) > 0)


class _SetsWhatAMaskSelects(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        keep = x.sum(-1) > 0
        y = x.clone()
        y[keep] = self.lin(x[keep])  # each layer selects its own count of rows
        return y


@pytest.mark.parametrize("cache", CACHES)
def test_repeated_blocks_with_sizes_from_data_with_gradients(cache):
    """Each layer's sizes read from data are its own: an op whose output has one is
    recorded again for a later layer, never given the first layer's (its backward then
    wrote one layer's rows into another's count)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_SetsWhatAMaskSelects() for _ in range(4)])
    reference = copy.deepcopy(model)
    jitted = dtcompile.jit(model, cache=cache)
    for seed in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = reference(xe), jitted(xc)
        assert_same(got, expected)
        _backward(expected)
        _backward(got)
        assert_same(xc.grad, xe.grad)
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad)


class _SelectsRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.lin(x[mask])  # as many rows as the mask selects


class _SizesEachLayersRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_SelectsRows() for _ in range(4))

    def forward(self, x):
        outs = []
        for i, layer in enumerate(self.layers):
            y = layer(x, x[:, i] > 0)
            outs.append(y.new_zeros(y.shape[0], 1) + y.sum(-1, keepdim=True))  # sized by this layer's count
        return torch.cat(outs)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("grad", [False, True])
def test_repeated_blocks_whose_outputs_are_sized_by_data(cache, grad):
    """A block whose output's size comes from data is not called again for a later block
    (that took the first block's count for every layer's: a size mismatch at run time)."""
    torch.manual_seed(0)
    model = _SizesEachLayersRows()
    jitted = dtcompile.jit(model, cache=cache)
    for seed in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
        with torch.set_grad_enabled(grad):
            assert_same(jitted(x), model(x))


@pytest.mark.parametrize("name", ["all", "on a mask's count", "on a nonzero's count"])
def test_branches_on_data_under_check_eager(name):
    """``check="eager"`` passes by an entry whose check of a branch fails, as a plain call
    does (its DataCheckFailed reached the caller)."""
    fn = BRANCHES[name]
    jitted = dtcompile.jit(fn, check="eager")
    generator = torch.Generator().manual_seed(5)
    for sign in (1, -1, 1, -1):
        x = _signed(generator, sign)
        assert_same(jitted(x), fn(x), f"{name}, sign {sign}")
    assert dtcompile.cache_misses(jitted) == 2


_ELEMENTS_READ = {
    "int of each unique value": lambda ids: [int(e) for e in torch.unique(ids)],
    "float of each masked value": lambda ids: [float(v) for v in ids[ids > 2].float()],
    "a sum of each nonzero index": lambda ids: sum(int(i) for i in torch.nonzero(ids > 2).flatten()),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("case", list(_ELEMENTS_READ))
def test_each_element_of_a_tensor_sized_by_data_read_as_a_number(case, cache):
    """The program checked the count it was traced with only after reading the elements
    (an ``unbind`` into that many): another count raised ValueError inside the program
    instead of tracing the call again."""
    fn = _ELEMENTS_READ[case]
    jitted = dtcompile.jit(fn, cache=cache)
    for ids in ([0, 3, 4, 5], [5, 5, 5, 5], [1, 2, 3, 9, 4, 7], [0, 0, 0, 0], [0, 3, 4, 5]):
        ids = torch.tensor(ids)
        assert jitted(ids) == fn(ids)


def _divmod_of_data(x, t):
    q, r = divmod(t.item(), 3)
    fq, fr = divmod(t.float().item() / 2, 1.5)
    return x[:q] * r + fq - fr


def _divmod_of_a_size(x):
    q, r = divmod(x.shape[0], 3)
    return x[:q] * r, divmod(7, x.shape[0] // 2)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_divmod_of_a_number_read_from_data_or_a_size(cache):
    """torch's SymInt and SymFloat have no ``__divmod__``: a TypeError while tracing."""
    jitted, sized = dtcompile.jit(_divmod_of_data, cache=cache), dtcompile.jit(_divmod_of_a_size, cache=cache)
    for n, k in ((10, 7), (12, 8), (9, 2)):
        x = torch.arange(float(n))
        assert_same(jitted(x, torch.tensor(k)), _divmod_of_data(x, torch.tensor(k)))
        assert_same(sized(x), _divmod_of_a_size(x))


@torch.enable_grad()
def test_a_slice_by_a_number_read_from_data_with_gradients_as_eager():
    """The backward needs the slice's size (once refused: no tensor of the trace held it);
    the program now reads it from the slice, for the checks torch deferred on it."""

    def sliced(x, t):
        return x[: t.item()].sum()

    jitted = dtcompile.jit(sliced)
    for k in (3, 5, 0, 7, -2):
        x = torch.randn(6, requires_grad=True)
        eager_x = x.detach().clone().requires_grad_()
        jitted(x, torch.tensor(k)).backward()
        sliced(eager_x, torch.tensor(k)).backward()
        assert torch.equal(x.grad, eager_x.grad), k
    x = torch.randn(6, requires_grad=True)
    dtcompile.jit(lambda x, t: x.narrow(0, 0, t.item()).sum())(x, torch.tensor(3)).backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 1, 1, 0, 0, 0]))


@pytest.mark.parametrize("cache", CACHES)
def test_bool_of_a_tensor_of_several_elements_raises_eagers_error(cache):
    # Under symbolic values torch's "Cannot call numel() on tensor with symbolic sizes".
    def fn(x):
        return x + 1 if x > 0 else x - 1

    with pytest.raises(RuntimeError, match="Boolean value of Tensor with more than one value is ambiguous"):
        dtcompile.jit(fn, cache=cache)(torch.randn(4, 3))


_BOOLS_READ = {  # the function, and the bools it reads
    "returned": (lambda x: (x * 2, (x.sum() > 0).item()), lambda x: (x.sum() > 0).item()),
    "a factor": (lambda x: x * (x.sum() > 0).item(), lambda x: (x.sum() > 0).item()),
    "any, returned": (lambda x: (x.exp(), (x > 1).any().item()), lambda x: (x > 1).any().item()),
    "tolist of a mask": (lambda x: ((x * 3).sum(), (x[0] > 0).tolist()), lambda x: tuple((x[0] > 0).tolist())),
}


def _first(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("case", list(_BOOLS_READ))
def test_a_bool_read_from_data_in_a_call_with_gradients(case, cache):
    # A bool read is Eq(u0, 1): dead-code elimination and the forward's saved numbers looked
    # it up by its expression where they knew symbols, and the call raised that u0 was held
    # by no tensor. A bool read is Python's bool, as eager's (its value checked at run
    # time): a compilation for each value read.
    fn, read = _BOOLS_READ[case]
    jf = dtcompile.jit(fn, cache=cache)
    values = set()
    for seed in [0, 1, 2, 0, 1]:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        values.add(read(x))
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = fn(xe), jf(xc)
        assert_same(_first(got).detach(), _first(expected).detach())
        if isinstance(expected, tuple):
            assert got[1] == expected[1] and type(got[1]) is type(expected[1])
        _first(expected).sum().backward()
        _first(got).sum().backward()
        assert_same(xc.grad, xe.grad)
    assert dtcompile.cache_misses(jf) == len(values)


@pytest.mark.parametrize("cache", CACHES)
def test_a_bool_read_from_data_is_pythons_bool(cache):
    # ``flag is True`` (as linters write ``== True``), ``isinstance``: a SymBool is neither
    # the True singleton nor a bool, and the traced code took the other branch, silently.
    def fn(x):
        flag = (x > 0).all().item()
        first = (x[0] > 0).tolist()
        if flag is True and isinstance(first, bool) and type(first) is bool:
            return x + 1
        return x - 1 if first is False else x * 3

    jf = dtcompile.jit(fn, cache=cache)
    for x in [torch.ones(3), -torch.ones(3), torch.tensor([1.0, -1.0, 2.0]), torch.ones(3), -torch.ones(3)]:
        assert torch.equal(jf(x), fn(x))


def _bool_read_as_numbers(x):
    return x * float((x.sum() > 0).item()) + int((x.mean() < 0).item())


@pytest.mark.parametrize("cache", CACHES)
def test_float_and_int_of_a_bool_read_from_data_branch_on_it(cache):
    # float() of the read raised a TypeError while tracing: every call ran eagerly, warning,
    # and traced again. It is a branch on the value now: one entry per value.
    jf = dtcompile.jit(_bool_read_as_numbers, cache=cache)
    for seed in range(6):
        x = torch.randn(3, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert_same(jf(x), _bool_read_as_numbers(x))
    assert dtcompile.cache_misses(jf) == 2


def _bool_in_arithmetic(x):
    b = (x > 0).any().item()
    flipped = b ^ True
    return x * (-b + abs(b) + b / 2 + b**2 + (b // 1) + (b % 2) + round(b) + max(b, 0) + (b < 1)), flipped


@pytest.mark.parametrize("cache", CACHES)
def test_a_bool_read_from_data_in_python_arithmetic(cache):
    # A SymBool lacks int's operators a Python bool has: a TypeError while tracing.
    jf = dtcompile.jit(_bool_in_arithmetic, cache=cache)
    for sign in (1.0, -1.0):
        x = torch.full((3,), sign)
        with torch.no_grad():
            (got, flipped), (expected, eager_flipped) = jf(x), _bool_in_arithmetic(x)
        assert_same(got, expected)
        assert flipped is eager_flipped  # (a bool, as Python's)
    assert dtcompile.cache_misses(jf) == 2  # (compiled, one entry per value: not run eagerly)


def _branch_on_first_element(x):
    return x * 2 if x[0, 0] else x * 3


def test_bool_of_one_element_at_a_symbolic_offset_reads_its_value():
    # The element of a row-sliced input sits at a storage offset a symbol gives: torch's
    # C++ bool() asked its element count and failed, which dtcompile took for a tensor of
    # several elements ("more than one value is ambiguous").
    jitted = dtcompile.jit(_branch_on_first_element, cache="symbolic values")
    for rows, first in ((5, 0.0), (6, 1.0), (7, 0.0)):
        x = torch.randn(rows, 4)
        x[1, 0] = first
        assert_same(jitted(x[1:]), _branch_on_first_element(x[1:]))


def _item_around_a_write(s):
    t = s.clone()
    a = t.item()
    t.mul_(3)
    return a, t.item(), torch.full((2,), t.item())


def _tolist_around_a_view_write(s):
    t = s.clone()
    a = t.tolist()
    t[1:] = 0
    return a, t.tolist()


def _counter_loop(s):
    total = 0.0
    for _ in range(3):
        total += s.item()
        s.add_(1)
    return total


def _nonzero_around_a_write(x):
    t = x.clone()
    a = t.nonzero()
    t.T[1:].zero_()  # (through a view)
    return a.shape[0], torch.zeros(t.nonzero().shape[0])


def _unique_around_a_write(x):
    a = torch.unique(x)
    x[0] = x[1]
    return a.shape[0], torch.unique(x).shape[0]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn, make",
    [
        (_item_around_a_write, lambda v: torch.tensor(v)),
        (_tolist_around_a_view_write, lambda v: torch.tensor([v, v + 1, v + 2])),
        (_counter_loop, lambda v: torch.tensor(v)),
        (_nonzero_around_a_write, lambda v: torch.arange(v, v + 9).reshape(3, 3)),
        (_unique_around_a_write, lambda v: torch.arange(v, v + 9)),
    ],
)
def test_a_number_read_from_data_is_read_again_after_a_write(fn, make, cache):
    # torch's fake tensors keep the number .item(), nonzero() or unique() read, until their
    # version changes, which a write recorded below autograd did not change: the second read
    # gave the first's number (eager 6.0, compiled 2.0; a count of 9 where eager's is 0).
    jitted = dtcompile.jit(fn, cache=cache)
    for value in (2.0, 5.0):
        assert_same(jitted(make(value)), fn(make(value)))


def _masked_rows_set(x, v, mask):
    y = x * 1
    y[[False, True, False, False], :, mask] = v
    return y.sum()


def test_a_gradient_sized_by_a_mask_count_is_refused_clearly():
    # v's gradient is sized by the mask's count (u1), which autograd compares with v's 5:
    # autograd's raw "IndexPutBackward0 returned an invalid gradient" came out while compiling.
    mask = torch.tensor([True] * 5 + [False])
    args = lambda: (torch.randn(4, 5, 6, requires_grad=True), torch.randn(5, 5, requires_grad=True), mask)  # noqa: E731
    _masked_rows_set(*args()).backward()  # eager runs
    with pytest.raises(dtcompile.TracingError, match="a gradient sized by a number read from data"):
        dtcompile.jit(_masked_rows_set)(*args())


def test_a_refused_branch_names_the_write_that_bars_it():
    """Not the call's first in-place write (of memory made in the call, which no branch reads)."""

    def fn(x):
        scratch = torch.zeros(3)
        scratch.fill_(7.0)
        y = x * 1
        w = y * 2  # (read before the write: the write cannot move with the branch's ops)
        y.neg_()
        return w + 1 if y.sum() > 0 else w - 1

    with pytest.raises(dtcompile.TracingError, match=r"after an in-place write \(Tensor.neg_\("):
        dtcompile.jit(fn)(torch.ones(3))


class _ClipsBig(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g.clamp(-1, 1) if g.abs().max() > 1 else g


@pytest.mark.parametrize("where", ["custom backward", "tensor hook"])
def test_a_branch_on_gradient_data_is_refused_naming_the_backward(where):
    """The message blamed collectives and random ops: a branch in the backward reads the
    gradients, whose values tracing does not have."""

    def fn(x, w):
        if where == "custom backward":
            return _ClipsBig.apply(x) * w
        y = x * 1
        y.register_hook(lambda g: g * 0 if g.isnan().any() else g)
        return y * w

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(dtcompile.TracingError, match="branch on tensor data in the backward"):
        dtcompile.jit(fn)(x, torch.tensor([5.0, 0.2])).sum().backward()


def _composites_writing_their_own_results(a, b):
    close = a * 2 if torch.isclose(a, b).all() else a - 1  # (``bitwise_or_`` of its fresh result)
    mean = close * 3 if a.nanmean() > 0 else close
    return mean / 2 if F.cross_entropy(a, b.argmax(1), label_smoothing=0.1) > 1 else mean


def _writes_a_clone_after_the_branch_reads_it(x):
    y = x.clone()
    y.clamp_(min=0)
    x.mul_(2)  # (after the clone, the only read of x the branch needs: the branch moves before it)
    return (y, x) if y.sum() > 1 else (-y, x)


def _median_branched_on(a, b):
    return a + 1 if a.quantile(0.5) > 0 else b  # (``ceil_`` and ``lerp_`` of its own)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    "fn", [_composites_writing_their_own_results, _median_branched_on, _writes_a_clone_after_the_branch_reads_it]
)
def test_a_branch_after_writes_that_do_not_change_what_it_reads_runs_as_eager(fn, cache):
    """``isclose``, ``quantile``, ``nanmean`` and ``cross_entropy(label_smoothing=...)``
    write their own fresh tensors in place, and a write after the branch's last read of
    what it writes changes nothing the branch reads: they were refused as writes before a
    branch on data."""
    jitted = dtcompile.jit(fn, cache=cache)
    if fn is _median_branched_on and torch.__version__ < "2.11":  # (README: torch 2.10's quantile reads q)
        with pytest.raises(dtcompile.TracingError, match="quantile"):
            jitted(torch.randn(4, 3), torch.randn(4, 3))
        return
    for seed in range(4):
        torch.manual_seed(seed)
        a = torch.randn(4, 3)
        args = (a,) if fn is _writes_a_clone_after_the_branch_reads_it else (a, a.clone() if seed % 2 else a + 1)
        eager_args = tuple(t.clone() for t in args)
        assert_same(jitted(*args), fn(*eager_args))
        assert all(torch.equal(t, e) for t, e in zip(args, eager_args))


def _compared(a, b):
    same = a * 2 if torch.equal(a, b) else a - 1
    close = same + 1 if torch.allclose(a, b, atol=0.5) else same
    return close, a.equal(b[:2]), a.allclose(b, equal_nan=True), torch.equal(a, b.double())


@pytest.mark.parametrize("cache", CACHES)
def test_equal_and_allclose_are_read_from_data_as_eager(cache):
    """Their Python bools come from the data: refused (fake tensors cannot give them) until
    they became ops read as a number, a branch checked at each call."""
    jitted = dtcompile.jit(_compared, cache=cache)
    for change in (0.0, 1.0, 0.1, float("nan"), 0.0):
        a = torch.arange(4.0)
        b = a.clone()
        b[1] += change
        assert_same(jitted(a, b), _compared(a, b))


def _bool_of_a_selection_after_a_write(x):
    x.add_(1)  # (the selection's rows cannot be computed while tracing)
    a = x[x[:, 0] > 2.5]
    return x * 2 if a[:, 0] > 2 else x


def test_bool_of_a_selection_tracing_cannot_size_names_the_size_read_from_data():
    """The message blamed random ops and torch.cov, and advised the cache option in use."""
    with pytest.raises(dtcompile.TracingError, match="size is read from tensor data.*Read it before the write"):
        dtcompile.jit(_bool_of_a_selection_after_a_write, cache="constant values")(torch.tensor([[2.0, 2], [1, 4]]))


def _read_then_written_by_a_later_branch(x):
    y = x.clone()
    k = y[0].item()
    r = x * 2 if k - k == 0 else x - 1  # (inf - inf is nan: the other branch)
    y.mul_(-1)  # moved with the next branch's ops to the program's start
    return r + 1 if y.sum() * k > 0 else r - 1


@pytest.mark.parametrize("cache", CACHES)
def test_a_number_read_before_a_write_that_moves_with_a_later_branch_is_checked_as_read(cache):
    """The checks of a float read from data (NaN, infinities, a zero's sign) were built from
    its tensor computed now, which the later branch's write (run now with its ops) had
    changed: the entry traced with inf took finite values, or its check failed at every call
    with an internal error (probe CB)."""
    jitted = dtcompile.jit(_read_then_written_by_a_later_branch, cache=cache)
    for first in (float("inf"), 2.0, 0.0, -0.0, float("-inf"), float("nan"), 2.0):
        x = torch.tensor([first, 1.0, 1.0])
        got, expected = jitted(x.clone()), _read_then_written_by_a_later_branch(x.clone())
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True, msg=str(first))


def _compared_by_keywords(a, b):
    return torch.equal(input=a, other=b), a.equal(other=b), torch.allclose(a, other=b), a.allclose(other=b, atol=1)


def test_equal_and_allclose_take_torchs_keywords():
    a = torch.arange(3.0)
    for b in (a.clone(), a + 0.5):
        assert dtcompile.jit(_compared_by_keywords)(a, b) == _compared_by_keywords(a, b)
