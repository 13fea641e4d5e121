"""Refusals named by the torch-level call, where torch's tracing kernels fail on what
eager runs: each such RuntimeError of a fake or meta kernel, or of DTensor's sharding
propagation, becomes a :class:`TracingError` saying what the code did and what to write
instead. (Errors eager raises as well are ``eager_errors``' business.)"""

from __future__ import annotations

import re

import torch
from torch._subclasses.fake_tensor import UnsupportedOperatorException
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..core import TensorProxy, TracingError, data_dependent_error
from ..core.errors import SymbolsRefused
from ..core.op_classes import written_tensors
from ..core.symbolic import is_symbolic

# torch's messages, each the sign of one case below
_RESIZED = "directly modify sizes for customized tensor"
_MATH_BITS = "MathBitsFallback"
_CONCRETE_SIZES = "expected to contain only concrete integers"
_NO_SHAPE_ENV = "Must have shape_env to create symint"
_SIZE_LOOKUP = "could not look up op for aten::size"
_INVALID_GRADIENT = "returned an invalid gradient at index"


def refusal(call: str, error: RuntimeError, first_argument: str | None) -> TracingError | None:
    """The clear error for ``call`` failing with ``error`` while tracing (``first_argument``:
    where the call's first argument came from in the user's call, if it did), or None."""
    message = str(error)
    if _RESIZED in message:  # resize_ under symbolic values
        return TracingError(
            f"dtcompile.jit: {call} changes the sizes or strides of "
            f"{'a traced tensor' if first_argument is None else first_argument} in place, which dtcompile does not "
            "trace. Use the out-of-place form"
        )
    if _MATH_BITS in message:  # torch's fallback for conj/neg views asserts on proxies
        return TracingError(
            f"dtcompile.jit: {call} writes in place through a conjugate or negative view "
            "(x.conj(), torch._neg_view), which cannot be recorded: write to the tensor itself (for "
            "y = x.conj(); y.add_(1), x.add_(1))"
        )
    if _CONCRETE_SIZES in message or _SIZE_LOOKUP in message or _no_fake_kernel_for_dtensor(error):
        # torch has no kernel for symbolic sizes (``generator=``), or its C++ code asks a
        # DTensor of symbolic sizes for one (``torch.gradient``, ``F.interpolate``)
        return symbolic_sizes_refusal(call)
    if _INVALID_GRADIENT in message and re.search(r"\bu\d+\b", message):
        # (``y[[False, True], :, mask] = v``'s gradient for ``v``, sized by the mask's count)
        return data_dependent_error(
            call, "a gradient sized by a number read from data, which autograd compares with its input's size"
        )
    if "data is not allocated yet" in message and torch.autograd.forward_ad._current_level >= 0:
        return TracingError(  # (a custom autograd.Function's jvp, on dual tensors)
            f"dtcompile.jit: {call} under forward-mode AD (torch.autograd.forward_ad's dual tensors) reads a tensor's "
            "data, which a traced tensor has none of: a custom autograd.Function's jvp does. Use torch.func.jvp "
            "over the function instead, which compiles"
        )
    if _NO_SHAPE_ENV in message:
        # DTensor sizes its result under a fake mode of its own, which cannot make the
        # number of elements a slice keeps when its bound is read from data (``x[:, :k]``,
        # ``k = n.max().item()``): a bound it can order (``narrow``) needs none.
        instead = "" if "narrow" in call else "x.narrow(dim, start, length) with the length read from data, or "
        return TracingError(
            f"dtcompile.jit: {call} of a DTensor with a bound read from tensor data (an .item()): DTensor's "
            f"sharding propagation cannot size its result while tracing. Use {instead}the local tensor "
            "(x.to_local(), then DTensor.from_local)"
        )
    return None


def _no_fake_kernel_for_dtensor(error: RuntimeError) -> bool:
    """DTensor's sharding propagation running an op with no fake kernel on symbolic shapes
    (``torch.geqrf``, ``torch.histogram`` of a DTensor: constant values run them)."""
    return "Sharding propagation failed" in str(error) and isinstance(error.__cause__, UnsupportedOperatorException)


def symbolic_sizes_refusal(call: str, leaves: list = ()) -> TracingError:
    """Where torch's code for ``call`` takes concrete sizes only (a kernel, or C++ code asking
    a tensor's element count: ``torch.cov`` with weights); or where a size is read from data
    (``bool(x[m])`` whose rows tracing cannot compute now: cache options do not help)."""
    if any(isinstance(x, torch.Tensor) and free_unbacked_symbols(x.shape) for x in leaves):
        return TracingError(
            f"dtcompile.jit: {call} of a tensor whose size is read from tensor data (a mask's selection, a "
            "nonzero's) that tracing cannot compute now: what it reads was written in place before it, or a "
            "collective or a random op decides it. Read it before the write"
        )
    return TracingError(
        f"dtcompile.jit: {call} cannot take symbolic sizes in torch (its code, here, takes concrete "
        "ones: a random op with generator=, torch.cov with weights, torch.gradient of a DTensor, say); use "
        "cache='constant values'"
    )


