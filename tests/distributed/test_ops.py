"""Every op of the op-info table, over every placement of its inputs, compiled and compared
with eager DTensor on Gloo ranks.

For each op (see ``opinfo.py``) and each combination of input placements on a 1-D mesh,
the ranks call the op eagerly on DTensors and through ``dtcompile.jit``, and compare the
result: its type, placements, global shape and stride, local shape and stride, dtype and
values; where eager raises, the compiled call must raise the same exception type. All
cases of an op run in one ``pool.run`` call; the test then lists every failing case.
"""

from __future__ import annotations

import itertools
import traceback

import pytest
import torch
import torch.distributed as dist
from opinfo import OPS, OPS_BY_NAME, OpInfo, TensorArg, global_inputs, partial_locals, placement_choices, seed_of
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_flatten

import dtcompile

# Eager DTensor is a valid reference only when every rank picks the same sharding strategy.
# Its decomposition-based propagation (CPU SDPA, mv) breaks cost ties in the iteration order
# of a set of placements, which depends on str hashing through Partial's reduce op
# (DecompShardingStrategy._get_candidate_placements, torch 2.13): ranks with different hash
# seeds pick different strategies, and eager deadlocks or computes wrong values. The rank
# pool (harness.py) gives all ranks one seed.

# Some ops also run on a mesh of 4 ranks: the matrix products and reductions above all, whose
# collectives and partial results depend most on the mesh size.
FOUR_RANK_OPS = [
    "mm",
    "matmul",
    "linear",
    "bmm",
    "sum",
    "sum_dim",
    "mean_dim",
    "amax_dim",
    "softmax",
    "embedding",
    "layer_norm",
    "add_broadcast",
    "redistribute",
    "reshape",
]


# --- on the ranks ------------------------------------------------------------------------------


def _short(placement) -> str:
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    return "R" if isinstance(placement, Replicate) else "P"


def cases(op: OpInfo, world_size: int):
    """``(case id, placements of the tensor inputs)`` for every placement combination."""
    choices = [placement_choices(op.args[i], world_size) for i in op.tensor_positions]
    for combination in itertools.product(*choices):
        yield f"{op.name}[{','.join(_short(p) for p in combination)}]", combination


def distribute(value: torch.Tensor, placement, mesh, seed: int) -> DTensor:
    """A DTensor of global value ``value``, built by every rank from the same global tensor
    (no communication); a Partial one from per-rank parts that sum to ``value``."""
    if isinstance(placement, Partial):
        local = partial_locals(value, mesh.size(), seed)[mesh.get_local_rank()]
        return DTensor.from_local(local, mesh, [placement], run_check=False, shape=value.shape, stride=value.stride())
    return distribute_tensor(value, mesh, [placement], src_data_rank=None)


def call_args(op: OpInfo, placements, mesh) -> list:
    values = global_inputs(op)
    for n, (i, placement) in enumerate(zip(op.tensor_positions, placements)):
        values[i] = distribute(values[i], placement, mesh, seed_of(f"{op.name} partial {n}"))
    return values


def _call(fn, args):
    try:
        return fn(*args), None
    except Exception as error:  # compared with the other side's
        return None, error


def _describe_error(error: Exception) -> str:
    where = traceback.extract_tb(error.__traceback__)[-1]
    message = " | ".join(line.strip() for line in str(error).strip().splitlines() if line.strip())
    return f"{type(error).__name__}: {message[:600]} (at {where.filename}:{where.lineno})"


def _compare_metadata(what: str, got: torch.Tensor, expected: torch.Tensor) -> list[str]:
    problems = []
    for attribute in ("shape", "dtype"):
        if getattr(got, attribute) != getattr(expected, attribute):
            problems.append(f"{what} {attribute} {getattr(got, attribute)} != eager's {getattr(expected, attribute)}")
    if got.stride() != expected.stride():  # strides are part of the result: views and kernels see them
        problems.append(f"{what} stride {got.stride()} != eager's {expected.stride()}")
    return problems


