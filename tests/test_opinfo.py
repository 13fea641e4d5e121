"""torch's own op database (OpInfo), each op's first sample compiled: eager's results or
a clear refusal, never a silent difference.

For every op with float32 on the CPU (and its in-place variant), the first sample torch's
tests use is run eagerly and through one jitted function, called twice (the second call
runs the cached program) on fresh copies of the inputs. The compiled call must give
eager's outputs (values, dtype, shape, strides, ``requires_grad``), leave its inputs as
eager leaves them, return the input an in-place op returns, and raise eager's error type
where eager raises. Where it refuses (``TracingError``, ``UnsupportedInputError``) the op
must be listed in ``REFUSED`` with words of its message, and an op listed there must
still be refused: one that starts to compile is taken off the list, so the list says
what does not compile today.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.testing._internal.common_methods_invocations as op_database

import dtcompile

# torch's test utilities freeze torch.backends' flags at import (their tests set them with
# a context manager only); the other tests here set them directly, as users do.
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

REFUSALS = (dtcompile.TracingError, dtcompile.UnsupportedInputError)

# Ops whose outputs hold whatever memory they were given: only their metadata is compared.
UNINITIALIZED = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}

_DATA = "depends on the values in a tensor"  # (a Python bool, or sizes read from the data)
_RESTRIDES = "changes the sizes or strides of"  # (in place)
_INPUT = "inputs must be tensors"
_NO_FAKE = "no fake or meta kernel"

# Refused today, with words of the refusal (``.inplace``: the in-place variant). README,
# "Not yet", names these classes.
REFUSED: dict[str, str | tuple[str, ...]] = {
    **dict.fromkeys(["nn.functional.ctc_loss", "linalg.lstsq", "linalg.lstsq.grad_oriented"], _DATA),
    **dict.fromkeys(["resize_", "resize_.inplace"], _RESTRIDES),
    **dict.fromkeys([f"{name}.inplace" for name in ("squeeze", "unsqueeze", "transpose", "t")], _RESTRIDES),
    **dict.fromkeys(["as_strided.partial_views.inplace", "nn.functional.dropout3d.inplace"], _RESTRIDES),
    **dict.fromkeys(
        ["nn.functional.linear_cross_entropy.chunked", "nn.functional.linear_cross_entropy.chunked_none"], _INPUT
    ),
    **dict.fromkeys(["sparse.sampled_addmm", "sparse.mm.reduce"], "only strided tensors"),
    "to_sparse": "makes a tensor of layout torch.sparse_coo",
}
# Refused under symbolic values only, or otherwise there.
REFUSED_SYMBOLIC: dict[str, str | tuple[str, ...]] = dict.fromkeys(["geqrf", "histogramdd", "to_sparse"], _NO_FAKE)


def _name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


OPS = [op for op in op_database.op_db if torch.float32 in op.supported_dtypes("cpu")]
CASES = [(op, "op") for op in OPS] + [(op, "inplace") for op in OPS if op.inplace_variant is not None]


def _case_id(case) -> str:
    op, variant = case
    return _name(op) + (".inplace" if variant == "inplace" else "")


def _copy(obj, memo: dict):
    """A copy with the same strides, storage offsets and memory sharing as ``obj``."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            if obj.layout != torch.strided:
                memo[id(obj)] = obj.clone()
            else:
                storages = memo.setdefault("storages", {})
                key = obj.untyped_storage().data_ptr()
                storage = storages.setdefault(key, obj.untyped_storage().clone())
                copy = torch.empty(0, dtype=obj.dtype)
                with torch.no_grad():
                    copy.set_(storage, obj.storage_offset(), obj.size(), obj.stride())
                memo[id(obj)] = copy.requires_grad_(obj.requires_grad)
        return memo[id(obj)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_copy(o, memo) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy(o, memo) for o in obj)
    if isinstance(obj, dict):
        return {k: _copy(v, memo) for k, v in obj.items()}
    return obj


