"""Capturing the backward of a traced call, through DTensor's own autograd.

The forward ran on proxies that require grad, so autograd recorded its graph over them
(DTensor's ops, redistributions and ``from_local``/``to_local`` included). Calling
``torch.autograd.grad`` with cotangent proxies then runs DTensor's backward; its local
ops and collectives come back to the recorder like the forward's did. No gradient rule
of our own is involved: the gradients are whatever DTensor computes, placements
included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..core import InputPath, TensorProxy
from ..core.proxy import contiguous_strides
from ..core.torch_internals import DTensorSpec, TensorMeta, make_dtensor
from .recorder import Recording


@dataclass
class BackwardCapture:
    """What tracing the backward recorded, beside the symbols themselves."""

    cotangents: list[TensorProxy]  # one per differentiable output, backward inputs
    cotangent_slots: list[int]  # the output slot each cotangent belongs to
    cotangent_specs: list[DTensorSpec | None]  # the placements the backward expects; None: a plain tensor
    differentiable: list[TensorProxy]  # the computation inputs gradients are computed for
    differentiable_values: list[tuple[TensorProxy, object]]  # each, with the value traced (proxy or DTensor)
    grads: list[TensorProxy | None]  # their gradients' local tensors (None: no gradient flows)
    grad_specs: list[DTensorSpec | None]  # the gradients' DTensor specs; None: plain tensors
    # Inputs (labels) whose pure computations the backward recomputes instead of having the
    # forward save them: FSDP2's sharded parameters that reshard after forward (fsdp.py).
    recompute_from: frozenset[str] = frozenset()


def _cotangent_for(recording: Recording, value, index: int) -> tuple[object, TensorProxy, DTensorSpec | None]:
    """A contiguous cotangent shaped like ``value`` (the backward makes incoming cotangents
    contiguous, whatever strides they arrive with)."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    with recording.fake_mode:
        fake = torch.empty(local.shape, dtype=local.dtype, device=local.device)
    name = f"cotangent{index}"
    recording.used_names.add(name)
    proxy = TensorProxy(fake, name, InputPath("cotangents").index(index))
    if not isinstance(value, DTensor):
        return proxy, proxy, None
    spec = value._spec
    meta = TensorMeta(spec.tensor_meta.shape, contiguous_strides(spec.tensor_meta.shape), spec.tensor_meta.dtype)
    # The cotangent of a Partial output is Replicate, as DTensor's own backward makes it
    # (``_redistribute_backward`` turns a gradient bound for a Partial placement into a
    # Replicate one): that is what arrives at run time, and a Replicate gradient cannot
    # be redistributed to Partial (DTensor forbids it).
    placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    spec = DTensorSpec(spec.mesh, placements, tensor_meta=meta)
    return make_dtensor(proxy, spec, requires_grad=False), proxy, spec


def capture_backward(
    recording: Recording, differentiable: list[tuple[TensorProxy, object]], output_values: list
) -> BackwardCapture:
    """Record the backward of the forward just recorded. ``output_values`` are the values
    behind the computation's output slots (a DTensor, or a proxy)."""
    forward_symbols = len(recording.bound_symbols)
    outputs, cotangents, proxies, slots, specs = [], [], [], [], []
    for slot, value in enumerate(output_values):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            cotangent, proxy, spec = _cotangent_for(recording, value, len(proxies))
            outputs.append(value)
            cotangents.append(cotangent)
            proxies.append(proxy)
            slots.append(slot)
            specs.append(spec)
    wrt = [traced for _, traced in differentiable]
    grads = torch.autograd.grad(outputs, wrt, cotangents, allow_unused=True) if outputs else [None] * len(wrt)
    for bsym in recording.bound_symbols[forward_symbols:]:
        bsym.in_backward = True
    grad_locals, grad_specs = [], []
    for grad in grads:
        if isinstance(grad, DTensor):
            grad_locals.append(grad._local_tensor)
            grad_specs.append(grad._spec)
        else:
            grad_locals.append(grad)
            grad_specs.append(None)
    return BackwardCapture(
        proxies, slots, specs, [p for p, _ in differentiable], list(differentiable), grad_locals, grad_specs
    )
