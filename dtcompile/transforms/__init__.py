"""Passes over traces. Each takes a trace and returns a new one; none mutates its input."""

from .all_reduce_sums import combine_all_reduces
from .autodiff import SplitTraces, saved_note, split_forward_backward
from .cse import cse
from .dce import dce
from .effects import has_side_effects, mutates, returns_alias, storage_bases
from .sizes import UnmaterializableSizeError, has_symbolic_sizes, materialize_sizes
from .views import remove_identity_views

__all__ = [
    "UnmaterializableSizeError",
    "has_symbolic_sizes",
    "materialize_sizes",
    "SplitTraces",
    "saved_note",
    "split_forward_backward",
    "combine_all_reduces",
    "cse",
    "dce",
    "has_side_effects",
    "mutates",
    "remove_identity_views",
    "returns_alias",
    "storage_bases",
]