def _compare_values(what: str, got: torch.Tensor, expected: torch.Tensor) -> list[str]:
    try:
        torch.testing.assert_close(got, expected, equal_nan=True, check_stride=False)
    except AssertionError as error:
        return [f"{what} values differ: {' '.join(str(error).split())[:300]}"]
    return []


def compare_leaf(got, expected, compare_values: bool) -> list[str]:
    """What differs between a compiled output and eager's, as messages (none: the same)."""
    if not isinstance(expected, torch.Tensor):
        return [] if type(got) is type(expected) and got == expected else [f"{got!r} != eager's {expected!r}"]
    if not isinstance(expected, DTensor):
        # Eager may return an AsyncCollectiveTensor (a plain tensor waited lazily); the
        # compiled program returns the plain tensor itself.
        if type(got) is not torch.Tensor:
            return [f"type {type(got).__name__} != torch.Tensor (eager: {type(expected).__name__})"]
        problems = _compare_metadata("tensor", got, expected)
        return problems or (_compare_values("tensor", got, expected) if compare_values else [])
    if not isinstance(got, DTensor):
        return [f"type {type(got).__name__} != eager's DTensor"]
    # Both ranks reach this point for the same outputs, so the full_tensor collectives match.
    full_got, full_expected = got.full_tensor(), expected.full_tensor()
    problems = (
        []
        if got.placements == expected.placements
        else [f"placements {got.placements} != eager's {expected.placements}"]
    )
    problems += _compare_metadata("global", got, expected)
    problems += _compare_metadata("local", got._local_tensor, expected._local_tensor)
    if compare_values and not problems:
        problems += _compare_values("local", got._local_tensor, expected._local_tensor)
        problems += _compare_values("full_tensor()", full_got, full_expected)
    return problems


def compare_outputs(got, expected, compare_values: bool) -> str | None:
    got_leaves, got_spec = tree_flatten(got)
    expected_leaves, expected_spec = tree_flatten(expected)
    if got_spec != expected_spec:
        return f"output structure {got_spec} != eager's {expected_spec}"
    problems = []
    for i, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
        problems += [f"output {i}: {p}" for p in compare_leaf(g, e, compare_values)]
    return "; ".join(problems) or None


def check_case(op: OpInfo, placements, mesh) -> str | None:
    """None when the compiled op behaves as eager DTensor does; else what differs.

    The compiled call goes first: a row-wise embedding's output keeps its index mask on a
    placement DTensor caches and shares between calls, and eager's call may add its own
    (equal) mask to it, but a trace cannot compare its proxy mask with a pending real one."""
    got, got_error = _call(dtcompile.jit(op.fn), call_args(op, placements, mesh))
    expected, expected_error = _call(op.fn, call_args(op, placements, mesh))
    if expected_error is not None:
        if got_error is None:
            return f"eager raised {_describe_error(expected_error)}; compiled did not"
        if type(got_error) is not type(expected_error):
            return f"eager raised {_describe_error(expected_error)}; compiled raised {_describe_error(got_error)}"
        return None
    if got_error is not None:
        _reduce(expected)
        return f"compiled raised {_describe_error(got_error)}"

    return compare_outputs(got, expected, op.compare_values)


def _reduce(result) -> None:
    """Reduce eager's DTensor results, as the comparison does. A pending reduction can hold
    state DTensor shares between calls (a row-wise embedding's mask, kept on the cached
    _MaskPartial placement); left unreduced, it would fail the next case."""
    for leaf in tree_flatten(result)[0]:
        if isinstance(leaf, DTensor):
            leaf.full_tensor()


