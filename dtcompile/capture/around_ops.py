"""The user's code torch runs around the call's ops, besides the code the call names: the
global module hooks, the torch function modes of the user's classes, the saved tensors
hooks. What it reads is guarded (``python_state.follow``), what it changes is the user's
data (``snapshots.user_data``), and the modes' state is compared at each call
(``jit/state_guards.py``)."""

from __future__ import annotations

import torch

from ..core import TracingError
from ..core.torch_internals import function_modes, mutation_on_saved_allowed, saved_tensors_hooks
from .python_reads import value_key
from .user_code import is_library

GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)
_GLOBAL_HOOK_TABLES = [vars(torch.nn.modules.module)[name] for name in GLOBAL_HOOKS]


def user_global_hooks() -> tuple:
    """The global module hooks (``register_module_forward_hook``) not from torch itself,
    with their keys, table by table (torch's own observers, ``CommDebugMode``'s module
    tracker, change nothing)."""
    return tuple(
        tuple(item for item in table.items() if not getattr(item[1], "__module__", "").startswith("torch."))
        if table
        else ()
        for table in _GLOBAL_HOOK_TABLES
    )


def function_mode_states() -> list:
    """Each torch function mode active (innermost last): its class and, for a user's, its
    attributes (by value, objects by identity; a library's are not guarded, as elsewhere:
    a default device's is, apart). The program holds what the modes did while tracing, and
    ``with Mode():`` makes a new one at each call."""
    return [(type(mode), None if is_library(type(mode)) else value_key(vars(mode))) for mode in function_modes()]


def user_global_hook_functions() -> list[tuple[str, object]]:
    """``(description, hook)`` for each global module hook not from torch: they run around
    every module call, so what they read is guarded and what they change is the user's
    data, as a module's own hooks."""
    return [
        (f"the global module hook {getattr(hook, '__qualname__', hook)} ({table.strip('_')})", hook)
        for table, items in zip(GLOBAL_HOOKS, user_global_hooks())
        for _, hook in items
        if table != "_global_forward_hooks_with_kwargs" and table != "_global_forward_hooks_always_called"
    ]


def user_function_modes() -> list:
    """The torch function modes of the user's classes active now."""
    return [mode for mode in function_modes() if not is_library(type(mode))]


def code_around_ops() -> list[tuple[str, object]]:
    """``(description, code)`` for what torch's global state runs around the call's ops, whose
    reads are guarded: the global module hooks, the user's torch function modes' classes,
    the saved tensors hooks (those of ``allow_mutation_on_saved_tensors()``, with gradients,
    refused: ``refuse_mutation_on_saved``)."""
    if torch.is_grad_enabled():
        refuse_mutation_on_saved()
    modes = [(f"the torch function mode {type(mode).__qualname__}", type(mode)) for mode in user_function_modes()]
    saved = [(f"the saved tensors hook {hook}", hook) for hook in saved_tensors_hooks() or ()]
    return user_global_hook_functions() + modes + saved


def refuse_mutation_on_saved() -> None:
    """A call that needs gradients under ``allow_mutation_on_saved_tensors()``: eager's saved
    tensors are cloned when written after the call; a compiled step saves its own, which
    that context does not see (its backward would raise autograd's in-place error), and
    its hooks cannot be traced with symbolic sizes."""
    if mutation_on_saved_allowed():
        raise TracingError(
            "dtcompile.jit: a call that needs gradients under torch.autograd.graph.allow_mutation_on_saved_tensors() "
            "is not supported: the compiled step saves its tensors itself, which that context does not clone "
            "when they are written. Call it outside the context"
        )
