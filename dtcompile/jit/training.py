"""A compiled training step: the forward and backward programs inside one autograd Function.

The Function takes the call's inputs as the prologue returns them: the DTensors (and
tensors) that need gradients themselves, so autograd connects the step to them and puts
DTensor gradients on DTensor parameters, and every other input as a local tensor. Its
forward runs the forward program and keeps the saved values; its backward makes each
cotangent what the backward program was traced with (the traced placements, a contiguous
local tensor; a ``Zeros`` stand-in where autograd computed none), runs the backward
program and wraps the gradients with the specs DTensor's backward gave them at trace time
(an input only outputs without a cotangent reach gets None, as eager's). Under
``saved_tensors_hooks`` the programs hold what the hooks did to each saved tensor when
traced: the Function saves its own values without them; other hooks than traced: refused.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from ..capture import with_plain_sizes
from ..capture.around_ops import refuse_mutation_on_saved
from ..capture.backward_users import unreached_refusal
from ..capture.fake_calls import functorch_refusal
from ..capture.global_state import autocast_devices, autocast_off
from ..core import TensorProxy, TracingError
from ..core.codegen import GeneratedFunction
from ..core.symbolic import as_constant, is_symbolic
from ..core.torch_internals import (
    DTensorSpec,
    compute_global_tensor_info,
    function_modes_off,
    functorch_transform,
    make_dtensor,
    saved_tensors_hooks,
)
from ..core.trace import Zeros
from .epilogue import build_epilogue, build_output_wrapper, dtensor_outputs, views_made_own, with_sizes
from .output_hooks import Watching, feeding_outputs, hook_later_outputs, hooked_feeding_output
from .saved_hooks import same_saved_hooks
from .saved_reads import SAVED_INFERENCE, live_saved, read_back, saved_dtensor_outputs


@dataclass(frozen=True)
class Cotangent:
    """What the backward expects of one output's gradient."""

    slot: int  # the output slot it belongs to
    spec: DTensorSpec | None  # its placements, for a DTensor output; None: a plain tensor
    shape: tuple  # its local shape: ints, and SymInts where sizes are symbolic
    dtype: torch.dtype
    device: torch.device

    def prepare(self, grad, local_shape: torch.Size) -> torch.Tensor | Zeros:
        """The gradient's local tensor, as the backward program was traced with it; where
        autograd computed none (the output was not used), zeros of the output's
        ``local_shape`` that the program makes where it first reads them."""
        if grad is None:
            return Zeros(local_shape, self.dtype, self.device)
        if self.spec is not None:
            if not isinstance(grad, DTensor):
                raise TypeError(
                    f"dtcompile: the gradient of output {self.slot} is a {type(grad).__name__}, "
                    "but the output is a DTensor"
                )
            if grad.placements != self.spec.placements or grad.device_mesh != self.spec.mesh:
                # What DTensor would do with a cotangent of other placements: redistribute it.
                grad = grad.redistribute(self.spec.mesh, self.spec.placements)
            grad = grad._local_tensor
        if isinstance(grad, AsyncCollectiveTensor):
            grad = grad.wait()
        if grad.dim() != len(self.shape) or any(isinstance(e, int) and g != e for g, e in zip(grad.shape, self.shape)):
            raise RuntimeError(
                f"dtcompile: the gradient of output {self.slot} has local shape {tuple(grad.shape)}; the "
                f"backward was compiled for {tuple(map(str, self.shape))}"
            )
        return grad if grad.is_contiguous() else grad.contiguous()


@dataclass(frozen=True)
class Gradient:
    """Where one gradient the backward returns goes, and as what."""

    position: int  # the input it is the gradient of
    spec: DTensorSpec | None  # as traced, for a DTensor input; None: a plain tensor
    sizes_per_call: bool  # the spec has symbolic sizes: rebuilt from each gradient
    # The cotangents (bit i: program.cotangents[i]) whose outputs reach the input in autograd's
    # graph: where none arrives, the gradient is None, as eager's (0: unknown, always given).
    sources: int = 0

    def wrap(self, grad: torch.Tensor, shape: torch.Size | None):
        """The gradient as a DTensor; ``shape``: the input's global shape at this call
        (where sizes are symbolic), which a gradient has, however unevenly its placements
        shard it (an input's gradient may be sharded where the input is not)."""
        if self.spec is None:
            return grad
        spec = self.spec
        if self.sizes_per_call:
            _, stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
            if grad.is_contiguous():
                stride = torch.empty(shape, device="meta").stride()
            spec = with_sizes(spec, tuple(shape), tuple(stride))
        return make_dtensor(grad, spec, requires_grad=False)


@dataclass
class TrainingProgram:
    forward: object  # compiled forward: local inputs -> (output slots..., saved...)
    backward: object  # compiled backward: (saved..., cotangents...) -> gradients
    wrap_outputs: GeneratedFunction  # local output slots -> what the step returns
    rebuild: GeneratedFunction  # the step's flat outputs -> the call's result
    slots: int
    dtensor_inputs: list[int]  # input positions holding a DTensor that needs a gradient
    non_differentiable: list[int]  # output slots autograd must not differentiate
    cotangents: list[Cotangent]
    gradients: list[Gradient]
    inputs: int
    # (output slot, input position) of inputs the call returns as they are: the caller's
    # own tensor, as eager returns it (its .grad filled by backward where it requires grad).
    returned_inputs: list[tuple[int, int]]
    saved_hooks: tuple | None = None  # the saved_tensors_hooks (pack, unpack) it was traced under
    dtensor_modes: tuple | None = None  # (DTensorModes its backward needs on, eager's error without)
    users_code: frozenset = frozenset()  # ``BackwardCapture.users_code``
    autocast_allowed: tuple = ()  # ``BackwardCapture.autocast_allowed``
    # Positions of the inputs the backward reads as they were, which the forward does not
    # write: their versions, unchanged through the forward but through another input sharing
    # their memory (``x``, ``x.view(3)``: traced apart), as autograd checks the caller's.
    read_back: tuple = ()
    # The DTensor inputs whose memory it reads (through a view the forward saved: ``w.t()``),
    # checked by their own versions, as eager's autograd checks the DTensors it saved.
    dtensors_read_back: tuple = ()
    # Saved values that are inputs the backward writes (a buffer a checkpointed region's
    # recompute updates): read as they are at the backward, as eager's recompute reads them.
    live_saved: frozenset = frozenset()
    saved_dtensor_outputs: tuple = ()  # ``saved_reads.saved_dtensor_outputs``
    feeding_outputs: tuple = ()  # ``output_hooks.feeding_outputs``
    graph_saves: bool = True  # ``BackwardCapture.graph_saves``
    # The Python values the call's code read while traced (``Read``), where its backward
    # runs code of the user's: checked before each backward, since eager's backward reads
    # them then (a Function's ``ctx.mod.scale`` changed between the call and backward()).
    backward_reads: tuple = ()

    def __post_init__(self):
        self.returned_slots = frozenset(slot for slot, _ in self.returned_inputs)

    @staticmethod
    def make(forward, backward, output, captured_inputs, backward_capture, slots: int, joint) -> TrainingProgram:
        """The program of a captured training call: ``backward`` its execution trace,
        ``captured_inputs`` the computation's input proxies, ``backward_capture`` what
        tracing the backward recorded, ``joint`` the recorded trace (forward, then backward)."""
        trace_output = joint.output
        position = {p.label: i for i, p in enumerate(captured_inputs)}
        # A new DTensor around an input's local (a no-op redistribute): eager's is no input.
        rewrapped = {node.index for node in dtensor_outputs(output) if not node.given}
        cotangents = [
            Cotangent(slot, spec, tuple(as_constant(x) for x in proxy.shape), proxy.dtype, proxy.device)
            for slot, spec, proxy in zip(
                backward_capture.cotangent_slots, backward_capture.cotangent_specs, backward_capture.cotangents
            )
        ]
        sources = backward_capture.grad_sources or [0] * len(backward_capture.differentiable)
        gradients = [
            Gradient(
                position[p.label],
                None if spec is None else with_plain_sizes(spec),  # (a size specialized: an int, not its SymInt)
                spec is not None and any(is_symbolic(x) for x in (*spec.tensor_meta.shape, *spec.tensor_meta.stride)),
                source,
            )
            for p, grad, spec, source in zip(
                backward_capture.differentiable, backward_capture.grads, backward_capture.grad_specs, sources
            )
            if grad is not None
        ]
        traced_slots = set(backward_capture.cotangent_slots)
        dtensor_positions = [
            (p, position[p.label])
            for p, traced in backward_capture.differentiable_values
            if isinstance(traced, DTensor)
        ]
        dtensors = [i for _, i in dtensor_positions]
        return TrainingProgram(
            forward=forward,
            backward=backward.compile(),
            live_saved=live_saved(
                backward, captured_inputs, len(backward_capture.cotangents), backward_capture.saved_by_nodes
            ),
            graph_saves=backward_capture.graph_saves,
            saved_dtensor_outputs=saved_dtensor_outputs(
                backward, trace_output, {n.index for n in dtensor_outputs(output)}, len(backward_capture.cotangents)
            ),
            feeding_outputs=feeding_outputs(joint, slots, backward_capture.cotangent_slots),
            wrap_outputs=build_output_wrapper(output, slots, {p.label: i for p, i in dtensor_positions}),
            rebuild=build_epilogue(output, wrap=False),
            slots=slots,
            dtensor_inputs=dtensors,
            non_differentiable=[
                i for i in range(slots) if i not in traced_slots and isinstance(trace_output[i], TensorProxy)
            ],
            cotangents=cotangents,
            gradients=gradients,
            inputs=len(captured_inputs),
            returned_inputs=[
                (i, position[out.label])
                for i, out in enumerate(trace_output[:slots])
                if isinstance(out, TensorProxy) and out.label in position and i not in rewrapped
            ],
            saved_hooks=backward_capture.saved_hooks,
            dtensor_modes=backward_capture.dtensor_modes,
            autocast_allowed=backward_capture.autocast_allowed,
            users_code=backward_capture.users_code,
            read_back=read_back(joint, captured_inputs),
            dtensors_read_back=tuple(i for i in read_back(joint, captured_inputs, by_memory=True) if i in dtensors),
        )

    def __call__(self, inputs: tuple):
        hooks = saved_tensors_hooks()
        try:
            if hooks is None and self.saved_hooks is None and functorch_transform() is None:
                outs = CompiledStep.apply(self, *inputs)
            else:
                outs = self._apply_under_hooks(hooks, inputs)
        except NotImplementedError as error:  # (torch's, of the Function dtcompile runs the step in)
            if "jvp" not in str(error):
                raise
            raise functorch_refusal(
                "forward-mode AD (torch.autograd.forward_ad) through a call with gradients"
            ) from error
        hook_later_outputs(outs := list(outs))
        for slot in self.non_differentiable:
            if outs[slot].requires_grad and slot not in self.returned_slots:
                # A view of a detached input (``x.detach()[1:]``): eager's needs no gradient.
                outs[slot] = outs[slot].detach()
        for slot, position in self.returned_inputs:
            # The caller's own tensor, as eager returns it (a DTensor that needs no gradient: the
            # program has its local tensor, and returns it wrapped anew; ``x._local_tensor``).
            given = inputs[position]
            if isinstance(given, DTensor) and not isinstance(outs[slot], DTensor):
                outs[slot] = given._local_tensor
            elif given.requires_grad or not isinstance(outs[slot], DTensor):
                outs[slot] = given
        return self.rebuild.fn(outs, ())

    def _apply_under_hooks(self, hooks: tuple | None, inputs: tuple):
        """The step, where saved_tensors_hooks are active now or were when it was traced.
        Traced under them, the programs do what they did to each tensor autograd saved
        (pack in the forward, unpack in the backward): the Function saves its values
        without them, else they would apply twice. A step traced under other hooks than
        the call's (or none) would give other gradients than eager's: refused. (So is a call
        under a torch.func transform, whose wrapped tensors a custom Function cannot take.)"""
        if (transform := functorch_transform()) is not None:
            raise functorch_refusal(f"torch.func.{transform} around a call with gradients")
        refuse_mutation_on_saved()
        if not same_saved_hooks(hooks, self.saved_hooks):
            raise TracingError(
                "dtcompile.jit: this training call was compiled "
                + ("without saved_tensors_hooks" if self.saved_hooks is None else "under other saved_tensors_hooks")
                + " than are active now ("
                + (
                    "none"
                    if hooks is None
                    else "pack {}, unpack {}".format(*(getattr(f, "__qualname__", None) or repr(f) for f in hooks[:2]))
                )
                + "); its programs apply the hooks it was traced under to what autograd saves, so it would not "
                "give eager's gradients. Compile a separate function (dtcompile.jit) for calls made under "
                "these hooks, or call it under the hooks it was compiled under"
            )
        popped = []
        while (top := saved_tensors_hooks()) is not None:
            popped.append(top)
            torch._C._autograd._pop_saved_tensors_default_hooks()
        try:
            return CompiledStep.apply(self, *inputs)
        finally:
            for pack, unpack in reversed(popped):
                torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


class CompiledStep(torch.autograd.Function):
    """Runs a :class:`TrainingProgram` (see the module docstring)."""

    @staticmethod
    def forward(ctx, program: TrainingProgram, *inputs):
        local_inputs = list(inputs)
        for position in program.dtensor_inputs:
            local_inputs[position] = local_inputs[position]._local_tensor
        if any(local_inputs[i].is_inference() for i in program.read_back):  # (they have no version)
            raise RuntimeError(SAVED_INFERENCE)
        versions = [local_inputs[i]._version for i in program.read_back]
        ctx.dtensor_versions = [(i, inputs[i], inputs[i]._version) for i in program.dtensors_read_back]
        outs = views_made_own(program.forward(*local_inputs), program.slots, local_inputs)
        ctx.program = program
        ctx.arrived_before = 0  # the outputs earlier backwards had gradients of (bit i: cotangents[i])
        ctx.written = [i for i, v in zip(program.read_back, versions) if local_inputs[i]._version != v]
        # As autograd's own saved tensors: freed after a backward without retain_graph (a
        # second one then raises), and checked for in-place changes before the backward.
        # Numbers (read from tensor data) are kept beside them, in their places.
        saved = outs[program.slots :]
        live = program.live_saved
        ctx.numbers = [(i, v) for i, v in enumerate(saved) if not isinstance(v, torch.Tensor) or i in live]
        tensors = [v for i, v in enumerate(saved) if isinstance(v, torch.Tensor) and i not in live]
        # (none saved: a second backward runs, as eager's through nodes saving none; where eager's
        # saved some, a tensor of no elements is saved, for autograd to free)
        ctx.saves, ctx.stand_in = bool(tensors) or program.graph_saves, not tensors
        ctx.save_for_backward(*(tensors or [torch.empty(0)] * program.graph_saves))
        ctx.set_materialize_grads(False)  # (None stays None: the program makes zeros where it reads them)
        ctx.local_shapes = [outs[c.slot].shape for c in program.cotangents]
        ctx.input_shapes = [inputs[g.position].shape if g.sizes_per_call else None for g in program.gradients]
        wrapped = program.wrap_outputs.fn(outs[: program.slots], inputs)
        ctx.mark_non_differentiable(*(wrapped[i] for i in program.non_differentiable))
        # (by weak reference: a reference would hold the output's own node; one let go
        # cannot be written, and its views hold it)
        ctx.output_versions = [(weakref.ref(wrapped[i]), wrapped[i]._version) for i in program.saved_dtensor_outputs]
        ctx.watching = Watching(program.feeding_outputs, wrapped, [c.slot for c in program.cotangents])
        return wrapped

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # autograd enables it in a backward only for create_graph=True
            raise RuntimeError(
                "dtcompile: the backward of a compiled call is not differentiable (double backward, "
                "create_graph=True, is not supported)"
            )
        program: TrainingProgram = ctx.program
        if not set(autocast_devices()) <= set(program.autocast_allowed):
            raise RuntimeError(
                "dtcompile: the backward of a compiled call runs under autocast, where the call ran ops outside it "
                "(called outside autocast; autocast(enabled=False) or another dtype inside) or runs code of yours "
                "(a hook, a Function's backward): eager's would cast their gradients, the compiled one, traced "
                "outside autocast as torch recommends, does not. Call .backward() outside the autocast region"
            )
        if ctx.written:  # autograd's own error, as eager's backward raises it
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"input {ctx.written[0]} of the compiled call, through another input that shares its memory"
            )
        changed = [f"input {i}" for i, dtensor, version in ctx.dtensor_versions if dtensor._version != version]
        changed += [
            "an output" for ref, version in ctx.output_versions if getattr(ref(), "_version", version) != version
        ]
        if changed:  # eager's DTensor autograd saved the DTensor itself, and checks its version
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"{changed[0]} of the compiled call (a DTensor), changed in place after the call"
            )
        changed = next((read for read in program.backward_reads if not read.unchanged()), None)
        if changed is not None:
            raise RuntimeError(
                f"dtcompile: the backward of a compiled call runs code of yours (a hook, an autograd.Function's "
                f"backward) that may read {changed.where}, which changed after the call: the compiled backward "
                "holds the value it had when traced, where eager's backward would read the new one. Change it "
                "before the call (a change then compiles anew), or after the backward"
            )
        if program.dtensor_modes is not None and not program.dtensor_modes[0].active():
            raise RuntimeError(program.dtensor_modes[1])  # eager's, outside loss_parallel() say
        arrived = sum(1 << i for i, c in enumerate(program.cotangents) if grad_outputs[c.slot] is not None)
        ctx.watching.ran()
        if (refusal := hooked_feeding_output(ctx.watching, arrived)) is not None:
            raise RuntimeError(refusal)
        try:
            inputs = list(ctx.saved_tensors) if ctx.saves else []
            inputs = [] if ctx.stand_in else inputs
        except RuntimeError as error:
            if "A view was created in no_grad mode" in str(error):  # a view of an input the program saved
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    "operation: an input of the compiled call, changed in place after the call"
                ) from error
            if "a second time" not in str(error) or ctx.arrived_before & arrived:
                raise
            raise RuntimeError(
                "dtcompile: the outputs of a compiled call are one autograd node: the backward of some of them "
                "(without retain_graph=True) freed what the backward of the others reads, where eager's graphs "
                "of them may be apart. Run one backward for all (torch.autograd.backward([l1, l2]) or "
                "(l1 + l2).backward()), or pass retain_graph=True to the first"
            ) from error
        ctx.arrived_before |= arrived
        # Autograd lets go of the saved tensors now unless the graph is retained, and the
        # backward program empties ``inputs``: each saved value is freed after its last use,
        # as eager frees each node's saved tensors once the node has run.
        ctx.maybe_clear_saved_tensors()
        for position, number in ctx.numbers:
            inputs.insert(position, number)
        inputs += [c.prepare(grad_outputs[c.slot], shape) for c, shape in zip(program.cotangents, ctx.local_shapes)]
        # The cotangents that arrived: an input only outputs without one reach gets no
        # gradient (None, not zeros), as in eager.
        if (
            refusal := unreached_refusal(program.users_code, arrived, [c.slot for c in program.cotangents])
        ) is not None:
            raise RuntimeError(refusal)
        # (autograd's own backward runs none of the modes; traced outside autocast, it runs so)
        with function_modes_off(), autocast_off():
            grads = program.backward(inputs)
        result: list = [None] * (1 + program.inputs)
        for grad, gradient, shape in zip(grads, program.gradients, ctx.input_shapes):
            if not gradient.sources or gradient.sources & arrived:
                result[1 + gradient.position] = gradient.wrap(grad, shape)
        return tuple(result)
