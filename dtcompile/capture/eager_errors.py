"""The error eager would raise, where a torch-level call fails while tracing.

Tracing runs torch's fake and meta kernels and its decompositions, whose checks can differ
from eager's kernels in the error they raise: ``x.to(torch.complex64) // 2`` raises a
RuntimeError there ("not supported for floor_divide") where eager's CPU kernel raises a
NotImplementedError; code written against eager (``except NotImplementedError``) then
takes another path. When a call fails, it is run once more on real tensors of the same
sizes, strides, dtypes and devices (zeros, at most :data:`_LARGEST` elements each, with
no dispatch mode active, the random state put back), and eager's error is raised where it
is of another type.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from ..core import TensorProxy

_LARGEST = 1 << 20  # elements of one stand-in tensor: a failing call costs no more than this


class _GiveUp(Exception):
    pass


# Calls whose traced form (torch's decompositions, above the dispatcher) checks no dtype
# where eager's kernel rejects some (``F.one_hot`` of an int32 index, ``F.interpolate`` and
# ``F.hardshrink`` of integers): run on stand-ins first, so that eager's error is raised.
DTYPE_CHECKED = frozenset(
    {torch.nn.functional.one_hot, torch.nn.functional.interpolate, torch.hardshrink, torch.nn.functional.softshrink}
)
# Calls whose fake kernels check no dtype where eager's reject tensors of two floating
# dtypes (``F.linear`` of float32 and float64): run on stand-ins where the dtypes differ.
_SAME_DTYPE_CHECKED = frozenset(
    {torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__}
    | {torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm, torch.mv}
    | {torch.Tensor.mv, torch.baddbmm, torch.addmv, torch.Tensor.index_add_, torch.nn.functional.layer_norm}
)


def dtype_checked(func, leaves: list) -> bool:
    """Whether ``func`` on these arguments is run on stand-ins first (see above; and an
    in-place method writing an integer or bool tensor with a float: eager's kernel cannot
    cast it, where the fake one writes it, and autograd then took the integer tensor for
    one needing a gradient)."""
    if func in DTYPE_CHECKED:
        return True
    if _in_place_method(func) and leaves and isinstance(leaves[0], torch.Tensor):
        written = leaves[0].dtype
        if not (written.is_floating_point or written.is_complex):
            return any(
                (x.dtype.is_floating_point or x.dtype.is_complex)
                if isinstance(x, torch.Tensor)
                else type(x) in (float, complex)
                for x in leaves[1:]
            )
    if func not in _SAME_DTYPE_CHECKED or torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return False  # (autocast casts them to one)
    return len({x.dtype for x in leaves if isinstance(x, torch.Tensor) and x.dtype.is_floating_point}) > 1


def out_with_grad(kwargs: dict, leaves: list) -> bool:
    """An ``out=`` call under grad mode with an argument that requires grad: eager's kernels
    refuse it (out= does not support autograd), where torch's Python forms of some
    (``matmul``'s) record it, and those of others have no derivative eager would not ask
    for (``diag``): run on stand-ins first."""
    return (
        kwargs.get("out") is not None
        and torch.is_grad_enabled()
        and any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
    )


def _in_place_method(func) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("_")) or name in _IN_PLACE_OPERATORS


_IN_PLACE_OPERATORS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__imod__"})


def eager_error(func, args: tuple, kwargs: dict, error: RuntimeError) -> BaseException | None:
    """Eager's exception for ``func(*args, **kwargs)`` where it is not a RuntimeError of
    ``error``'s type (a subclass, NotImplementedError, or another type); else None."""
    eager = eager_failure(func, args, kwargs)
    return eager if eager is not None and type(eager) is not type(error) else None


def eager_failure(func, args: tuple, kwargs: dict, grad: bool = False) -> BaseException | None:
    """The exception eager's ``func`` raises on stand-ins of the arguments; None where it
    raises none, or where it cannot be run on stand-ins (``grad``: each stand-in requires
    grad where its tensor does, an ``out=`` tensor's check)."""
    if any(isinstance(x, (DTensor, torch.Generator)) for x in tree_flatten((args, kwargs))[0]):
        return None  # DTensor's own checks run while tracing, as in eager; a generator is the user's
    if _communicates(func):
        return None  # run for real, a collective would wait for peers that run no such thing
    try:
        real_args, real_kwargs = tree_map(_stand_in, (args, kwargs))
        if grad:
            for real, traced in zip(tree_flatten(real_args)[0], tree_flatten(args)[0]):
                if isinstance(traced, torch.Tensor) and traced.requires_grad:
                    real.requires_grad_()
    except _GiveUp:
        return None
    random_state = torch.default_generator.get_state()  # a random op draws nothing for the user
    try:
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch._C._DisablePythonDispatcher():
            func(*real_args, **real_kwargs)
    except Exception as eager:  # noqa: BLE001 (eager's, whatever it is)
        return eager
    finally:
        torch.default_generator.set_state(random_state)
    return None


def _communicates(func) -> bool:
    """Whether ``func`` is one of torch.distributed's (``dist.broadcast``, a functional
    collective, a c10d op)."""
    module = getattr(func, "__module__", None) or ""
    return module.startswith("torch.distributed") or getattr(func, "namespace", "") in _COLLECTIVE_NAMESPACES


_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})


def _stand_in(value):
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):  # (``size=x.shape[-1] * 2``)
        hint = value.node.hint  # its value at this call
        if hint is None:
            raise _GiveUp
        return hint
    if not isinstance(value, torch.Tensor):
        return value
    if not (isinstance(value, TensorProxy) or is_fake(value) or type(value) in (torch.Tensor, torch.nn.Parameter)):
        raise _GiveUp
    try:
        shape, stride = [int(_hint(s)) for s in value.shape], [int(_hint(s)) for s in value.stride()]
    except TypeError:
        raise _GiveUp from None
    numel = 1
    for size in shape:
        numel *= size
    if numel > _LARGEST:
        raise _GiveUp
    with _disable_current_modes():
        return torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device).zero_()


def _hint(size):
    """A size as an int: a symbolic one by its value at this call."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise TypeError("no hint")
        return hint
    return size
