"""Hooks the caller puts on a training call's outputs after the call.

A compiled training call's outputs are outputs of one autograd node. Where one output
was computed from another (``h`` and ``h.tanh()`` both returned), eager's graph runs a
hook on ``h``, or keeps ``h.grad`` (``retain_grad()``), with the sum of ``h``'s own
gradient and what came back through ``h.tanh()``; here only ``h``'s own reaches it, and
what the hook returns does not change what flows through the node. Such a backward is
refused, where the later outputs got a gradient; a hook registered inside the compiled
code, on the tensor before it is returned, is traced with the rest. (``backward(inputs=[h])``
does not reach the node's backward: not seen.)
"""

from __future__ import annotations

import weakref

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


def watched(feeding: tuple, outputs) -> list:
    """What the backward checks of ``outputs`` (the step's, as returned): each feeding one,
    by weak reference (a reference would hold the node that made it)."""
    return [(slot, weakref.ref(outputs[slot]), mask) for slot, mask in feeding]


def hooked_feeding_output(watching: list, arrived: int) -> str | None:
    """The refusal of a backward where a feeding output has a hook or keeps its gradient
    and an output computed from it got a gradient (``arrived``: bit k, cotangent k)."""
    for slot, ref, mask in watching:
        output = ref()
        if output is None or not mask & arrived:
            continue
        if output._backward_hooks or output.retains_grad:
            what = "keeps its gradient (retain_grad())" if output.retains_grad else "has a tensor hook"
            return (
                f"dtcompile: output {slot} of a compiled call {what}, and other outputs of the call were computed "
                "from it: the call's outputs are one autograd node, so the hook sees (and .grad keeps) only the "
                "gradient that reached that output directly, where eager's adds what came back through the others. "
                "Register a hook inside the compiled code, before the tensor is returned, or compile the code that "
                "makes it apart from the code that uses it (two calls: two nodes)"
            )
    return None
