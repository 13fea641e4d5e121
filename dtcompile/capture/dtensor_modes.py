"""DTensor's dispatch modes a call enters inside itself, kept for its backward.

``implicit_replication()`` (plain tensors taken as replicated) and ``loss_parallel()``
(its own handlers of the loss ops) change how DTensor dispatches. Entered inside the traced
code (``with loss_parallel(): return F.cross_entropy(...)``), they have ended when the
backward is traced, after the forward; in eager the user runs that backward under the same
mode, as torch asks, or it raises DTensor's mixed-tensors error. So the modes the forward's
DTensor ops ran under are noted; where the backward cannot be traced without them, it is
traced under them (``capture/autograd.py``), and the compiled backward raises eager's
error when they are not on as it runs (``jit/training.py``).
"""

from __future__ import annotations

import contextlib

from ..core.torch_internals import dtensor_implicit_replication, dtensor_op_handlers


class DTensorModes:
    """What the forward's DTensor ops ran under beyond what the call began under."""

    def __init__(self):
        self.implicit_replication = False
        self.handlers: dict = {}
        self._start = dict(dtensor_op_handlers())

    def note(self) -> None:
        """A DTensor op runs now (``CallAnnotator``)."""
        if dtensor_implicit_replication():
            self.implicit_replication = True
        handlers = dtensor_op_handlers()
        if len(handlers) != len(self._start):
            self.handlers.update((op, h) for op, h in handlers.items() if self._start.get(op) is not h)

    def seen(self) -> bool:
        return self.implicit_replication or bool(self.handlers)

    def active(self) -> bool:
        """Whether the modes noted are on now (the backward of a compiled call runs)."""
        handlers = dtensor_op_handlers()
        return (dtensor_implicit_replication() or not self.implicit_replication) and all(
            handlers.get(op) is h for op, h in self.handlers.items()
        )

    @contextlib.contextmanager
    def again(self):
        """The modes noted, on again (for tracing the backward), then as they were."""
        dispatcher = _dispatcher()
        replication, handlers = dispatcher._allow_implicit_replication, dtensor_op_handlers()
        added = {op: h for op, h in self.handlers.items() if op not in handlers}
        dispatcher._allow_implicit_replication = replication or self.implicit_replication
        handlers.update(added)
        try:
            yield
        finally:
            dispatcher._allow_implicit_replication = replication
            for op in added:
                handlers.pop(op, None)


def _dispatcher():
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher
