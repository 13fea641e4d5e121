"""Repeated blocks in a call that needs gradients: the backward replayed too.

Without gradients a replayed block's outputs need only proxies (``blocks.py``). With them,
autograd must reach the later block's parameters and inputs when the trace's backward is
recorded (``autograd.py``). A later block's call therefore goes through
:class:`_ReplayedBlock`, an autograd Function whose forward records the first block's
forward symbols again, and whose backward records the first block's *backward* symbols
again: a template recorded by ``torch.autograd.grad`` on the first block alone
(:func:`backward_template`), with cotangents like the gradients that arrive, saved
values mapped to the later block's forward values, and the gradients it gives made into
the later block's. The gradients that arrive are known only when the backward runs, so
templates are keyed by their metadata and specs: one is made right after the first
block's forward, for contiguous cotangents of the outputs' placements (Partial ones as
Replicate, as DTensor's backward sends them), and others, rarely, from the first block's
graph (kept for this) when other gradients arrive. Where that fails (the first block's
graph already freed), :class:`BlockReplayFailed` makes the capture start again with
every block traced.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..core import NoProvenance, TensorProxy
from ..core.proxy import contiguous_strides
from ..core.torch_internals import DTensorSpec, TensorMeta, fake_like, make_dtensor
from .block_calls import backward_program, call_again
from .equivalence import local_proxy, traced_key
from .graph_reach import REACHED_BY, reaching
from .replay import ReplayDiverged, aliases_of, record_again


class BlockReplayFailed(Exception):
    """A replayed block's backward could not be recorded: trace every block instead."""


@dataclass
class BackwardTemplate:
    """The first block's backward for one set of incoming gradients."""

    key: tuple  # the incoming gradients' metadata (``gradient_key``)
    cotangents: list  # per differentiable output: the cotangent's local proxy (None: no gradient came)
    symbols: list
    aliases: list  # per symbol, what ``replay.output_aliases`` found
    grads: list  # per differentiable input: the gradient (a DTensor or proxy), or None


def gradient_key(grads) -> tuple:
    return tuple(None if g is None else traced_key(g) for g in grads)


def _cotangent_like(recording, value, index: int, contiguous: bool):
    """A cotangent proxy with ``value``'s metadata (a DTensor around one, for a DTensor);
    with ``contiguous``, the contiguous strides and the placements DTensor's backward
    sends for an output (Partial as Replicate)."""
    local = local_proxy(value)
    fake = local.fake
    if contiguous:
        with recording.fake_mode:
            fake = torch.empty(fake.shape, dtype=fake.dtype, device=fake.device)
    else:
        fake = fake_like(recording.fake_mode, fake, None, False)
    proxy = TensorProxy(fake, f"block_cotangent{index}", NoProvenance("a repeated block's backward template"))
    if not isinstance(value, DTensor):
        return proxy, proxy
    spec = value._spec
    if contiguous:
        meta = spec.tensor_meta
        spec = DTensorSpec(
            spec.mesh,
            tuple(Replicate() if p.is_partial() else p for p in spec.placements),
            tensor_meta=TensorMeta(meta.shape, contiguous_strides(meta.shape), meta.dtype),
        )
    return make_dtensor(proxy, copy.copy(spec), requires_grad=False), proxy


def backward_template(recording, outputs: list, inputs: list, like: list | None) -> BackwardTemplate:
    """Record the backward of the first block (``outputs`` from ``inputs``, the values
    that require grad) for cotangents like ``like`` (None: like the outputs, contiguous),
    and take its symbols out of the trace. Raises BlockReplayFailed where it cannot."""
    cotangents, locals_, arriving = [], [], []
    for index, output in enumerate(outputs):
        if like is not None and like[index] is None:
            locals_.append(None)
            arriving.append(None)
            continue
        cotangent, local = _cotangent_like(recording, output if like is None else like[index], index, like is None)
        cotangents.append(cotangent)
        locals_.append(local)
        arriving.append(cotangent)
    chosen = [o for o, c in zip(outputs, locals_) if c is not None]
    if any(getattr(x, "_backward_hooks", None) for x in inputs):  # (``register_hook`` on one, before the block)
        raise BlockReplayFailed("a hook on an input would run in the backward recorded, each later block's own")
    start = len(recording.bound_symbols)
    counts = (len(recording.captured), len(recording.read_by), recording.c10d_calls)
    valued = [(p, p.value) for p in recording.valued]
    try:
        with recording.names_apart("block_grad"):
            grads = torch.autograd.grad(chosen, inputs, cotangents, retain_graph=True, allow_unused=True)
    except RuntimeError as error:  # the first block's graph is gone
        raise BlockReplayFailed(str(error)) from error
    finally:
        symbols = recording.bound_symbols[start:]
        del recording.bound_symbols[start:]
        for proxy, value in valued:  # an in-place op of the backward must not forget the forward's values
            proxy.value = value
        recording.valued[:] = [p for p, _ in valued]
    if (len(recording.captured), len(recording.read_by), recording.c10d_calls) != counts:
        raise BlockReplayFailed("the backward changed the recording's other state")
    aliases = aliases_of(symbols)
    return BackwardTemplate(gradient_key(arriving), locals_, symbols, aliases, list(grads))


