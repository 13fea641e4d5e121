"""Hooks the caller puts on a training call's outputs after the call.

A compiled training call's outputs are outputs of one autograd node. Where one output
was computed from another (``h`` and ``h.tanh()`` both returned), eager's graph runs a
hook on ``h``, or keeps ``h.grad`` (``retain_grad()``), with the sum of ``h``'s own
gradient and what came back through ``h.tanh()``; here only ``h``'s own reaches it, and
what the hook returns does not change what flows through the node. Such a backward is
refused, where the later outputs got a gradient; a hook registered inside the compiled
code, on the tensor before it is returned, is traced with the rest. ``backward(inputs=[h])``
keeps ``h``'s gradient as ``retain_grad()`` does: refused so too. ``torch.autograd.grad(loss,
h)`` takes the gradient that reached ``h`` directly and does not run the node: refused where
the graph task ends, where an output computed from another got a gradient and the node's
backward did not run (:class:`Watching`).
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd import Variable

from ..core import TensorProxy


def feeding_outputs(joint, slots: int, cotangent_slots: list[int]) -> tuple[tuple[int, int], ...]:
    """``(slot, mask)`` for each output slot that other output slots were computed from,
    ``mask`` the cotangents (bit k: ``cotangent_slots[k]``) of those later outputs."""
    outputs = joint.output[:slots]
    depends: dict[str, int] = {}  # label -> the output slots it was computed from (bits)
    for slot, proxy in enumerate(outputs):
        if isinstance(proxy, TensorProxy):
            depends[proxy.label] = depends.get(proxy.label, 0) | 1 << slot
    for bsym in joint.bound_symbols:
        mask = 0
        for proxy in bsym.input_proxies():
            mask |= depends.get(proxy.label, 0)
        if mask:
            for proxy in bsym.output_proxies():
                depends[proxy.label] = depends.get(proxy.label, 0) | mask
    bit = {slot: k for k, slot in enumerate(cotangent_slots)}
    found = []
    for slot, proxy in enumerate(outputs):
        if not isinstance(proxy, TensorProxy):
            continue
        later = 0
        for other, value in enumerate(outputs):
            if other in bit and isinstance(value, TensorProxy) and value.label != proxy.label:
                if depends.get(value.label, 0) >> slot & 1:
                    later |= 1 << bit[other]
        if later:
            found.append((slot, later))
    return tuple(found)


class Watching:
    """What the backward checks of a call's outputs (the step's, as returned): each feeding
    one, by weak reference (a reference would hold the node that made it); and a hook on
    each output computed from one, which notes the graph tasks that gave it a gradient."""

    def __init__(self, feeding: tuple, outputs, cotangent_slots: list[int]):
        self.feeding = [(slot, weakref.ref(outputs[slot]), mask) for slot, mask in feeding]
        self.ran_in: int | None = None  # the graph task the node's backward last ran in
        self.reached_in: int | None = None
        later = {cotangent_slots[k] for _, mask in feeding for k in range(len(cotangent_slots)) if mask >> k & 1}
        self.later = sorted(later)

    def ran(self) -> None:
        self.ran_in = torch._C._current_graph_task_id()

    def arrived(self) -> None:
        task = torch._C._current_graph_task_id()
        if self.reached_in != task:
            self.reached_in = task
            Variable._execution_engine.queue_callback(lambda: self._ended(task))

    def _ended(self, task: int) -> None:
        if self.ran_in != task:
            raise RuntimeError(
                "dtcompile: torch.autograd.grad (or backward(inputs=...)) asked for the gradient of an output of a "
                "compiled call that other outputs of the call were computed from, or of one of those, where "
                "those got a gradient: the call's outputs are one autograd node, so the gradient that reached "
                "the output directly would be taken, where eager's adds what came back through the others. "
                "Compile the code that makes the output apart from the code that uses it (two calls: two nodes)"
            )


def hook_later_outputs(outputs: list) -> None:
    """Once the call returned (in its ``forward`` they need no gradient yet), the hooks of
    its node's :class:`Watching` on the outputs computed from others."""
    watching = next((o.grad_fn.watching for o in outputs if getattr(o, "grad_fn", None) is not None), None)
    for slot in watching.later if isinstance(watching, Watching) else ():
        outputs[slot].register_hook(_Arrived(watching))


class _Arrived:
    """A hook of :class:`Watching` (told apart from the caller's hooks)."""

    def __init__(self, watching: Watching):
        self.watching = watching

    def __call__(self, grad):
        if grad is not None:
            self.watching.arrived()


def hooked_feeding_output(watching: Watching, arrived: int) -> str | None:
    """The refusal of a backward where a feeding output has a hook or keeps its gradient
    and an output computed from it got a gradient (``arrived``: bit k, cotangent k)."""
    for slot, ref, mask in watching.feeding:
        output = ref()
        if output is None or not mask & arrived:
            continue
        hooked = any(not isinstance(hook, _Arrived) for hook in (output._backward_hooks or {}).values())
        if hooked or output.retains_grad:
            what = "keeps its gradient (retain_grad())" if output.retains_grad else "has a tensor hook"
            return (
                f"dtcompile: output {slot} of a compiled call {what}, and other outputs of the call were computed "
                "from it: the call's outputs are one autograd node, so the hook sees (and .grad keeps) only the "
                "gradient that reached that output directly, where eager's adds what came back through the others. "
                "Register a hook inside the compiled code, before the tensor is returned, or compile the code that "
                "makes it apart from the code that uses it (two calls: two nodes)"
            )
    return None
