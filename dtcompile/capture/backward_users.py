"""The user's code in a traced backward, and which cotangents it sees.

Eager's autograd runs a tensor hook, a module's backward hook or a Function's ``backward``
only where a gradient reaches it, and passes a module backward hook ``None`` for each of
the module's outputs no gradient reached. A compiled backward was traced with every
cotangent, and runs its code on zeros where one did not arrive. So tracing notes, for
each symbol the user's code recorded and each module backward hook's ``grad_output``, the
cotangents it comes from (``users_code``); a backward whose arrived cotangents would make
eager run that code otherwise is refused (``users_code_reached``).
"""

from __future__ import annotations

import contextlib

from torch.distributed.tensor import DTensor
from torch.utils.hooks import BackwardHook

from ..core import TensorProxy


@contextlib.contextmanager
def grad_outputs_noted():
    """Inside, each ``grad_output`` tuple torch builds for a module's full backward hook or
    backward pre-hook is noted, in the list it yields: the label of each slot's (local)
    proxy, None for a slot without one."""
    noted: list[tuple] = []
    original = BackwardHook._pack_with_none

    def pack(self, indices, values, size):
        packed = original(self, indices, values, size)
        if indices is self.output_tensors_index and (self.user_hooks or self.user_pre_hooks):
            noted.append(tuple(map(_label, packed)))
        return packed

    BackwardHook._pack_with_none = pack
    try:
        yield noted
    finally:
        BackwardHook._pack_with_none = original


def _label(value) -> str | None:
    local = value._local_tensor if isinstance(value, DTensor) else value
    return local.label if isinstance(local, TensorProxy) else None


def users_code(recording, start: int, cotangents: list[TensorProxy], noted: list[tuple]) -> frozenset:
    """For each symbol the user's code recorded in the backward (from symbol ``start`` on),
    the cotangents (bit i: ``cotangents[i]``) its inputs come from; for each module backward
    hook's ``grad_output`` (``noted``), the tuple of each slot's."""
    users = {id(b) for b in recording.users_backward}
    masks = {p.label: 1 << i for i, p in enumerate(cotangents)}
    found: set = set()
    for bsym in recording.bound_symbols[start:]:
        mask = 0
        for proxy in bsym.input_proxies():
            mask |= masks.get(proxy.label, 0)
        if mask:
            masks.update((proxy.label, mask | masks.get(proxy.label, 0)) for proxy in bsym.output_proxies())
            if id(bsym) in users:
                found.add(mask)
    found.update(tuple(masks.get(label, 0) for label in slots) for slots in noted)
    return frozenset(found)


def users_code_reached(users_code: frozenset, arrived: int) -> bool:
    """Whether the cotangents that ``arrived`` (bit i: cotangents[i]) make the user's code
    in the backward run as the compiled backward runs it: each symbol of it reached by one
    of them (else eager would not run it: a hook ``g + 1``, a Function that branches on ``g
    is None``), and each module backward hook that runs given a gradient in every slot one
    reached when traced (else eager's would see None there)."""
    for entry in users_code:
        if type(entry) is tuple:
            if any(m & arrived for m in entry) and any(m and not m & arrived for m in entry):
                return False
        elif not entry & arrived:
            return False
    return True


def unreached_refusal(users_code: frozenset, arrived: int, slots: list[int]) -> str | None:
    """Why a backward whose ``arrived`` cotangents (of the output ``slots``) would not run the
    user's code as eager's does is refused; None where it would."""
    if users_code_reached(users_code, arrived):
        return None
    missing = [slot for i, slot in enumerate(slots) if not arrived >> i & 1]
    return (
        "dtcompile: the backward of a compiled call runs code of yours (a tensor hook, a module's backward hook, "
        f"an autograd.Function's backward) on the gradient of outputs {missing}, which got none (the loss does not "
        "use them): eager would not run it there, or would pass a module's backward hook None for them, where the "
        "compiled backward runs it on zeros. Return only the outputs the loss uses, or give each a gradient "
        "(loss + out.sum() * 0)"
    )
