"""Telling whether two saved_tensors_hooks pairs do the same, for the guards and for a
training step called under hooks other than those it was traced under."""

from __future__ import annotations

import types

import torch

from ..capture import is_tracing
from ..core.torch_internals import saved_tensors_hooks


def same_saved_hooks(a: tuple | None, b: tuple | None) -> bool:
    """Whether two saved_tensors_hooks pairs (pack, unpack) do the same: the same
    functions, or functions of the same code over the same defaults and closure cells
    (``save_on_cpu()`` entered anew at each step makes new closures of equal cells)."""
    if a is None or b is None:
        return a is b
    return all(_same_function(x, y) for x, y in zip(a, b))


def _same_function(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, types.MethodType) and isinstance(b, types.MethodType):
        return a.__self__ is b.__self__ and _same_function(a.__func__, b.__func__)
    if not (isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType)):
        return False
    if a.__code__ is not b.__code__ or a.__globals__ is not b.__globals__:
        return False
    return (
        _same_values(a.__defaults__ or (), b.__defaults__ or ())
        and _same_values(_cells(a), _cells(b))
        and (a.__kwdefaults__ or {}).keys() == (b.__kwdefaults__ or {}).keys()
        and _same_values(tuple((a.__kwdefaults__ or {}).values()), tuple((b.__kwdefaults__ or {}).values()))
    )


def _cells(fn) -> tuple:
    contents = []
    for cell in fn.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell
            contents.append(_EMPTY)
    return tuple(contents)


_EMPTY = object()


def _same_values(a: tuple, b: tuple) -> bool:
    """Scalars by type and value, anything else by identity."""
    scalars = (type(None), bool, int, float, str, torch.device, torch.dtype)
    return len(a) == len(b) and all(
        x is y or (type(x) is type(y) and isinstance(x, scalars) and x == y) for x, y in zip(a, b)
    )


class OuterCheckpointsAside:
    """While a compiled call runs, not traced (``with`` this one object): the hooks of a
    ``torch.utils.checkpoint`` around the call (non-reentrant: its pack and its recompute's)
    put aside, so that the call saves what it saves itself. Left active, its recompute ran
    the checkpointed code on the real inputs while the backward was traced, which put real
    tensors of one call into the program (or raised). Eager's gradients; the region's
    saved tensors are kept rather than recomputed."""

    def __init__(self):
        self._popped: list[list] = []

    def __enter__(self) -> None:
        popped = []
        while (top := saved_tensors_hooks()) is not None and _checkpoints(top[0]) and not is_tracing():
            popped.append(top)
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self._popped.append(popped)

    def __exit__(self, *exc) -> None:
        for pack, unpack in reversed(self._popped.pop()):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def _checkpoints(pack) -> bool:
    """A pack hook of ``torch.utils.checkpoint``'s (its own, or its recompute's)."""
    pack = getattr(pack, "__wrapped__", pack)  # (the recompute's is wrapped by dynamo's disable)
    name = getattr(pack, "__qualname__", "")
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint" and name.split(".")[0] in _CHECKPOINT_HOOKS


_CHECKPOINT_HOOKS = ("_checkpoint_hook", "_recomputation_hook")