def out_tensors(func, kwargs: dict) -> list[TensorProxy] | None:
    """A call's ``out=`` tensors, where it has traced ones (None: it has none; ``empty``'s
    out= form writes nothing, in eager too)."""
    out = kwargs.get("out")
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not outs or not all(isinstance(t, TensorProxy) for t in outs) or "empty" in getattr(func, "__name__", ""):
        return None
    return list(outs)


def out_written(bound_symbols: list, outs: list[TensorProxy]) -> bool:
    """Whether an op among ``bound_symbols`` writes the memory of one of ``outs`` (the call's
    own out= form, or an op writing a view of it: ``kron``'s)."""
    memory = {out.fake.untyped_storage()._cdata for out in outs}
    return any(t.fake.untyped_storage()._cdata in memory for b in bound_symbols for t in written_tensors(b))


def lost_out_write(call: str) -> TracingError:
    """Where torch, under a dispatch mode, computes an ``out=`` call's result and writes no
    ``out`` tensor (``torch.linalg.matrix_rank(a, out=o)``): the program would leave it."""
    return TracingError(
        f"dtcompile.jit: {call} with out= writes no out tensor while traced (torch computes it without its "
        "out= form under a dispatch mode); the compiled program would leave it as it was. Call it without "
        "out= and copy the result (o.copy_(...))"
    )


def data_read_refusal(call: str, func, args: tuple, kwargs: dict) -> BaseException:
    """The error for the traced code reading a traced tensor's data out of torch (``numpy()``,
    ``data_ptr()``): eager's own where eager raises before reading any (``numpy()`` of a
    tensor that requires grad: code may catch it and go on, as eager's does), else a refusal."""
    if func is torch.Tensor.numpy and args[0].requires_grad and not kwargs.get("force", args[1:2] == (True,)):
        return RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
    if func is torch.Tensor.data_ptr:  # (an address, not the values: the message above would mislead)
        return TracingError(
            f"dtcompile.jit: {call} of a traced tensor: its memory address differs from call to call, so code "
            "using it cannot be compiled (whether two inputs share memory is guarded: compare the tensors "
            "themselves, or compile the code after the check)"
        )
    return data_dependent_error(call, "the data leaves torch")


def operator_call(func, args: tuple, kwargs: dict, handled_by_dtensor: bool):
    """``func(*args, **kwargs)``, where DTensor cannot run it with symbolic sizes (it cannot
    hash a spec of symbolic strides: a TypeError, or NotImplemented from a tensor operator)
    raising ``SymbolsRefused``: the call is traced again with its sizes as they are. A
    TypeError or NotImplemented would reach a tensor operator (``x * 2``, ``x != 0``), which
    answers NotImplemented, and Python's fallback: ``x != 0`` True, silently."""
    try:
        out = func(*args, **kwargs)
    except TypeError as error:
        if handled_by_dtensor and "non-nested SymInt" in str(error):
            raise SymbolsRefused(f"DTensor cannot run {getattr(func, '__name__', func)} with symbolic sizes") from error
        raise
    if out is NotImplemented and handled_by_dtensor and getattr(func, "__name__", "").startswith("__"):
        symbolic = [a for a in args if isinstance(a, DTensor) and any(map(is_symbolic, (*a.shape, *a.stride())))]
        if symbolic:
            raise SymbolsRefused(f"DTensor gave {func.__name__} NotImplemented with symbolic sizes")
    return out


def refused_input_dims(error: BaseException) -> frozenset:
    """The ``(input path, dim)`` of each size symbol named in DTensor's refusal of symbolic
    sizes (``split_factor=s26``: a batch folded into a sharded dim), where the failed trace
    noted its symbols' input dims (``error.input_sizes``): traced again with those as they
    are, the other sizes stay symbolic (one entry per batch size, not per length)."""
    sizes = getattr(error, "input_sizes", {})
    texts = []
    while error is not None:
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    text = " ".join(texts)
    factor = re.search(r"split_factor=([^,]*)", text)  # (the symbol refused; the shapes after it are not)
    named = set(re.findall(r"\bs\d+\b", factor.group(1) if factor else text))
    return frozenset((str(proxy.provenance), dim) for symbol, (proxy, dim) in sizes.items() if str(symbol) in named)
