"""What a traced call did to ``requires_grad`` that its compiled program would not do.

A call is compiled as inference (no autograd at all) or as a training step (an autograd
Function over the inputs that require grad), decided by the grad mode and the inputs when
the call begins. Code that turns gradients on inside (``torch.enable_grad()`` in a call
made under ``no_grad``, ``requires_grad_()``, a factory with ``requires_grad=True``), or
that changes an argument's ``requires_grad`` (an in-place write of a value that requires
grad), gets other tensors from eager: refused, with what to do instead.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..core import NoProvenance, TensorProxy, TracingError


def grad_state(tensor: torch.Tensor) -> tuple[bool, object]:
    """What autograd holds of a tensor: its flag and the node that made it."""
    return tensor.requires_grad, tensor.grad_fn


def gradient_refusal(before: list[tuple[torch.Tensor, object, tuple]], outputs: list, training: bool) -> None:
    """Raise where the traced call's gradients differ from its compiled program's (see the
    module docstring). ``before``: ``(tensor, where it comes from, its grad_state)`` of
    each tensor the call holds (arguments, the module's tensors, objects' attributes,
    closed-over tensors) when tracing met it; ``outputs``: the tensors it returns."""
    for tensor, where, state in before:
        if grad_state(tensor) != state:
            _put_back_flags(before)
            raise TracingError(
                f"dtcompile.jit: the call changes whether {where} requires grad, or the graph it belongs to "
                "(requires_grad_(), or an in-place write of a value that requires grad, which gives it the call's "
                "autograd graph); a compiled call would not. Make it require grad before the call, or write a "
                "detached value (under torch.no_grad())"
            )
    for tensor in outputs:
        if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad or _from_the_call(tensor):
            continue  # the call's own tensors are returned as they are
        if not training:
            raise TracingError(
                "dtcompile.jit: the call returns a tensor that requires grad, made so inside it "
                "(torch.enable_grad() in a call made without gradients, requires_grad_(), a factory with "
                "requires_grad=True) while no input needs gradients; it is compiled without autograd. Call it "
                "with gradients enabled and an input that requires grad, or turn gradients on outside"
            )
        if tensor.is_leaf:
            raise TracingError(
                "dtcompile.jit: the call returns a leaf tensor that requires grad, made inside it (a factory "
                "with requires_grad=True, detach().requires_grad_(), nn.Parameter): eager gives it a .grad "
                "after backward, a compiled call cannot. Make it outside the call and pass it in"
            )


def _put_back_flags(before: list[tuple[torch.Tensor, object, bool]]) -> None:
    """Give real tensors the traced code closed over their flags back: an in-place write
    while tracing gave them a graph of proxies (which their next backward would follow)."""
    for tensor, _, (flag, _) in before:
        if tensor.requires_grad and not flag and not _is_traced(tensor):
            with torch.no_grad():
                tensor.detach_()


def _is_traced(tensor: torch.Tensor) -> bool:
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return isinstance(local, TensorProxy)


def _from_the_call(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` stands for one the call holds (an argument, a module's tensor, a
    closed-over one): its proxy has a provenance in the call."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return isinstance(local, TensorProxy) and not isinstance(local.provenance, NoProvenance)
