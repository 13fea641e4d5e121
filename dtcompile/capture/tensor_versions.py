"""What code can read of a tensor besides its metadata and values: whether it is a view
(``_is_view()``, ``_base``) and how often it was written (``_version``). Autograd keeps
both at dispatch; a call not dispatched (a replayed block, a checked layer's call) keeps
neither. The first call's writes are counted again on the later call's tensors
(:func:`count_writes`); a tensor made again is noted (:func:`made_again`), and the
annotator traces the call again where code reads whether it is a view (``VerifyFailed``)."""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version
from torch.distributed.tensor import DTensor


def versions(leaves: list) -> list:
    """Each tensor leaf's version counter, and its local tensor's where it is a DTensor
    (None for a leaf that is not a tensor or keeps none: an inference tensor)."""
    with torch._C.DisableTorchFunction():
        return [_version(leaf) for leaf in leaves]


def _version(leaf) -> tuple | None:
    if not isinstance(leaf, torch.Tensor) or leaf.is_inference():
        return None
    local = leaf._local_tensor if isinstance(leaf, DTensor) else None
    return (leaf._version, None if local is None or local.is_inference() else local._version)


def writes(before: list, after: list) -> list[tuple[int, int, int]]:
    """(leaf index, writes to the tensor, writes to its local tensor) of each leaf written
    between ``before`` and ``after`` (:func:`versions` of the same leaves)."""
    found = []
    for index, (old, new) in enumerate(zip(before, after, strict=True)):
        if old is not None and new is not None and old != new:
            found.append((index, new[0] - old[0], (new[1] or 0) - (old[1] or 0)))
    return found


def count_writes(leaves: list, counted: list[tuple[int, int, int]]) -> None:
    """Count ``counted`` (:func:`writes`) again on ``leaves``, the later call's."""
    for index, tensor_writes, local_writes in counted:
        leaf = leaves[index]
        for _ in range(tensor_writes):
            increment_version(leaf)
        for _ in range(local_writes):
            increment_version(leaf._local_tensor)


def made_again(recording, leaves) -> None:
    """Note the tensors among ``leaves`` as made again, not dispatched: no view of anything."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            recording.made_again.add(id(leaf))
