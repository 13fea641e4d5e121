"""Executors: what runs each symbol of a per-rank trace."""

from .base import Executor, LoweringContext, NoExecutorError, lower
from .collectives import CollectivesExecutor
from .torch_executor import TorchExecutor

AVAILABLE = {"torch": TorchExecutor, "collectives": CollectivesExecutor}
DEFAULT = ("collectives", "torch")


def resolve_executors(names) -> list[Executor]:
    """Executor objects for a list of names (or executor objects), in claiming order."""
    chosen = []
    for item in DEFAULT if names is None else names:
        if isinstance(item, str):
            if item not in AVAILABLE:
                raise ValueError(f"dtcompile: unknown executor {item!r}; available: {sorted(AVAILABLE)}")
            chosen.append(AVAILABLE[item]())
        else:
            chosen.append(item)
    return chosen


__all__ = [
    "AVAILABLE",
    "CollectivesExecutor",
    "Executor",
    "LoweringContext",
    "NoExecutorError",
    "TorchExecutor",
    "lower",
    "resolve_executors",
]
