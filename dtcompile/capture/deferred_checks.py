"""Which recorded op made each check torch defers to run time on numbers read from data.

A torch op's meta function that cannot decide a check on a size or number read from data
(``narrow``'s ``start + length <= u0``, a broadcast's ``u0 == 3``) defers it to run time
(the ShapeEnv's runtime asserts). The program checks it (``data_branches._runtime_checks``)
right after the op that deferred it: where the program's op checks too, it raises eager's
own error first; where it does not (a ``narrow`` run as a slice clamps), the check raises
before anything reads its result.
"""

from __future__ import annotations

from ..core.torch_internals import runtime_asserts
from .data_sized_calls import broadcasts_decided
from .fake_calls import run_on_fakes


class DeferredChecks:
    """The recorded op (its first fake output) that deferred each check, by its expression."""

    def __init__(self):
        self.made_by: dict = {}  # a check's expression -> the fake output of the op that deferred it
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
        read from data it broadcasts; the checks it defers noted as its own."""
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
            for expr in before + self._new(shape_env):
                self.made_by[expr] = first
        return out
