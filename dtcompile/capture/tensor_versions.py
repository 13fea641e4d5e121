"""What code can read of a tensor besides its metadata and values: whether it is a view
(``_is_view()``, ``_base``) and how often it was written (``_version``). Autograd keeps
both at dispatch; a call not dispatched (a replayed block, a checked layer's call) keeps
neither. The first call's writes are counted again on the later call's tensors
(:func:`count_writes`); a tensor made again is noted (:func:`made_again`), and the
annotator traces the call again where code reads whether it is a view, or writes it (or a
view of it) in place where autograd would check that (:func:`made_again_history`:
``VerifyFailed``)."""

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


def made_again_history(func, args: tuple, kwargs: dict, made: set) -> str | None:
    """What ``func`` would tell of a tensor made again that eager's would not (or None):

    - a read of its history (``_is_view()``, ``._base``, ``._version``, ``.grad_fn``): a
      tensor made again has none (a ``detach()`` of it shares no version counter);
    - with gradients on, an in-place write to it or to a view of it, where it needs a
      gradient: eager's autograd checks the write against how the tensor was made (the
      ``to_local()`` of a row-wise layer's output is a custom Function's view, which
      raises), and a tensor made again records nothing of that."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if tensor is None:
        return None
    if name in _HISTORY:
        return f".{name}" if id(tensor) in made else None
    in_place = name in _IN_PLACE or (name.endswith("_") and not name.startswith("_")) or kwargs.get("inplace") is True
    if not in_place or not torch.is_grad_enabled() or not tensor.requires_grad:
        return None
    while tensor is not None:  # (the tensor, then what it views)
        if id(tensor) in made:
            return f"an in-place {name}"
        tensor = tensor._base
    return None


_HISTORY = frozenset({"_is_view", "_base", "_version", "grad_fn"})
_IN_PLACE = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"))
_IN_PLACE |= {"__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"}