def run_ops(names: list[str]) -> list[tuple[str, str | None]]:
    """Rank function: every case of the named ops; ``(case id, failure or None)`` each."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    with torch.no_grad():
        for name in names:
            op = OPS_BY_NAME[name]
            for case_id, placements in cases(op, mesh.size()):
                try:
                    results.append((case_id, check_case(op, placements, mesh)))
                except Exception as error:  # a failure of the comparison itself
                    results.append((case_id, f"comparing raised {_describe_error(error)}"))
    return results


def collectives_of_case(name: str, placements: list[str]) -> tuple[dict, dict]:
    """Rank function: the collectives eager DTensor issues for one case (from CommDebugMode)
    and those of the compiled execution trace, as ``{collective name: count}``."""
    op = OPS_BY_NAME[name]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    by_short = {_short(p): p for i in op.tensor_positions for p in placement_choices(op.args[i], mesh.size())}
    chosen = [by_short[p] for p in placements]
    with torch.no_grad():
        with CommDebugMode() as comm:
            op.fn(*call_args(op, chosen, mesh))
        jitted = dtcompile.jit(op.fn)
        jitted(*call_args(op, chosen, mesh))
    eager = {str(key).rsplit(".", 1)[-1]: count for key, count in comm.get_comm_counts().items() if count}
    compiled: dict[str, int] = {}
    for bsym in dtcompile.last_traces(jitted)[-1].bound_symbols:
        if bsym.op is not None and bsym.op.namespace == "_c10d_functional" and bsym.op._opname != "wait_tensor":
            compiled[bsym.op._opname] = compiled.get(bsym.op._opname, 0) + 1
    return eager, compiled


# --- in the pytest process ---------------------------------------------------------------------


def _assert_no_failures(per_rank: list[list[tuple[str, str | None]]]) -> None:
    failures: dict[str, list[str]] = {}
    for rank, results in enumerate(per_rank):
        for case_id, failure in results:
            if failure is not None:
                failures.setdefault(case_id, []).append(f"rank {rank}: {failure}")
    total = len(per_rank[0])
    report = "\n".join(f"{case_id}\n    " + "\n    ".join(lines) for case_id, lines in failures.items())
    assert not failures, f"{len(failures)} of {total} cases differ from eager DTensor:\n{report}"


def test_table_is_large_enough():
    assert len(OPS) >= 40
    assert all(any(isinstance(a, TensorArg) for a in op.args) for op in OPS)


@pytest.mark.parametrize("name", [op.name for op in OPS])
def test_op(name, ranks2):
    _assert_no_failures(ranks2.run(run_ops, [name], timeout=120))


def test_ops_on_four_ranks(ranks4):
    _assert_no_failures(ranks4.run(run_ops, FOUR_RANK_OPS, timeout=180))


# (op, placements of its tensor inputs, the collectives eager issues for it)
COLLECTIVE_CASES = [
    ("softmax", ["P"], {"all_reduce"}),  # a Partial input to an op that needs Replicate
    ("softmax", ["S2"], {"all_gather_into_tensor"}),  # sharded along the softmax dim
    ("sum_dim", ["S1"], set()),  # reducing a sharded dim leaves a Partial result, no collective
    ("mm", ["S1", "S0"], set()),  # contracting a sharded dim: Partial result
    ("mm", ["S0", "S0"], {"all_gather_into_tensor"}),  # the weight must be gathered
    ("sum", ["P"], set()),  # a sum of a Partial stays Partial
    ("amax", ["P"], {"all_reduce"}),  # a max of a Partial does not
    ("layer_norm", ["S2", "R", "R"], {"all_gather_into_tensor"}),
    ("linear", ["S2", "S1", "R"], set()),  # row-wise linear: a Partial result
    ("cat", ["S0", "R"], {"all_gather_into_tensor"}),
]


@pytest.mark.parametrize(
    "name, placements, kinds", COLLECTIVE_CASES, ids=[f"{n}[{','.join(p)}]" for n, p, _ in COLLECTIVE_CASES]
)
def test_trace_has_eagers_collectives(name, placements, kinds, ranks2):
    for eager, compiled in ranks2.run(collectives_of_case, name, placements):
        assert set(eager) == kinds, f"eager DTensor issued {eager}; the test expects {kinds}"
        assert compiled == eager, f"the execution trace has collectives {compiled}; eager issued {eager}"
