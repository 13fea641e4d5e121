"""FSDP2's private parts dtcompile relies on (``capture/fsdp.py``), as torch 2.10 and 2.13
name them: FSDP2 has no public API for its parameter groups, nor for the casts its
forward hooks make."""

from __future__ import annotations

import contextlib
import functools

from .errors import TracingError


def fsdp_param_groups(state) -> list:
    """The ``FSDPParamGroup``\\ s of an FSDP2 module's ``FSDPState``: a list in torch 2.13
    (``_fsdp_param_groups``), one group or None in 2.10 (``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def fsdp_unsharded_spec(fsdp_param):
    """The spec of an FSDP2 parameter that was a DTensor before ``fully_shard`` (TP): its
    spec on the TP mesh (``_unsharded_dtensor_spec`` in 2.13, ``_tp_spec`` in 2.10)."""
    spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None)
    return spec if spec is not None else fsdp_param._tp_spec


def fsdp_cast_inputs(state, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """What an FSDP2 module's pre-forward does to its inputs: cast them to the
    mixed-precision ``param_dtype`` when its policy says so (a method of ``FSDPState`` in
    2.13; inline in its ``_pre_forward`` in 2.10, with the same helpers)."""
    if hasattr(state, "_cast_forward_inputs"):
        return state._cast_forward_inputs(args, kwargs)
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    policy = state._mp_policy
    if not (policy.cast_forward_inputs and policy.param_dtype):
        return args, kwargs
    cast = functools.partial(_cast_fp_tensor, policy.param_dtype)
    return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)


def fsdp_cast_output(state, output):
    """What an FSDP2 module's post-forward does to its output: cast it to the policy's
    ``output_dtype``, if any."""
    if hasattr(state, "_cast_output_dtype"):
        return state._cast_output_dtype(output)
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    dtype = state._mp_policy.output_dtype
    return output if dtype is None else _apply_to_tensors(functools.partial(_cast_fp_tensor, dtype), output)


def holds_composable_state(module) -> bool:
    """Whether torch keeps state for ``module`` by its identity (``fully_shard``'s, in
    ``torch.distributed._composable_state``): another object sharing its ``__dict__`` is
    not it there."""
    from torch.distributed._composable_state import _get_module_state

    return _get_module_state(module) is not None


@contextlib.contextmanager
def forward_methods_refused(active: bool = True):
    """While FSDP2 modules are traced (their forward hooks swapped for dtcompile's), FSDP2's
    own pre-forward, which a method that ``register_fsdp_forward_method`` wrapped calls, raises
    a TracingError before it changes anything (it would unshard the traced stand-ins)."""
    if not active:
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    original = FSDPState.__dict__["_pre_forward"]

    def _pre_forward(self, module, args, kwargs):
        raise TracingError(
            "dtcompile.jit: a method register_fsdp_forward_method wrapped (FSDP2 runs its pre- and post-forward "
            f"around it) is called inside the call, on {type(module).__name__}; not supported yet: call it from forward()"
        )

    FSDPState._pre_forward = _pre_forward
    try:
        yield
    finally:
        FSDPState._pre_forward = original
