"""The nvFuser executor: regions of the per-rank trace run as fusions (see executor.py)."""

from .executor import CACHE, FusionExecutor, FusionRegion
from .program import FusionProgram

__all__ = ["CACHE", "FusionExecutor", "FusionProgram", "FusionRegion"]
