"""The pass pipelines, declared in one place: which passes each kind of trace runs, in
which order, and why.

- **Sizes** (symbolic values only) come first everywhere: every size the trace uses is
  computed in the trace (``materialize_sizes``), one producer per value (DCE), before CSE
  compares the symbols that read them.
- **Inference**: linear layers are matched before view chains are collapsed (a chain would
  swallow the view that closes a linear); redundant views and copies go before CSE, which
  compares what they leave; all-reduces of summed partials are combined; DCE drops what
  they all made dead.
- **The joint training trace** (forward and backward together) only takes the passes that
  rename values: identity views, view chains and CSE, so that the forward and the
  backward agree on every name and a value both would compute is computed once, by the
  forward. The split (``split.py``) then decides what the forward saves.
- **Each training half** then takes what inference takes after the renaming passes:
  linear layers, combined all-reduces and DCE. The halves' outputs (the forward's saved
  values, the backward's gradients) are outputs like any other, which every pass keeps.
  Not yet redundant-copy removal: on the backward of ``torch.max(x, dim=1)`` over 2 ranks
  it removed a copy on one rank and not the other (the op-info gradient table with the
  fusion executor shows it), which is not understood yet.
- **Block programs** of a training call (a repeated block's forward, or its backward)
  take the joint trace's passes and then a half's, each program on its own.
- **Finish**: collectives are scheduled last (next to their inputs). Uneven shards make
  those differ between ranks (a pad on some ranks only), so the ranks' programs are
  compared before it; it keeps the collectives' order, so programs that agree before it
  cannot deadlock after.
"""

from __future__ import annotations

from ..core import Trace, verify
from ..core.typecheck import check_types, types_checked
from .all_reduce_sums import combine_all_reduces
from .copies import remove_redundant_copies
from .cse import cse
from .dce import dce
from .linear import fuse_linears
from .schedule import schedule_collectives
from .sizes import materialize_sizes
from .views import collapse_view_chains, remove_identity_views

SIZES = (materialize_sizes, dce)
INFERENCE = (
    remove_identity_views,
    fuse_linears,
    collapse_view_chains,
    remove_redundant_copies,
    cse,
    combine_all_reduces,
    dce,
)
JOINT = (remove_identity_views, collapse_view_chains, cse)
HALF = (fuse_linears, combine_all_reduces, dce)
FINISH = (schedule_collectives,)


def sizes(symbolic: bool) -> tuple:
    return SIZES if symbolic else ()


def inference_passes(symbolic: bool) -> tuple:
    """What an inference trace runs, the finish included."""
    return (*sizes(symbolic), *INFERENCE, *FINISH)


def half_passes(symbolic: bool) -> tuple:
    """What each half of a split training trace runs, the finish included."""
    return (*sizes(symbolic), *HALF, *FINISH)


def block_training_passes(symbolic: bool) -> tuple:
    """What a block program of a training call runs (``capture/block_calls.py``): a forward
    or a backward on its own, so the joint trace's renaming passes and then a half's."""
    return (*sizes(symbolic), *JOINT, *HALF, *FINISH)


def run_passes(trace: Trace, passes) -> list[Trace]:
    """The trace after each pass, in order (``trace`` first), each one verified (names; and
    types where ``DTCOMPILE_VERIFY_TYPES=1``)."""
    checked = types_checked()  # the tests check types at every pass (core/typecheck.py)
    if checked:
        check_types(trace)
    traces = [trace]
    for transform in passes:
        traces.append(transform(traces[-1]))
        verify(traces[-1])
        if checked:
            check_types(traces[-1])
    return traces


def before_finish(traces: list[Trace]) -> Trace:
    """The trace the ranks compare: the last before the finishing passes."""
    return traces[-1 - len(FINISH)]