def _call(fn, sample, differentiate: bool = False):
    """``fn`` on copies of the sample, seeded; with ``differentiate``, then the gradients of
    its outputs that need them, for seeded random cotangents, to each input that needs
    them. (outcome, the result (and gradients) or the error, the copies)."""
    memo: dict = {}
    args = (_copy(sample.input, memo), *_copy(tuple(sample.args), memo))
    kwargs = _copy(dict(sample.kwargs), memo)
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fn(*args, **kwargs)
            if differentiate:
                outputs = [t for t in _tensors(result) if t.requires_grad]
                generator = torch.Generator().manual_seed(1)
                cotangents = [torch.randn(t.shape, dtype=t.dtype, generator=generator) for t in outputs]
                leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]
                grads = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True) if outputs else ()
                result = (result, list(grads))
        return "ran", result, (args, kwargs)
    except Exception as error:  # eager's own errors are part of what is compared
        return "raised", error, (args, kwargs)


def _assert_as_eager(name: str, jitted, sample, eager, refused: dict, values: bool, differs=None, grads=False):
    """The jitted call, first and cached, against ``eager``: a refusal listed in ``refused``
    with its words, a difference listed in ``differs``, or eager's results."""
    for attempt in ("first call", "cached call"):
        compiled = _call(jitted, sample, grads)
        if differs is not None:
            found = " ".join(_compare(compiled, eager, values))
            assert differs in found, f"{name} ({attempt}) now as eager: take it off the differences ({found})"
            continue
        if compiled[0] == "raised" and isinstance(compiled[1], REFUSALS) and eager[0] == "ran":
            assert name in refused, f"{name} refused: {compiled[1]}"
            words = refused[name] if isinstance(refused[name], tuple) else (refused[name],)
            assert any(w in str(compiled[1]) for w in words), f"{name} refused another way: {compiled[1]}"
            return
        assert name not in refused, f"{name} now compiles ({attempt}): take it off the refused"
        assert not _compare(compiled, eager, values), f"{name} ({attempt}): {_compare(compiled, eager, values)}"


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _differences(got, expected, where: str, values: bool = True) -> list[str]:
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{where}: {type(got).__name__} where eager gives a tensor"]
        facts = ("dtype", "shape", "layout", "requires_grad")
        found = [
            f"{where}.{f}: {getattr(got, f)} vs {getattr(expected, f)}"
            for f in facts
            if getattr(got, f) != getattr(expected, f)
        ]
        if found:
            return found
        if expected.layout == torch.strided and expected.numel() > 1 and got.stride() != expected.stride():
            return [f"{where}.stride: {got.stride()} vs eager's {expected.stride()}"]
        if values:
            try:
                torch.testing.assert_close(got.detach(), expected.detach(), equal_nan=True, check_stride=False)
            except AssertionError as error:
                return [f"{where} values: {str(error).splitlines()[0]}"]
        return []
    if isinstance(expected, (list, tuple)) and not isinstance(expected, torch.Size):
        if type(got) is not type(expected) or len(got) != len(expected):
            return [f"{where}: {type(got).__name__} of {len(got)} vs {type(expected).__name__} of {len(expected)}"]
        return [d for i, (g, e) in enumerate(zip(got, expected)) for d in _differences(g, e, f"{where}[{i}]", values)]
    if isinstance(expected, dict):
        if type(got) is not type(expected) or list(got) != list(expected):
            return [f"{where}: keys {list(got)} vs eager's {list(expected)}"]
        return [d for k in expected for d in _differences(got[k], expected[k], f"{where}[{k!r}]", values)]
    if type(got) is not type(expected) or (got != expected and got == got):  # (NaN equals NaN here)
        return [f"{where}: {got!r} vs eager's {expected!r}"]
    return []


