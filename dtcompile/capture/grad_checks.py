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
from torch.utils._pytree import tree_flatten

from ..core import NoProvenance, TensorProxy, TracingError


def requires_grad_of(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, bool]]:
    """The call's tensor arguments (as the traced code receives them) and their flags."""
    flat, _ = tree_flatten((args, kwargs))
    return [(t, t.requires_grad) for t in flat if isinstance(t, torch.Tensor)]


def gradient_refusal(before: list[tuple[torch.Tensor, bool]], outputs: list, training: bool) -> None:
    """Raise where the traced call's gradients differ from its compiled program's (see the
    module docstring). ``before``: :func:`requires_grad_of` when the call began;
    ``outputs``: the tensors it returns."""
    for index, (tensor, flag) in enumerate(before):
        if tensor.requires_grad is not flag:
            raise TracingError(
                f"dtcompile.jit: the call changes whether its tensor argument {index} requires grad "
                "(requires_grad_(), or an in-place write of a value that requires grad); a compiled call would "
                "not. Make the argument require grad before the call"
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


def _from_the_call(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` stands for one the call holds (an argument, a module's tensor, a
    closed-over one): its proxy has a provenance in the call."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return isinstance(local, TensorProxy) and not isinstance(local.provenance, NoProvenance)
