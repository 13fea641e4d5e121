"""Where a trace value came from.

Every trace input carries an :class:`InputPath`, a path into the call (``args[0]``,
``kwargs["mask"]``, ``params["up.weight"]._local_tensor``). Every proxy made inside a
meta function or a transform carries a :class:`NoProvenance` marker that names the op
that made it. A number read from a tensor's data (``.item()``, ``.tolist()``) carries
:class:`FromData`: made by an op like the others, and with no value while tracing, only
at run time. There is no other case and never a silent ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One step of a path: an index into a sequence, a key into a mapping, or an attribute."""

    kind: str  # "index" | "key" | "attr"
    value: object

    def __str__(self) -> str:
        if self.kind == "index":
            return f"[{self.value}]"
        if self.kind == "key":
            return f"[{self.value!r}]"
        return f".{self.value}"


@dataclass(frozen=True)
class InputPath:
    """A path from one root of the call (``args``, ``kwargs``, ``params``, ``buffers``,
    ``captured``) to the value."""

    root: str
    steps: tuple[Step, ...] = ()

    def __truediv__(self, step: Step) -> InputPath:
        return InputPath(self.root, self.steps + (step,))

    def index(self, i: int) -> InputPath:
        return self / Step("index", i)

    def key(self, k: object) -> InputPath:
        return self / Step("key", k)

    def attr(self, name: str) -> InputPath:
        return self / Step("attr", name)

    def __str__(self) -> str:
        return self.root + "".join(str(s) for s in self.steps)


@dataclass(frozen=True)
class NoProvenance:
    """The explicit marker of a value that does not come from the call: it was made by
    ``made_by`` (an op, a meta function or a transform)."""

    made_by: str

    def __str__(self) -> str:
        return f"no provenance (made by {self.made_by})"


@dataclass(frozen=True)
class FromData:
    """The explicit marker of a number read from tensor data by ``made_by``: it has no
    trace-time value (its symbol is unbacked); the program computes it at each call."""

    made_by: str

    def __str__(self) -> str:
        return f"read from tensor data (by {self.made_by}; no value while tracing)"


Provenance = InputPath | NoProvenance | FromData
