"""The nvFuser executor on Gloo ranks, on its reference backend.

The op-info table: every op over every placement combination, with the fusion executor
first in line (regions of one op fused too, matmuls included), compared with eager
DTensor as in ``test_ops.py`` (values, placements, local shapes and strides), forward
and with gradients. The reference backend runs each fusion program op by op with torch,
so this tests on CPU what the nvFuser executor adds: region forming, the translation of
each op into fusion primitives, the layout of fused outputs. Each rank reports which ops
were fused, so that a translation that silently stops applying fails here.

The MLP and the Llama-style block then run over sequence lengths under symbolic values
with the executor as users get it (regions of two ops or more, matmuls left to torch).
"""

import pytest
import torch
from opinfo import GRAD_OPS, OPS
from test_ops import _assert_no_failures, _run_cases, check_case, check_grad_case
from test_symbolic import KINDS, sequence_lengths

from dtcompile.executors import FusionExecutor
from dtcompile.executors.fusion import CACHE

# Ops of the table that compile no fusion: views alone (nothing to compute), ops the
# translation does not cover (cumsum, arange, max with indices, vector_norm, slicing,
# flash attention), collectives alone.
NOT_FUSED = {
    "add_arange",
    "chunk",
    "cumsum",
    "expand",
    "flatten",
    "max_dim",
    "narrow",
    "permute",
    "redistribute",
    "reshape",
    "reshape_size_arg",
    "sdpa_causal",
    "sdpa_fused_causal",
    "select",
    "slice",
    "slice_step",
    "split",
    "t",
    "transpose",
    "unsqueeze",
    "vector_norm",
    "view_split_dim",
}
# With gradients the backward of most of these computes (expand's is a sum, for one),
# and some forwards are taken whole by the flash attention kernel.
NOT_FUSED_WITH_GRADS = {
    "add_arange",
    "chunk",
    "cumsum",
    "flatten",
    "narrow",
    "permute",
    "reshape",
    "reshape_size_arg",
    "sdpa_causal",
    "sdpa_fused",
    "sdpa_fused_causal",
    "select",
    "slice",
    "slice_step",
    "split",
    "t",
    "transpose",
    "unsqueeze",
    "view_split_dim",
}


def every_op_fused():
    return [FusionExecutor("reference", min_ops=1, fuse_matmul=True), "torch"]


def _run_fused(check, names) -> tuple[list, list[str]]:
    """The cases' results, and the names of the ops that compiled at least one fusion."""
    results, fused = [], []
    for name in names:
        CACHE.clear()
        results += _run_cases(
            lambda op, placements, mesh: check(op, placements, mesh, executors=every_op_fused()), [name]
        )
        if CACHE.misses:
            fused.append(name)
    return results, fused


def run_fused_ops(names):
    with torch.no_grad():
        return _run_fused(check_case, names)


def run_fused_grads(names):
    with torch.enable_grad():
        return _run_fused(check_grad_case, names)


def _check(per_rank, names, not_fused):
    _assert_no_failures([results for results, _ in per_rank])
    fused = [set(ops) for _, ops in per_rank]
    assert all(f == fused[0] for f in fused), "the ranks fused different ops"
    assert set(names) - fused[0] == not_fused & set(names)


# The table in parts, each a test of its own: pytest-xdist spreads them over its workers.
PARTS = 4


@pytest.mark.parametrize("part", range(PARTS))
def test_nvfuser_reference_op_table(ranks2, part):
    names = [op.name for op in OPS][part::PARTS]
    _check(ranks2.run(run_fused_ops, names, timeout=600), names, NOT_FUSED)


@pytest.mark.parametrize("part", range(PARTS))
def test_nvfuser_reference_op_grads(ranks2, part):
    names = [op.name for op in GRAD_OPS][part::PARTS]
    _check(ranks2.run(run_fused_grads, names, timeout=600), names, NOT_FUSED_WITH_GRADS)


def fused_sequence_lengths():
    CACHE.clear()
    results = sequence_lengths((2,), KINDS, executors=["nvfuser:reference", "torch"])
    texts = [text for _, text in CACHE.fusions]
    return results, len(texts), sum(": int" in t or "= size(" in t for t in texts)


def test_nvfuser_reference_models_over_sequence_lengths(ranks2):
    for results, fusions, symbolic in ranks2.run(fused_sequence_lengths):
        for case, (misses, hits, calls) in results.items():
            assert (misses, hits) == (1, calls - 1), case
        assert fusions >= 6 and symbolic >= 1, (fusions, symbolic)


def test_the_lists_of_unfused_ops_name_ops_of_the_table():
    assert NOT_FUSED <= {op.name for op in OPS}
    assert NOT_FUSED_WITH_GRADS <= {op.name for op in GRAD_OPS}
