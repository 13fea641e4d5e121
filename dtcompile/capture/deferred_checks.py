"""Which recorded op made each check torch defers to run time on numbers read from data.

A torch op's meta function that cannot decide a check on a size or number read from data
(``narrow``'s ``start + length <= u0``, ``reshape``'s ``u0 * 2 == 4``) defers it to run time
(the ShapeEnv's runtime asserts). The program checks it (``data_branches._runtime_checks``)
right after the op that deferred it: where the program's op checks too, it raises eager's
own error first; where it does not (a ``narrow`` runs as a slice, which clamps), the check
raises before anything reads its result.

A check on sizes read from data alone is made only after the ops whose program form may
not check (:data:`LENIENT_OPS`): elsewhere torch also defers its own assumptions (a
broadcast takes a selection's rows to equal the size they meet, ``min(1, u0) == u0``, a
linear algebra op's bounds that an empty tensor does not meet), which the program's op,
run on the real sizes, does not need (README, "Not yet").
"""

from __future__ import annotations

import torch

from ..core.symbol import backward_note
from ..core.torch_internals import runtime_asserts
from .data_sized_calls import broadcasts_decided
from .fake_calls import run_on_fakes

aten = torch.ops.aten
# A narrow runs as a slice (which clamps), a reshape as a view that the program drops where
# the sizes traced make it an identity.
LENIENT_OPS = {aten.slice.Tensor, aten.view.default, aten._unsafe_view.default, aten.reshape.default}


class DeferredChecks:
    """The recorded op that deferred each check, by its expression; the sizes read from data."""

    def __init__(self):
        self.made_by: dict = {}  # a check's expression -> (the op, its first fake output) that deferred it
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
                if forward:
                    self.made_by[expr] = (func, first)
        return out