class GradReplay:
    """One later block's call replayed with gradients: its forward mapping, kept for its
    backward."""

    def __init__(self, recording, template, forward, inputs: list, saved: list, program_names: set[str]):
        self.recording = recording
        self.program_names = program_names  # the block programs' names taken so far
        self.template = template
        self.forward = forward  # records the forward again; returns (mapping, the output leaves)
        self.inputs = inputs  # the later block's values that require grad, as the template's
        self.mapping: dict = {}
        # The tensors its backward reads (inputs, then outputs once made), with their
        # versions: changed in place before the backward, eager's autograd would raise.
        self.saved = [(t, t._version) for t in saved]

    def apply(self):
        """The output leaves; those that require grad come out of the autograd Function."""
        leaves = [None]

        def run():
            self.mapping, leaves[0] = self.forward()
            return tuple(leaves[0][i] for i in self.template.grad_outputs)

        outs = _ReplayedBlock.apply(self, run, *self.inputs)
        result = list(leaves[0])
        for index, out in zip(self.template.grad_outputs, outs):
            result[index] = out
        self.saved += [(result[i], result[i]._version) for i in self.template.saved_outputs]
        return result

    def reached_by(self) -> tuple[int, list[int]]:
        """Its outputs' count, and for each input the outputs (bit k: the k-th) whose gradients
        reach it in the first block's graph, which this call's backward replays."""
        template = self.template
        if template.inputs_reached is None:
            with torch._C.DisableTorchFunction():
                template.inputs_reached = reaching(template.grad_output_values, template.grad_input_values)
        return len(template.grad_outputs), template.inputs_reached

    def backward(self, grads: tuple) -> list:
        template, recording = self.template, self.recording
        for tensor, version in self.saved:
            if tensor._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a tensor of shape {list(tensor.shape)} a replayed repeated block saved is at version "
                    f"{tensor._version}; expected version {version} instead (dtcompile: as autograd checks it)"
                )
        key = gradient_key(grads)
        backward = template.backwards.get(key)
        if backward is None:
            backward = backward_template(recording, template.grad_output_values, template.grad_input_values, grads)
            template.backwards[key] = backward
        mapping = dict(self.mapping)
        for cotangent, grad in zip(backward.cotangents, grads):
            if cotangent is not None:
                mapping[cotangent.label] = local_proxy(grad)
        program = self._program(key, backward)
        try:
            if program is not None:
                call_again(recording, program, mapping)
            else:  # (a forward called reads through its program's outputs only: a KeyError here)
                with torch._C.DisableTorchFunction():
                    record_again(recording, backward.symbols, backward.aliases, mapping)
        except (KeyError, ReplayDiverged, ValueError) as error:
            raise BlockReplayFailed(f"a replayed block's backward: {error!r}") from error
        made = []
        for grad in backward.grads:
            if grad is None:
                made.append(None)
            elif isinstance(grad, DTensor):
                made.append(make_dtensor(mapping[grad._local_tensor.label], copy.copy(grad._spec), requires_grad=False))
            else:
                made.append(mapping[grad.label])
        return made

    def _program(self, key: tuple, backward: BackwardTemplate):
        """The program later blocks' backwards call for these gradients, made once; None
        where the forward is recorded again, or the backward cannot be called."""
        template = self.template
        if template.forward_program is None:
            return None
        if key not in template.backward_programs:
            template.backward_programs[key] = backward_program(
                template, template.forward_program, backward, self.program_names
            )
        return template.backward_programs[key]


class _ReplayedBlock(torch.autograd.Function):
    """A later block's call: forward and backward recorded from the first block's."""

    @staticmethod
    def forward(ctx, replay: GradReplay, run, *inputs):
        ctx.set_materialize_grads(False)
        ctx.replay = replay
        setattr(ctx, REACHED_BY, replay.reached_by)  # (one node for the first block's whole graph)
        with torch.enable_grad():  # as the first block was recorded
            return run()

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.replay.backward(grads))
