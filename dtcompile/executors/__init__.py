"""Executors: what runs each symbol of a per-rank trace."""

import torch

from .base import Executor, LoweringContext, NoExecutorError, lower
from .collectives import CollectivesExecutor
from .fusion import FusionExecutor
from .torch_executor import TorchExecutor

AVAILABLE = {
    "torch": TorchExecutor,
    "collectives": CollectivesExecutor,
    "nvfuser": lambda: FusionExecutor("nvfuser_direct"),
    "nvfuser:reference": lambda: FusionExecutor("reference"),
}
DEFAULT = ("collectives", "torch")
DEFAULT_CUDA = ("collectives", "nvfuser", "torch")


def default_executors(devices) -> tuple[str, ...]:
    """The executors of a call whose tensors are on ``devices``: nvFuser where a tensor is
    on CUDA and nvFuser is available."""
    if any(torch.device(d).type == "cuda" for d in devices) and FusionExecutor("nvfuser_direct").available:
        return DEFAULT_CUDA
    return DEFAULT


def resolve_executors(names, devices=()) -> list[Executor]:
    """Executor objects for a list of names (or executor objects), in claiming order; the
    collectives executor goes first when the list does not name it (collectives are never
    fused)."""
    names = list(default_executors(devices) if names is None else names)
    for item in names:
        if isinstance(item, str) and item not in AVAILABLE:
            raise ValueError(f"dtcompile: unknown executor {item!r}; available: {sorted(AVAILABLE)}")
        if not isinstance(item, (str, Executor)):
            raise ValueError(
                f"dtcompile: executors must be names or dtcompile.executors.Executor objects, not {item!r}"
            )
    if not any(item == "collectives" or isinstance(item, CollectivesExecutor) for item in names):
        names.insert(0, "collectives")
    return [AVAILABLE[item]() if isinstance(item, str) else item for item in names]


__all__ = [
    "AVAILABLE",
    "CollectivesExecutor",
    "Executor",
    "FusionExecutor",
    "LoweringContext",
    "NoExecutorError",
    "TorchExecutor",
    "lower",
    "default_executors",
    "resolve_executors",
]
