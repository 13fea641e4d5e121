"""Every op of the op-info table, over every placement of its inputs, compiled and compared
with eager DTensor on Gloo ranks.

For each op (see ``opinfo.py``) and each combination of input placements on a 1-D mesh,
the ranks call the op eagerly on DTensors and through ``dtcompile.jit``, and compare the
result: its type, placements, global shape and stride, local shape and stride, dtype and
values; where eager raises, the compiled call must raise the same exception type. All
cases of an op run in one ``pool.run`` call; the test then lists every failing case.

The gradient tests (``test_op_grad[op]``) run every differentiable op of the table the
same way with grad mode on and its floating-point inputs requiring grad: both sides
reduce each output to a scalar with a fixed random weighting, ``(out * w).sum()`` with
``w`` distributed like the output (so the compiled backward gets cotangents with the
output's placements and non-trivial values), take ``torch.autograd.grad`` of those
scalars with respect to the inputs, and compare outputs and gradients as above. A few
ops also run with ``.backward()`` twice (``.grad`` accumulates, the second call hits the
cache), and a few cases reduce the output in a way that sends the compiled backward a
cotangent with other placements than the output's.

Some ops also run on a 2x2 mesh of four ranks (``test_ops_on_a_2d_mesh``, and with
gradients ``test_op_grads_on_a_2d_mesh``): each tensor input takes a placement per mesh
dim, ``(Shard(0), Partial())``, and each op a fixed sample of such cases (``cases_2d``),
compared with eager as above.
"""

from __future__ import annotations

import itertools
import random
import traceback

