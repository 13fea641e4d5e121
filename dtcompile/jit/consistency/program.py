"""What of a per-rank program must be equal on every rank: its collectives.

Ranks that run different collectives hang at the first one that differs (or Gloo aborts
on mismatched sizes). Local arithmetic may differ freely (``x * (1.0 + rank)`` runs as in
eager), and so may local sizes with uneven shards and the pads and narrows DTensor adds
for them. So a program is compared as the sequence of its collectives: kind, process
group (as a rank-independent mesh-dim label), reduce op and other constant arguments and
dtype, on every rank; and the shapes of collectives whose inputs must be equally sized,
by the ranks of each collective's group only. On a 2x2 mesh the two groups of a mesh dim
may gather shards of different sizes (5 rows split 3 and 2, then 2, 1 and 1, 1).
"""

from __future__ import annotations

import difflib
import re
from typing import NamedTuple

import torch.distributed as dist

from ...core import TensorProxy, Trace, is_proxy
from ...core.block_call import with_block_symbols
from ...core.op_classes import group_name, is_collective
from ...core.printing import Unprintable, python_literal
from ...core.torch_internals import resolve_process_group

# Collectives whose input sizes may differ between ranks (explicit split sizes).
_RAGGED = ("all_to_all_single", "alltoall_base", "all_to_all")


def _describe(value: object, group_labels: dict[str, str], sizes: bool) -> str:
    if isinstance(value, TensorProxy):
        dtype = str(value.dtype).removeprefix("torch.")
        if not sizes:
            return f"T:{dtype}"
        shape = ",".join(str(s) if isinstance(s, int) else "?" for s in value.shape)
        return f"T:{dtype}[{shape}]"
    if is_proxy(value) or (not sizes and type(value) is int):
        return "N"  # a traced number or a ragged split size: a local size, which may differ
    if isinstance(value, str):
        return repr(group_labels.get(value, value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v, group_labels, sizes) for v in value) + "]"
    if isinstance(value, (bool, int, float)) or value is None:
        return repr(value)
    try:
        return python_literal(value)
    except Unprintable:
        return type(value).__name__


class CollectiveLine(NamedTuple):
    """One collective of a program: ``line`` equal on every rank of a program that cannot
    hang, ``sized`` (with its tensors' shapes) equal on the ranks of ``group``."""

    line: str
    sized: str
    group: tuple[int, ...] | None  # None: a group not known here, compared with every rank


_SHAPES = re.compile(r"(T:\w+)\[[^\]]*\]")


def collective_lines(trace: Trace, group_labels: dict[str, str]) -> list[CollectiveLine]:
    """The trace's collectives, in order."""
    lines = []
    for bsym in with_block_symbols(trace.bound_symbols):
        if not is_collective(bsym.op):
            continue
        sizes = bsym.op._schema.name.split("::")[-1] not in _RAGGED
        args = [_describe(a, group_labels, sizes) for a in bsym.args]
        args += [f"{k}={_describe(v, group_labels, sizes)}" for k, v in bsym.kwargs.items()]
        sized = f"{bsym.symbol.name}({', '.join(args)})"
        lines.append(CollectiveLine(_SHAPES.sub(r"\1", sized), sized, _group_ranks(group_name(bsym))))
    return lines


def _group_ranks(group: object) -> tuple[int, ...] | None:
    if not isinstance(group, str):
        return None
    try:
        return tuple(dist.get_process_group_ranks(resolve_process_group(group)))
    except (KeyError, ValueError, RuntimeError):  # not a live group
        return None


def first_difference(mine: list[str], theirs: list[str]) -> tuple[int, str, str] | None:
    """The first line where two programs' descriptions differ, if any. A symbolic size
    (``?``) may equal any size at run time: lines alike but for one are not a difference
    (a rank whose local sizes specialized while tracing, where its peer's stayed symbolic)."""
    theirs = [m if i < len(mine) and _alike(m := mine[i], t) else t for i, t in enumerate(theirs)]
    matcher = difflib.SequenceMatcher(a=mine, b=theirs, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            return i1, "\n    ".join(mine[i1:i2]) or "(nothing)", "\n    ".join(theirs[j1:j2]) or "(nothing)"
    return None


_DIMS = re.compile(r"T:\w+\[([^\]]*)\]")


def _alike(a: str, b: str) -> bool:
    if a == b:
        return True
    if _SHAPES.sub(r"\1", a) != _SHAPES.sub(r"\1", b):
        return False
    for x, y in zip(_DIMS.findall(a), _DIMS.findall(b)):
        dims_x, dims_y = x.split(","), y.split(",")
        if len(dims_x) != len(dims_y) or any(i != j and "?" not in (i, j) for i, j in zip(dims_x, dims_y)):
            return False
    return True


def collective_ranks(trace: Trace) -> set[int]:
    """The ranks of the process groups the trace's collectives run on. A DTensor the
    function makes itself (``DTensor.from_local`` of a plain tensor argument) has no mesh
    among the inputs, but its collectives still need every rank of their group."""
    ranks: set[int] = set()
    for bsym in with_block_symbols(trace.bound_symbols):
        group = group_name(bsym) if is_collective(bsym.op) else None
        if isinstance(group, str):
            ranks.update(dist.get_process_group_ranks(resolve_process_group(group)))
    return ranks


def group_labels(meshes, trace: Trace | None = None) -> dict[str, str]:
    """A rank-independent label for each process group of the meshes: the mesh dim's name
    (``tp``), or ``mesh0.dim1`` for unnamed dims.

    A group that ``trace``'s collectives run on and that no mesh holds, but with the ranks
    of a mesh dim's group, gets that dim's label: DTensor caches sharding decisions by
    spec, and specs compare meshes by layout, so an op on a mesh can run its collectives
    on the groups of an earlier mesh equal to it (eager DTensor does the same). Each rank
    has its own group of such a dim, under its own name. Any other group is labelled by
    its layout, the steps between its ranks (``new_group`` rows ``[0, 1]``, ``[2, 3]`` and
    columns ``[0, 2]``, ``[1, 3]`` of hand-written 2-D parallelism: each rank calls its own
    row's, as the ranks of one mesh dim do)."""
    labels: dict[str, str] = {}
    by_ranks: dict[tuple[int, ...], str] = {}
    for m, mesh in enumerate(meshes):
        names = mesh.mesh_dim_names
        for d in range(mesh.ndim):
            group, label = mesh.get_group(d), names[d] if names else f"mesh{m}.dim{d}"
            labels.setdefault(group.group_name, label)
            by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), label)
    for bsym in with_block_symbols(trace.bound_symbols) if trace is not None else ():
        group = group_name(bsym) if is_collective(bsym.op) else None
        if not isinstance(group, str) or group in labels:
            continue
        try:
            ranks = tuple(dist.get_process_group_ranks(resolve_process_group(group)))
        except (KeyError, ValueError, RuntimeError):  # not a live group: left as named
            continue
        if ranks in by_ranks:
            labels[group] = by_ranks[ranks]
        elif len(ranks) > 1:  # ``new_group`` rows and columns: each rank its own, alike in layout
            steps = ",".join(str(b - a) for a, b in zip(ranks, ranks[1:]))
            labels[group] = f"a group of {len(ranks)} ranks {steps} apart"
    return labels
