"""The torch state a call is traced under besides its inputs (:class:`GlobalState`, which
the prologue guards), and what the traced code changed of it and did not restore: a
compiled program runs the Python code once, while tracing, so it would not change that
state at each call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.torch_internals import dtensor_implicit_replication, dtensor_op_handlers, function_mode_count


@dataclass(frozen=True)
class GlobalState:
    """What the program was traced under besides its inputs and the Python values it reads,
    as it was when tracing began; the prologue guards it. What a factory function
    (``torch.zeros(3)``, ``torch.arange(4) / 3``) takes when the code names no dtype or
    device: the default dtype, the torch function modes active (a default device is one)
    and the default device. What DTensor's dispatch reads besides its arguments: whether
    plain tensors count as replicated (``implicit_replication()``), and the handlers that
    replace ops (``loss_parallel()`` adds some)."""

    dtype: torch.dtype
    function_modes: int
    device: torch.device
    implicit_replication: bool
    op_handlers: dict  # the handlers table itself
    op_handler_items: list  # its items then

    @classmethod
    def now(cls) -> GlobalState:
        handlers = dtensor_op_handlers()
        return cls(
            torch.get_default_dtype(),
            function_mode_count(),
            torch.get_default_device(),
            dtensor_implicit_replication(),
            handlers,
            list(handlers.items()),
        )


def state_put_back(grad_enabled: bool, state: GlobalState) -> list[str]:
    """The grad mode and default dtype the traced code changed and did not restore, put
    back as the call found them: a compiled program would not change them at each call."""
    changes = []
    if torch.is_grad_enabled() is not grad_enabled:
        changes.append(f"the grad mode (enabled: {grad_enabled} -> {torch.is_grad_enabled()})")
        torch.set_grad_enabled(grad_enabled)
    if torch.get_default_dtype() is not state.dtype:
        changes.append(f"the default dtype ({state.dtype} -> {torch.get_default_dtype()})")
        torch.set_default_dtype(state.dtype)
    return changes


def modes_left_changed(state: GlobalState) -> list[str]:
    """The torch function modes and DTensor's implicit replication, if the traced code
    changed them and did not restore them (after tracing's own modes are gone)."""
    changes = []
    if torch.get_default_device() != state.device:
        changes.append(f"the default device ({state.device} -> {torch.get_default_device()})")
    elif function_mode_count() != state.function_modes:
        changes.append("the torch function modes")
    if dtensor_implicit_replication() is not state.implicit_replication:
        changes.append("DTensor's implicit replication")
    return changes
