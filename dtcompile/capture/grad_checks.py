"""What a traced call did to ``requires_grad`` that its compiled program would not do.

A call is compiled as inference (no autograd at all) or as a training step (an autograd
Function over the inputs that require grad), decided by the grad mode and the inputs when
the call begins. Code that turns gradients on inside (``torch.enable_grad()`` in a call
made under ``no_grad``, ``requires_grad_()``, a factory with ``requires_grad=True``), or
that changes an argument's ``requires_grad`` (an in-place write of a value that requires
grad), gets other tensors from eager: refused, with what to do instead.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..core import NoProvenance, TensorProxy, TracingError

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def grad_state(tensor: torch.Tensor) -> tuple[bool, object]:
    """What autograd holds of a tensor: its flag and the node that made it."""
    return tensor.requires_grad, tensor.grad_fn


@dataclass
class HeldFlags:
    """The tensors a call holds as the traced code gets them (its proxies: leaves, so only
    their flag can change), where each comes from, and each one's requires_grad before
    tracing; compared in one C-level pass."""

    tensors: list
    wheres: list
    flags: list

    @staticmethod
    def of(pairs: list[tuple[torch.Tensor, object]]) -> HeldFlags:
        tensors = [tensor for tensor, _ in pairs]
        return HeldFlags(tensors, [where for _, where in pairs], list(map(_REQUIRES_GRAD, tensors)))

    def changed(self) -> object | None:
        """Where the first tensor whose flag changed comes from; None where none did."""
        with torch._C.DisableTorchFunction():  # flags only: not the tracing annotator's to see (1.5 us a read)
            now = list(map(_REQUIRES_GRAD, self.tensors))
        return None if now == self.flags else next(w for w, a, b in zip(self.wheres, now, self.flags) if a != b)


_NO_GRAD_VIEW = torch._C._autograd.CreationMeta.NO_GRAD_MODE


def gradient_refusal(
    held: HeldFlags, closed_over: list[tuple[torch.Tensor, str, tuple]], outputs: list, training: bool
) -> None:
    """Raise where the traced call's gradients differ from its compiled program's (see the
    module docstring). ``held``: the flags of the call's tensors (arguments, the module's
    tensors, objects' attributes) before tracing; ``closed_over``: ``(tensor, where, its
    grad_state)`` of each real tensor the code closed over, when tracing met it (it may be
    a non-leaf); ``outputs``: the tensors it returns."""
    where = held.changed()
    if where is None:
        where = next((w for tensor, w, state in closed_over if grad_state(tensor) != state), None)
    if where is not None:
        _put_back_flags(closed_over)
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
            base = tensor._base if tensor._is_view() else None
            if base is not None and (_from_the_call(base) or any(base is held for held, _, _ in closed_over)):
                if not isinstance(tensor, DTensor):
                    continue  # ``w.t()`` under no_grad: a view that requires grad, the program's as eager's
                raise TracingError(
                    "dtcompile.jit: the call returns a view of a DTensor of its own that requires grad "
                    "(w.t() under torch.no_grad()); eager's view requires grad, a compiled call without "
                    "autograd rebuilds a DTensor that does not. Return the DTensor itself, or take the view outside"
                )
            raise TracingError(
                "dtcompile.jit: the call returns (or assigns to a module's attribute) a tensor that requires grad, "
                "made so inside it (torch.enable_grad() in a call made without gradients, requires_grad_(), "
                "a factory with requires_grad=True, nn.Parameter) in a call that needs no gradients (made with "
                "gradients off, or with no input that requires grad); it is compiled without autograd. Call it "
                "with gradients enabled and an input that requires grad, or turn gradients on outside"
            )
        if tensor._is_view() and torch._C._autograd._get_creation_meta(tensor) == _NO_GRAD_VIEW:
            raise TracingError(  # (before ``is_leaf``, which raises for one written in place since)
                "dtcompile.jit: the call returns a view of a tensor that requires grad, taken under "
                "torch.no_grad() (with torch.no_grad(): y = x[1:]); a compiled call with gradients does not "
                "rebuild such a view yet. Take the view outside the call, or return a copy (y.clone())"
            )
        if tensor.is_leaf:
            raise TracingError(
                "dtcompile.jit: the call returns (or assigns to a module's attribute) a leaf tensor that requires "
                "grad, made inside it (a factory "
                "with requires_grad=True, detach().requires_grad_(), nn.Parameter): eager gives it a .grad "
                "after backward, a compiled call cannot. Make it outside the call and pass it in"
            )


def _put_back_flags(closed_over: list[tuple[torch.Tensor, str, tuple]]) -> None:
    """Give real tensors the traced code closed over their flags back: an in-place write
    while tracing gave them a graph of proxies (which their next backward would follow)."""
    for tensor, _, (flag, _) in closed_over:
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


def repointed_leaf_refusal(symbols: list, differentiable: list) -> None:
    """A tensor gradients flow to, pointed at other memory in place inside the call
    (``p.set_(q)``, which ``torch.nn.utils.parametrize``'s assignment calls): eager's
    ``.backward()`` still reaches it through the graph made before, but autograd no longer
    counts it as an input of that graph (``torch.autograd.grad`` gives it None), and a
    compiled call's backward is such a ``grad``: its gradient would be lost."""
    wrt = {id(t) for pair in differentiable for t in pair}
    for symbol in symbols:
        if symbol.op is not None and symbol.op.overloadpacket is torch.ops.aten.set_ and id(symbol.args[0]) in wrt:
            raise TracingError(
                f"dtcompile.jit: {symbol.note or symbol.op} points a tensor that requires grad at other memory "
                "(Tensor.set_, which torch.nn.utils.parametrize's assignment calls), in a call that needs gradients: "
                "its gradient would be lost. Copy the new values in (p.copy_(new) under torch.no_grad()), or "
                "assign outside the call"
            )