def _compare(compiled, eager, values: bool) -> list[str]:
    (c_outcome, c_result, c_inputs), (e_outcome, e_result, e_inputs) = compiled, eager
    if e_outcome == "raised":
        if c_outcome == "raised" and isinstance(c_result, type(e_result)):
            return []
        return [f"eager raises {type(e_result).__name__}: {e_result}; compiled: {c_result!r}"]
    if c_outcome == "raised":
        return [f"compiled raises {type(c_result).__name__}: {c_result}"]
    found = _differences(c_result, e_result, "output", values)
    found += _differences(c_inputs, e_inputs, "input after the call", values)
    c_ins, e_ins = _tensors(c_inputs), _tensors(e_inputs)
    returned = [[i for i, t in enumerate(ins) if t is r] for ins, r in ((c_ins, c_result), (e_ins, e_result))]
    if returned[0] != returned[1]:
        found.append(f"returns input {returned[0]} where eager returns input {returned[1]}")
    return found


def _plain_call(op, *args, **kwargs):
    return op(*args, **kwargs)


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_first_sample_as_eager(case, cache, monkeypatch):
    op, variant = case
    # torch's sample functions of random ops seed inside themselves (wrapper_set_seed):
    # user code that seeds while traced is refused, so the test seeds outside the call.
    monkeypatch.setattr(op_database, "wrapper_set_seed", _plain_call)
    sample = next(iter(op.sample_inputs("cpu", torch.float32)))
    fn = op.op if variant == "op" else op.inplace_variant

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    jitted = dtcompile.jit(call, cache=cache)
    refused = REFUSED if cache == "constant values" else {**REFUSED, **REFUSED_SYMBOLIC}
    name = _case_id(case)
    _assert_as_eager(name, jitted, sample, _call(call, sample), refused, op.name not in UNINITIALIZED)


GRAD_OPS = [
    op for op in op_database.op_db if op.supports_autograd and torch.float64 in op.supported_backward_dtypes("cpu")
]

# Refused with gradients (float64), beyond what is refused without them.
REFUSED_GRAD: dict[str, str | tuple[str, ...]] = {
    "native_group_norm": _RESTRIDES,  # (its backward's C++ code, on an intermediate)
}
if torch.__version__ < "2.11":  # (torch 2.10's quantile first checks its q with ``equal``)
    REFUSED.update(dict.fromkeys(["quantile", "nanquantile"], _DATA))
    REFUSED_GRAD.update(dict.fromkeys(["quantile", "nanquantile"], _DATA))
REFUSED_GRAD_SYMBOLIC = {"nn.functional.fractional_max_pool3d": _NO_FAKE}  # (its backward)
if torch.__version__ < "2.11":  # (its C++ backward asks for a symbolic size's value there)
    REFUSED_GRAD_SYMBOLIC["trace"] = "cannot take symbolic sizes"
# Gradients that differ from eager's, with words of the difference (README, "Not yet"):
# eager's ormqr backward takes another path where no dispatch mode is on, whose gradient
# of the input is laid out as the input (under any mode eager's own is contiguous, as
# the compiled one); eager's linalg.eig backward checks that the loss does not depend on
# the eigenvectors' phase, which the compiled backward does not.
DIFFERS_GRAD = {"ormqr": "stride", "linalg.eig": "ill-defined"}


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("op", GRAD_OPS, ids=_name)
def test_first_sample_gradients_as_eager(op, cache, monkeypatch):
    monkeypatch.setattr(op_database, "wrapper_set_seed", _plain_call)
    sample = next(iter(op.sample_inputs("cpu", torch.float64, requires_grad=True)))

    def call(*args, **kwargs):
        return op.op(*args, **kwargs)

    jitted = dtcompile.jit(call, cache=cache)
    refused = {**REFUSED, **REFUSED_GRAD}
    refused.update({**REFUSED_SYMBOLIC, **REFUSED_GRAD_SYMBOLIC} if cache == "symbolic values" else {})
    name = _name(op)
    eager = _call(call, sample, differentiate=True)
    differs = DIFFERS_GRAD.get(name)
    _assert_as_eager(name, jitted, sample, eager, refused, op.name not in UNINITIALIZED, differs, grads=True)