import pytest
import torch
import torch.distributed as dist
from opinfo import (
    GRAD_OPS,
    OPS,
    OPS_BY_NAME,
    OpInfo,
    TensorArg,
    global_inputs,
    partial_locals,
    placement_choices,
    seed_of,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _MaskPartial
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
    """``S0``, ``R``, ``P``; on a 2-D mesh, a placement per mesh dim: ``(S0,R)``."""
    if isinstance(placement, tuple):
        return f"({','.join(_short(p) for p in placement)})"
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
    (no communication); a Partial one from per-rank parts that sum to its shard of
    ``value``. ``placement``: one placement, or on a 2-D mesh a tuple of one per mesh dim."""
    placements = placement if isinstance(placement, tuple) else (placement,)
    sharded = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(value, mesh, sharded, src_data_rank=None)
    partial_dims = [d for d, p in enumerate(placements) if p.is_partial()]
    if not partial_dims:
        return local
    # This rank's part among the ranks that differ only in the partial mesh dims.
    coordinate, parts, index = mesh.get_coordinate(), 1, 0
    for d in partial_dims:
        index, parts = index * mesh.size(d) + coordinate[d], parts * mesh.size(d)
    part = partial_locals(local.to_local(), parts, seed)[index]
    return DTensor.from_local(part, mesh, placements, run_check=False, shape=value.shape, stride=value.stride())


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
    # Where eager's full_tensor() raises (see ``_full_tensor``), the compiled result's must
    # raise alike; their local values are still compared.
    if compare_values:
        (full_got, got_error), (full_expected, expected_error) = (_call(_full_tensor, [v]) for v in (got, expected))
    problems = (
        []
        if got.placements == expected.placements
        else [f"placements {got.placements} != eager's {expected.placements}"]
    )
    problems += _compare_metadata("global", got, expected)
    problems += _compare_metadata("local", got._local_tensor, expected._local_tensor)
    if compare_values and not problems:
        problems += _compare_values("local", got._local_tensor, expected._local_tensor)
        if expected_error is None and got_error is None:
            problems += _compare_values("full_tensor()", full_got, full_expected)
        elif type(got_error) is not type(expected_error):
            eager, compiled = (_describe_error(e) if e else "nothing" for e in (expected_error, got_error))
            problems.append(f"full_tensor() raised {compiled}; eager's raised {eager}")
    return problems


def _full_tensor(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()``. A row-wise embedding's result sharded on another mesh dim,
    ``(_MaskPartial, Shard(0))``, is reduced first: DTensor's ``full_tensor`` gathers the
    shards first and then applies the index mask kept for the local shard, which no
    longer fits (an IndexError in ``_MaskPartial``'s mask buffer, torch 2.13), for eager's
    result as for the compiled one. Some embeddings on a 2-D mesh keep a mask that fits
    no shard of their result (indices ``(R, P)`` with a weight ``(S0, R)``, indices
    ``(S0, R)`` with a weight ``(S1, S0)``): reducing those raises, in eager too."""
    if _masked(value) and value.device_mesh.ndim > 1:
        reduced = [Replicate() if p.is_partial() else p for p in value.placements]
        value = value.redistribute(value.device_mesh, reduced)
    return value.full_tensor()


def _masked(value) -> bool:
    """Whether ``value`` is a row-wise embedding's result, whose pending reduction needs
    the index mask DTensor keeps on its placement and drops once it is reduced."""
    return isinstance(value, DTensor) and any(isinstance(p, _MaskPartial) for p in value.placements)


def compare_outputs(got, expected, compare_values: bool, reduced: bool = False) -> str | None:
    """What differs between the compiled call's result and eager's. ``reduced``: a loss has
    been computed from the results, so an embedding's masked result cannot be reduced
    again; its values are then left to the gradients' comparison."""
    got_leaves, got_spec = tree_flatten(got)
    expected_leaves, expected_spec = tree_flatten(expected)
    if got_spec != expected_spec:
        return f"output structure {got_spec} != eager's {expected_spec}"
    problems = []
    for i, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
        values = compare_values and not (reduced and _masked(e))
        problems += [f"output {i}: {p}" for p in compare_leaf(g, e, values)]
    return "; ".join(problems) or None


def check_case(op: OpInfo, placements, mesh, executors=None) -> str | None:
    """None when the compiled op behaves as eager DTensor does; else what differs.

    The compiled call goes first: a row-wise embedding's output keeps its index mask on a
    placement DTensor caches and shares between calls, and eager's call may add its own
    (equal) mask to it, but a trace cannot compare its proxy mask with a pending real one."""
    got, got_error = _call(dtcompile.jit(op.fn, executors=executors), call_args(op, placements, mesh))
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


def _run_cases(check, names: list[str]) -> list[tuple[str, str | None]]:
    """``(case id, failure or None)`` for every placement combination of the named ops."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    for name in names:
        op = OPS_BY_NAME[name]
        for case_id, placements in cases(op, mesh.size()):
            try:
                results.append((case_id, check(op, placements, mesh)))
            except Exception as error:  # a failure of the comparison itself
                results.append((case_id, f"comparing raised {_describe_error(error)}"))
    return results


def run_ops(names: list[str]) -> list[tuple[str, str | None]]:
    """Rank function: every case of the named ops, under no_grad."""
    with torch.no_grad():
        return _run_cases(check_case, names)


# --- on a 2-D mesh, on the ranks ----------------------------------------------------------------


def cases_2d(op: OpInfo, mesh_shape: tuple[int, int], count: int):
    """``(case id, placements of the tensor inputs)`` on a 2-D mesh, each input's
    placements a pair (mesh dim 0, mesh dim 1). The candidates are every combination of a
    1-D case (``cases``) on each mesh dim in which a tensor dim sharded on both mesh dims
    divides by both sizes; of these, a fixed sample of ``count`` (seeded by the op's name,
    so that every rank and every run takes the same)."""
    first, second = ([placements for _, placements in cases(op, size)] for size in mesh_shape)
    candidates = [tuple(zip(a, b)) for a in first for b in second]
    candidates = [placements for placements in candidates if _divides(op, placements, mesh_shape)]
    if len(candidates) > count:
        candidates = random.Random(seed_of(op.name)).sample(candidates, count)
    for placements in candidates:
        yield f"{op.name}[{','.join(_short(p) for p in placements)}]", placements


def _divides(op: OpInfo, placements, mesh_shape) -> bool:
    """Whether each tensor dim is split into as many shards as its size divides into (a
    dim sharded on both mesh dims of a 2x2 mesh: 4)."""
    for i, pair in zip(op.tensor_positions, placements):
        for dim in {p.dim for p in pair if isinstance(p, Shard)}:
            shards = 1
            for size, p in zip(mesh_shape, pair):
                shards *= size if p == Shard(dim) else 1
            if op.args[i].shape[dim] % shards:
                return False
    return True


def run_ops_2d(counts: dict[str, int], grad: bool = False) -> list[tuple[str, str | None]]:
    """Rank function: ``counts[name]`` cases (``cases_2d``) of each named op on a 2x2 mesh
    of the four ranks, under no_grad, or with gradients."""
    mesh = init_device_mesh("cpu", (2, 2))
    check = check_grad_case if grad else check_case
    results = []
    with torch.enable_grad() if grad else torch.no_grad():
        for name, count in counts.items():
            op = OPS_BY_NAME[name]
            for case_id, placements in cases_2d(op, tuple(mesh.shape), count):
                try:
                    results.append((case_id, check(op, placements, mesh)))
                except Exception as error:  # a failure of the comparison itself
                    results.append((case_id, f"comparing raised {_describe_error(error)}"))
    return results


# --- gradients, on the ranks -------------------------------------------------------------------


class NoDifferentiableOutput(RuntimeError):
    """None of a call's outputs requires grad: there is nothing to differentiate."""


def grad_call_args(op: OpInfo, placements, mesh) -> tuple[list, list]:
    """The op's arguments with its floating-point inputs made leaves that require grad
    (DTensors built by ``from_local`` detached first, so that they are leaves), and those
    leaves."""
    values = call_args(op, placements, mesh)
    leaves = []
    for i in op.grad_positions:
        values[i] = values[i].detach().requires_grad_()
        leaves.append(values[i])
    return values, leaves


def cotangent_weight(out: torch.Tensor, seed: int) -> torch.Tensor:
    """A seeded random tensor of ``out``'s global shape, distributed like ``out`` (its
    placements, ``_StridedShard`` included, with Partial made Replicate): ``(out * w).sum()``
    then sends ``w`` to ``out``'s backward with the placements the compiled backward was
    traced for (see ``OTHER_COTANGENT_CASES`` for cotangents that arrive otherwise)."""
    generator = torch.Generator().manual_seed(seed)
    value = torch.randn(out.shape, generator=generator).to(out.dtype)
    if not isinstance(out, DTensor):
        return value
    mesh = out.device_mesh
    replicated = distribute_tensor(value, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
    return replicated.redistribute(mesh, [Replicate() if p.is_partial() else p for p in out.placements])


def loss_terms(op: OpInfo, outputs) -> list[torch.Tensor]:
    """One scalar per differentiable output: its weighted sum."""
    terms = []
    for i, leaf in enumerate(tree_flatten(outputs)[0]):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            terms.append((leaf * cotangent_weight(leaf, seed_of(f"{op.name} cotangent {i}"))).sum())
    if not terms:
        raise NoDifferentiableOutput(f"no output of {op.name} requires grad")
    return terms


def _forward_and_grads(fn, op: OpInfo, args: list, leaves: list, loss=loss_terms):
    """``(outputs, gradients of the loss with respect to leaves)``, or the error raised."""
    try:
        outputs = fn(*args)
        grads = torch.autograd.grad(loss(op, outputs), leaves, allow_unused=True)
        return (outputs, grads), None
    except NoDifferentiableOutput:
        raise
    except Exception as error:  # compared with the other side's
        return None, error


def compare_grads(got: tuple, expected: tuple, same_placements: bool = True) -> str | None:
    """What differs between the compiled call's gradients and eager's (None: nothing).
    With ``same_placements=False`` DTensor gradients are compared by value only."""
    problems = []
    for i, (g, e) in enumerate(zip(got, expected)):
        if e is None or g is None:
            if (e is None) != (g is None):
                problems.append(f"grad {i}: {'None' if g is None else 'a gradient'}; eager's is {e!r}")
            continue
        if not same_placements and isinstance(e, DTensor):
            if not isinstance(g, DTensor):
                problems.append(f"grad {i}: a {type(g).__name__}; eager's is a DTensor")
                continue
            problems += [f"grad {i}: {p}" for p in _compare_metadata("global", g, e)]
            problems += [f"grad {i}: {p}" for p in _compare_values("full_tensor()", g.full_tensor(), e.full_tensor())]
            continue
        problems += [f"grad {i}: {p}" for p in compare_leaf(g, e, True)]
    return "; ".join(problems) or None


def check_grad_case(
    op: OpInfo, placements, mesh, loss=loss_terms, same_placements: bool = True, executors=None
) -> str | None:
    """None when the compiled op's outputs and gradients are eager DTensor's; else what
    differs. Where eager raises, in its forward or its backward, the compiled call (whose
    backward is traced with its forward) must raise the same exception type."""
    jitted = dtcompile.jit(op.fn, executors=executors)
    got, got_error = _forward_and_grads(jitted, op, *grad_call_args(op, placements, mesh), loss=loss)
    try:
        expected, expected_error = _forward_and_grads(op.fn, op, *grad_call_args(op, placements, mesh), loss=loss)
    except NoDifferentiableOutput:
        return f"no output of eager's call requires grad: mark {op.name} grad=False in the table"
    if expected_error is not None:
        if got_error is None:
            return f"eager raised {_describe_error(expected_error)}; compiled did not"
        if type(got_error) is not type(expected_error):
            return f"eager raised {_describe_error(expected_error)}; compiled raised {_describe_error(got_error)}"
        return None
    if got_error is not None:
        return f"compiled raised {_describe_error(got_error)}"
    (got_outputs, got_grads), (expected_outputs, expected_grads) = got, expected
    problems = [
        compare_grads(got_grads, expected_grads, same_placements),
        compare_outputs(got_outputs, expected_outputs, True, reduced=True),
    ]
    return "; ".join(p for p in problems if p) or None


def run_grads(names: list[str]) -> list[tuple[str, str | None]]:
    """Rank function: the gradient case of every placement combination of the named ops."""
    with torch.enable_grad():
        return _run_cases(check_grad_case, names)


def check_backward_case(op: OpInfo, placements, mesh) -> str | None:
    """``loss.backward()`` twice through one jitted function (the second call hits its
    cache) and eagerly: the inputs' accumulated ``.grad`` must be eager's."""
    jitted = dtcompile.jit(op.fn)
    sides = []
    for fn in (jitted, op.fn):
        args, leaves = grad_call_args(op, placements, mesh)
        try:
            for _ in range(2):
                sum(loss_terms(op, fn(*args))).backward()
            sides.append(([leaf.grad for leaf in leaves], None))
        except NoDifferentiableOutput:
            raise
        except Exception as error:
            sides.append((None, error))
    (got, got_error), (expected, expected_error) = sides
    if expected_error is not None or got_error is not None:
        if type(got_error) is type(expected_error):
            return None
        return f"eager: {expected_error and _describe_error(expected_error)}; compiled: {got_error and _describe_error(got_error)}"
    if dtcompile.cache_misses(jitted) != 1 or dtcompile.cache_hits(jitted) != 1:
        return f"{dtcompile.cache_misses(jitted)} misses, {dtcompile.cache_hits(jitted)} hits; expected 1 and 1"
    return compare_grads(tuple(got), tuple(expected))


def run_backward(names: list[str]) -> list[tuple[str, str | None]]:
    """Rank function: the ``.backward()`` case of every placement combination of the named ops."""
    with torch.enable_grad():
        return _run_cases(check_backward_case, names)


def _redistributed_loss(op: OpInfo, outputs) -> list[torch.Tensor]:
    """The output made Replicate before it is weighted: its cotangent comes back through
    DTensor's redistribute backward (a Partial output's as Replicate)."""
    out = outputs.redistribute(outputs.device_mesh, [Replicate()])
    return [(out * cotangent_weight(out, seed_of(f"{op.name} redistributed"))).sum()]


def _summed_loss(op: OpInfo, outputs) -> list[torch.Tensor]:
    """``out.sum()`` of a sharded output: a Partial scalar, whose backward sends the output
    a Replicate cotangent, not one with the output's Shard placement."""
    return [outputs.sum()]


def _full_tensor_loss(op: OpInfo, outputs) -> list[torch.Tensor]:
    """A loss on the output's ``full_tensor()``: a plain tensor; the cotangent reaches the
    output through ``to_local`` and ``redistribute``'s backwards."""
    full = outputs.full_tensor()
    return [(full * cotangent_weight(full, seed_of(f"{op.name} full"))).sum()]


def _replicated_weight_loss(op: OpInfo, outputs) -> list[torch.Tensor]:
    """``(out * w).sum()`` with ``w`` Replicate whatever ``out``'s placements: the cotangent
    the mul's backward sends ``out`` is the sum's (Replicate) times ``w``: Replicate too."""
    w = cotangent_weight(outputs, seed_of(f"{op.name} replicated"))
    return [(outputs * w.redistribute(w.device_mesh, [Replicate()])).sum()]


def _row_sharded_weight_loss(op: OpInfo, outputs) -> list[torch.Tensor]:
    """``(out * w).sum()`` with ``w`` Shard(0): a Partial output is reduce-scattered to
    Shard(0) inside the mul, and its cotangent arrives Shard(0), not Replicate."""
    w = cotangent_weight(outputs, seed_of(f"{op.name} row-sharded"))
    return [(outputs * w.redistribute(w.device_mesh, [Shard(0)])).sum()]


LOSSES = {
    "redistributed": _redistributed_loss,
    "summed": _summed_loss,
    "full_tensor": _full_tensor_loss,
    "replicated_weight": _replicated_weight_loss,
    "row_sharded_weight": _row_sharded_weight_loss,
}


def run_other_cotangent(name: str, placements: list[str], loss: str) -> str | None:
    """Rank function: one case whose loss reduces the output its own way (``LOSSES``)."""
    op = OPS_BY_NAME[name]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    by_short = {_short(p): p for i in op.tensor_positions for p in placement_choices(op.args[i], mesh.size())}
    with torch.enable_grad():
        return check_grad_case(op, [by_short[p] for p in placements], mesh, LOSSES[loss], same_placements=False)


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
    _assert_no_failures(ranks4.run(run_ops, FOUR_RANK_OPS, timeout=300))


GRAD_FOUR_RANK_OPS = ["mm", "linear", "sum_dim", "softmax", "embedding", "layer_norm"]


def test_grad_table_covers_the_differentiable_ops():
    assert len(GRAD_OPS) >= 80
    assert {"mm", "softmax", "layer_norm", "embedding", "sdpa", "redistribute", "to_local"} <= {
        op.name for op in GRAD_OPS
    }


@pytest.mark.parametrize("name", [op.name for op in GRAD_OPS])
def test_op_grad(name, ranks2):
    _assert_no_failures(ranks2.run(run_grads, [name], timeout=180))


def test_op_grads_on_four_ranks(ranks4):
    _assert_no_failures(ranks4.run(run_grads, GRAD_FOUR_RANK_OPS, timeout=180))


# Ops whose sharding on a 2-D mesh depends on what the two mesh dims hold, and how many of
# their 2-D cases run (``cases_2d``: a fixed sample): matrix products (a contraction sharded
# on one mesh dim, the other dim sharding rows or holding a Partial), reductions that leave
# or take a Partial, softmax and layer norm along a dim another mesh dim shards, views
# that merge, split or move sharded dims, embedding (row-wise on one mesh dim), elementwise
# ops whose inputs are sharded differently, SDPA's math path, cat, and redistribution to
# Replicate over both dims.
MESH_2D_OPS = {
    "mm": 20,
    "linear": 8,
    "matmul": 6,
    "bmm": 6,
    "sum": 6,
    "sum_dim": 12,
    "mean_dim": 6,
    "amax_dim": 8,
    "var_dim": 6,
    "softmax": 12,
    "log_softmax": 6,
    "layer_norm": 8,
    "rms_norm": 6,
    "reshape": 10,
    "view_split_dim": 8,
    "flatten": 8,
    "transpose": 6,
    "permute": 8,
    "embedding": 16,
    "add_broadcast": 10,
    "mul": 10,
    "where": 8,
    "sdpa": 6,
    "cat": 8,
    "full_tensor": 6,
}
MESH_2D_GRAD_OPS = {
    "mm": 8,
    "linear": 4,
    "sum_dim": 6,
    "softmax": 6,
    "layer_norm": 6,
    "reshape": 4,
    "transpose": 4,
    "permute": 4,
    "embedding": 6,
    "add_broadcast": 4,
    "where": 4,
}


def test_2d_cases_place_every_input_on_both_mesh_dims():
    for name, count in MESH_2D_OPS.items():
        op = OPS_BY_NAME[name]
        chosen = list(cases_2d(op, (2, 2), count))
        assert len(chosen) == count and len({case_id for case_id, _ in chosen}) == count
        assert all(len(pair) == 2 for _, placements in chosen for pair in placements)
        # Some case holds different placements on the two mesh dims.
        assert any(pair[0] != pair[1] for _, placements in chosen for pair in placements), name


def test_ops_on_a_2d_mesh(ranks4):
    _assert_no_failures(ranks4.run(run_ops_2d, MESH_2D_OPS, timeout=300))


def test_op_grads_on_a_2d_mesh(ranks4):
    _assert_no_failures(ranks4.run(run_ops_2d, MESH_2D_GRAD_OPS, grad=True, timeout=300))


BACKWARD_OPS = ["mm", "softmax", "layer_norm_no_affine", "embedding", "redistribute"]


@pytest.mark.parametrize("name", BACKWARD_OPS)
def test_op_backward(name, ranks2):
    _assert_no_failures(ranks2.run(run_backward, [name], timeout=120))


# (op, placements of its inputs, how the loss reduces the output: see LOSSES). In some the
# cotangent comes back with the output's placements (a redistribute's backward restores
# them); in the others it arrives with other placements than the compiled backward was
# traced for. The compiled backward redistributes it to the traced placements (as the
# design says) and gives the gradients the traced backward's placements, where eager's
# backward propagates the arriving ones: the gradients' values must be eager's, their
# placements may differ (neg of a Shard(0) input with a Replicate cotangent: compiled
# Shard(0), eager Replicate).
OTHER_COTANGENT_CASES = [
    ("neg", ["S0"], "redistributed"),  # Shard(0) output; its cotangent comes back Shard(0)
    ("mm", ["S1", "S0"], "redistributed"),  # Partial output; its cotangent comes back Replicate
    ("sum_dim", ["S1"], "redistributed"),
    ("mm", ["S0", "S1"], "full_tensor"),
    ("neg", ["S0"], "summed"),  # Shard(0) output, Replicate cotangent
    ("mm", ["S0", "R"], "summed"),
    ("softmax", ["S1"], "summed"),
    ("layer_norm", ["S0", "R", "S0"], "summed"),
    ("flatten", ["S2"], "replicated_weight"),  # _StridedShard output, Replicate cotangent
    ("sum_dim", ["S1"], "row_sharded_weight"),  # Partial output, Shard(0) cotangent
    ("mm", ["S1", "S0"], "row_sharded_weight"),
]


@pytest.mark.parametrize(
    "name, placements, loss",
    OTHER_COTANGENT_CASES,
    ids=[f"{n}[{','.join(p)}]-{loss}" for n, p, loss in OTHER_COTANGENT_CASES],
)
def test_grad_with_other_cotangent_placements(name, placements, loss, ranks2):
    failures = [f for f in ranks2.run(run_other_cotangent, name, placements, loss) if f is not None]
    assert not failures, "\n".join(failures)


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
