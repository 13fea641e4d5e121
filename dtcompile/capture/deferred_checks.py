"""Which recorded op made each check torch defers to run time on numbers read from data.

A torch op's meta function that cannot decide a check on a size or number read from data
(``narrow``'s ``start + length <= u0``, ``reshape``'s ``u0 * 2 == 4``) defers it to run time
(the ShapeEnv's runtime asserts). The program checks it (``data_branches._runtime_checks``)
right after the op that deferred it: where the program's op checks too, it raises eager's
own error first; where it does not (a ``narrow`` runs as a slice, which clamps), the check
raises before anything reads its result.

A check on sizes read from data alone is made unless torch's meta made it as an assumption
of its own, which eager's kernel does not check and the program's op, run on the real
sizes, does not need (:func:`assumed`): a linear algebra op's bounds that a matrix of no
row does not meet (``svdvals``, ``qr``), a backward's mask count equal to the forward's. (A
broadcast's ``u0 == 2`` is genuine once ``u0 == 1`` was asked first, ``data_sized_calls.py``.)
"""

from __future__ import annotations

import sympy
import torch
from torch.utils._sympy.functions import Max, Min

from ..core.symbol import backward_note
from ..core.torch_internals import runtime_asserts
from .data_sized_calls import broadcasts_decided
from .fake_calls import run_on_fakes

# A narrow runs as a slice (which clamps), a reshape as a view that the program drops where
# the sizes traced make it an identity: their checks are eager's (``x[m][:2].reshape(2, 2)``).
_SIZED = {torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


class DeferredChecks:
    """The recorded op that deferred each check, by its expression; the sizes read from data."""

    def __init__(self):
        self.made_by: dict = {}  # a check's expression -> the op that deferred it, its first fake output, its call
        self.in_backward: set = set()  # the expressions of the checks deferred in the backward
        self.sizes_made: dict = {}  # a size read from data -> (the first tensor with it, its dim)
        self._known: set = set()  # the expressions of the checks deferred so far
        self._counted = 0  # the ShapeEnv's count of deferred checks when last read

    def _new(self, shape_env) -> list:
        fresh = [expr for expr, _ in runtime_asserts(shape_env) if expr not in self._known]
        self._known.update(fresh)
        self._counted = shape_env.num_deferred_runtime_asserts
        return fresh

    def run(self, recording, func, args: tuple, kwargs: dict):
        """``func`` run on fakes (``fake_calls.run_on_fakes``), after the questions on sizes
        read from data it broadcasts; the checks it defers noted as its own (in the forward:
        a backward's are not the program's to place)."""
        broadcasts_decided(func, args, kwargs, bool(self.sizes_made))
        shape_env = recording.fake_mode.shape_env
        before = []
        if shape_env is not None and shape_env.num_deferred_runtime_asserts != self._counted:
            # Deferred outside torch's ops: by a composite's C++ before the op it runs (``x[m][1]``
            # checks the index, then selects), DTensor's propagation, the user's ``torch._check``.
            # Made with this op, so that the program's op raises eager's own error first; not
            # past a write, which eager's check would have stopped.
            fresh = self._new(shape_env)
            before = [] if func._schema.is_mutable else fresh
        out = run_on_fakes(recording.fake_mode, func, args, kwargs, recording.current_call)
        if before or (shape_env is not None and shape_env.num_deferred_runtime_asserts != self._counted):
            first = next(iter(out), None) if isinstance(out, tuple | list) else out
            forward = backward_note() is None
            for expr in before + self._new(shape_env):
                self.made_by[expr] = (func, first, recording.current_call)
                if not forward:
                    self.in_backward.add(expr)
        return out

    def assumed(self, expr, sizes_alone: bool) -> bool:
        """Whether the check ``expr`` is torch's assumption (see the module docstring), not a
        check eager's op makes: a linear algebra op's; on sizes read from data alone, also a
        backward's, one of ``einsum``'s broadcasts (not asked first), or one on a size made
        of another (``a[:1]``'s ``min(1, u0)``: asked first, the answer is not one torch's
        metas can use)."""
        op, _, call = self.made_by.get(expr, (None, None, ""))
        if "linalg" in getattr(op, "__name__", ""):
            return True
        made_of = expr.has(sympy.Min, sympy.Max, Min, Max) and op not in _SIZED  # (a broadcast's)
        return sizes_alone and (expr in self.in_backward or made_of or "einsum" in (call or ""))
