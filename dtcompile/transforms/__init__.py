"""Passes over traces. Each takes a trace and returns a new one; none mutates its input."""

from . import pipelines
from .all_reduce_sums import combine_all_reduces
from .copies import remove_redundant_copies
from .cse import cse
from .dce import dce
from .effects import has_side_effects, mutates, storage_bases
from .linear import fuse_linears
from .schedule import schedule_collectives
from .sizes import UnmaterializableSizeError, has_symbolic_sizes, materialize_sizes
from .split import SplitTraces, saved_note, split_forward_backward
from .views import collapse_view_chains, remove_identity_views

__all__ = [
    "pipelines",
    "UnmaterializableSizeError",
    "has_symbolic_sizes",
    "materialize_sizes",
    "SplitTraces",
    "saved_note",
    "split_forward_backward",
    "combine_all_reduces",
    "collapse_view_chains",
    "cse",
    "dce",
    "fuse_linears",
    "has_side_effects",
    "mutates",
    "remove_identity_views",
    "remove_redundant_copies",
    "schedule_collectives",
    "storage_bases",
]
