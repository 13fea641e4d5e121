"""A compiled training step: the forward and backward programs inside one autograd Function.

The Function takes the call's inputs as the prologue returns them: the DTensors (and
tensors) that need gradients themselves, so autograd connects the step to them and puts
DTensor gradients on DTensor parameters, and every other input as a local tensor. Its
forward runs the forward program and keeps the saved values; its backward makes each
cotangent what the backward program was traced with (the traced placements, a
contiguous local tensor), runs the backward program and wraps the gradients with the
specs DTensor's backward gave them at trace time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._utils import compute_global_tensor_info

from ..core.codegen import GeneratedFunction
from .epilogue import with_sizes


@dataclass
class TrainingProgram:
    forward: object  # compiled forward: local inputs -> (output slots..., saved...)
    backward: object  # compiled backward: (saved..., cotangents...) -> gradients
    wrap_outputs: GeneratedFunction  # local output slots -> what the step returns
    rebuild: GeneratedFunction  # the step's flat outputs -> the call's result
    slots: int
    dtensor_inputs: list[int]  # input positions holding a DTensor that needs a gradient
    non_differentiable: list[int]  # output slots autograd must not differentiate
    cotangent_slots: list[int]
    cotangent_specs: list[DTensorSpec | None]
    cotangent_shapes: list[tuple[int, ...]]
    grad_positions: list[int]  # input position of each gradient the backward returns
    grad_specs: list[DTensorSpec | None]
    grad_sizes_per_call: list[bool]  # specs traced with symbolic sizes: rebuilt from each gradient
    inputs: int

    def __call__(self, inputs: tuple):
        return self.rebuild.fn(CompiledStep.apply(self, *inputs))

    def cotangent(self, k: int, grad) -> torch.Tensor:
        """The local tensor of the ``k``-th cotangent, as the backward program expects it."""
        spec = self.cotangent_specs[k]
        if spec is not None:
            if not isinstance(grad, DTensor):
                raise TypeError(
                    f"dtcompile: the gradient of output {self.cotangent_slots[k]} is a {type(grad).__name__}, "
                    "but the output is a DTensor"
                )
            if grad.placements != spec.placements or grad.device_mesh != spec.mesh:
                # What DTensor would do with a cotangent of other placements: redistribute it.
                grad = grad.redistribute(spec.mesh, spec.placements)
            grad = grad._local_tensor
        if isinstance(grad, AsyncCollectiveTensor):
            grad = grad.wait()
        expected = self.cotangent_shapes[k]  # ints, and SymInts where sizes are symbolic
        if grad.dim() != len(expected) or any(isinstance(e, int) and g != e for g, e in zip(grad.shape, expected)):
            raise RuntimeError(
                f"dtcompile: the gradient of output {self.cotangent_slots[k]} has local shape "
                f"{tuple(grad.shape)}; the backward was compiled for {tuple(map(str, expected))}"
            )
        return grad if grad.is_contiguous() else grad.contiguous()


class CompiledStep(torch.autograd.Function):
    """Runs a :class:`TrainingProgram` (see the module docstring)."""

    @staticmethod
    def forward(ctx, program: TrainingProgram, *inputs):
        local_inputs = list(inputs)
        for position in program.dtensor_inputs:
            local_inputs[position] = local_inputs[position]._local_tensor
        outs = program.forward(*local_inputs)
        ctx.program = program
        # As autograd's own saved tensors: freed after a backward without retain_graph (a
        # second one then raises), and checked for in-place changes before the backward.
        ctx.save_for_backward(*outs[program.slots :])
        wrapped = program.wrap_outputs.fn(outs[: program.slots])
        ctx.mark_non_differentiable(*(wrapped[i] for i in program.non_differentiable))
        return wrapped

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # autograd enables it in a backward only for create_graph=True
            raise RuntimeError(
                "dtcompile: the backward of a compiled call is not differentiable (double backward, "
                "create_graph=True, is not supported)"
            )
        program: TrainingProgram = ctx.program
        cotangents = [program.cotangent(k, grad_outputs[slot]) for k, slot in enumerate(program.cotangent_slots)]
        grads = program.backward(*ctx.saved_tensors, *cotangents)
        result: list = [None] * (1 + program.inputs)
        for grad, position, spec, per_call in zip(
            grads, program.grad_positions, program.grad_specs, program.grad_sizes_per_call
        ):
            if spec is not None and per_call:
                # Only evenly sharded DTensors are traced with symbolic sizes: the global
                # sizes follow from the local ones.
                shape, stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
                spec = with_sizes(spec, tuple(shape), tuple(stride))
            result[1 + position] = grad if spec is None else DTensor(grad, spec, requires_grad=False)
        return tuple(result)
