"""Ops of the user's libraries with no autograd kernel, asked for a gradient: refused.

An op defined with ``torch.library.Library(..., "DEF")`` and given only a kernel
(``CompositeExplicitAutograd``, ``CPU``) has no formula for its gradient. Eager's autograd
fallback runs that kernel with autograd on, so the torch ops the kernel calls are
recorded by autograd and gradients flow through them (torch warns at the backward that
this is deprecated). Traced, the op is recorded as one, below autograd: its outputs would
have no gradient path to its inputs, and the gradients would be silently missing. So it
is refused where a gradient is asked for (without one, it is recorded as it is).
"""

from __future__ import annotations

import torch

from ..core import TensorProxy, TracingError
from ..core.symbol import leaves

_TORCHS = ("aten", "prims", "c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "profiler")


def refuse_without_autograd(func, args: tuple, kwargs: dict, result) -> None:
    """Raise where ``func`` is an op of the user's with no autograd kernel, called on a
    tensor that requires grad with gradients on, and giving a ``result`` a gradient could
    flow back through (a floating or complex tensor: an integer mask has none)."""
    if func.namespace in _TORCHS or not torch.is_grad_enabled():
        return
    if not any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in leaves(result)):
        return
    if not any(isinstance(x, TensorProxy) and x.requires_grad for x in leaves((args, kwargs))):
        return
    name = func.name()
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in ("Autograd", "AutogradCPU")):
        return
    raise TracingError(
        f"dtcompile.jit: {name} has no autograd kernel, and a tensor that requires grad reaches it: eager's "
        "autograd fallback differentiates the torch ops its kernel runs (a deprecated path, torch warns), which "
        "a compiled call records as one op with no gradient. Register its gradient "
        "(torch.library.register_autograd), or define it with torch.library.custom_op"
    )
