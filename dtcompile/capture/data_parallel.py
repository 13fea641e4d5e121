"""Modules a call cannot run inside: TorchScript modules (run by TorchScript's interpreter,
which tracing cannot see into), and the data-parallel wrappers ``DistributedDataParallel``
and the composable ``replicate``.

Their forward drives a C++ reducer (``prepare_for_backward``, the buckets' ready marks),
which the gradients' hooks then act on. A compiled call runs that Python once, while
tracing: from the next call on, the reducer was never told of a backward, and each rank
kept its own gradients, silently. Refused, naming the wrapper; the module it wraps compiles,
with the wrapper outside (``DDP(dtcompile.jit(model))``), where its reducer runs at every
call as in eager. ``fully_shard`` is traced instead (``fsdp.py``).
"""

from __future__ import annotations

import torch
from torch.distributed._composable.contract import _get_registry

from ..core import TracingError


def _wrapper(module: torch.nn.Module) -> str | None:
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return "DistributedDataParallel"
    if "replicate" in (_get_registry(module) or {}):
        return "replicate"
    return None


def refuse_data_parallel(modules, what: str) -> None:
    """Raise where any of ``modules`` (or their submodules) is such a wrapper; ``what``
    says what the modules are to the call ("the module", "a module the function calls")."""
    for module in modules:
        for path, sub in module.named_modules():
            wrapper = _wrapper(sub)
            if wrapper is not None:
                where = f"{what}{f' (its {path!r})' if path else ''}"
                raise TracingError(
                    f"dtcompile.jit: {where} is wrapped by {wrapper}, whose reducer the call's Python sets up for "
                    "each backward, which a compiled call would run only once (the gradients no longer reduced). "
                    "Compile the module it wraps, and wrap the compiled module: DDP(dtcompile.jit(model)) runs the "
                    "reducer at every call"
                )


def refuse_torchscript(module: torch.nn.Module, path: str) -> None:
    if isinstance(module, torch.jit.ScriptModule):
        raise TracingError(
            f"dtcompile.jit: {path or 'the module'} is a TorchScript module (torch.jit.script or trace), which "
            "runs in TorchScript's interpreter, where dtcompile cannot trace it; call the nn.Module it was made from"
        )
