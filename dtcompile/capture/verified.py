"""Layers traced alike, then checked rather than traced: a block call traced as it is
(``outlining.py``: a Hugging Face decoder layer) runs its Python, but need not dispatch.

Tracing a layer that cannot be replayed costs DTensor's dispatch and the fake tensors of
each torch-level call; outlining then finds the layers alike and calls one program. Once
two calls of a block class have made the same torch-level calls (:class:`CallLog`: the
same functions, DTensor's ``from_local``, ``redistribute`` and ``to_local`` each as one
call, arguments alike but for their tensors, which map one to one, and the same dispatch
state, torch's settings included), a later call of the class is *checked*: its Python
runs as always, so each decision it makes is its own, but each torch-level call it makes
is compared with the logged one at its place (:class:`Checker`) and answered with a
fresh tensor for each the logged call made (a proxy whose fake is made only when read),
nothing dispatched or recorded. A tensor from outside (the layer's weights, its cache
layer, the hidden state it is given) must be, at its first use, like the logged one at
that place (DTensor spec, sizes, strides, dtype, attributes), and the same at every later
use. Where every call matched, the layer stands in the recording as one symbol, which
``outlining.outline`` makes a call of the logged layer's program, with this layer's
tensors from outside; a fresh tensor anything reads later (the layer's result, one it
left on the cache object, a module or a list) is one the program returns.

A check that fails (another call, argument or dispatch state, a call missing or left
over, a tensor unlike the logged one) cannot be undone, since the Python ran with the
answers: the call is traced again with every block traced (``VerifyFailed``); a failure
the user's code catches is raised again at its next call and where the layer returns. So
is a checked layer that records anything itself (a collective called directly, a number
read from data). Only without gradients; a block class whose logged layers drew random
numbers, read numbers from data, changed a DTensor's spec in place or met a tensor that is
not traced is traced at every layer.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core import BoundSymbol, NoProvenance, TensorProxy
from ..core.op_classes import draws_random_numbers
from ..core.proxy import PASSING_FRAMES
from ..core.symbol import Symbol, flatten
from ..core.torch_internals import (
    make_dtensor,
)
from .block_calls import fresh_like
from .block_checks import recording_counts
from .equivalence import holds_size, local_proxy, same_value, traced_key
from .global_state import dispatch_state
from .tensor_versions import count_writes, made_again, versions, writes

ENABLED = True  # False traces every layer (tests compare the two)


class VerifyFailed(BaseException):
    """A checked layer did not do what the logged one did: trace every block instead. Not
    an ``Exception``: the user's code must not catch it (``except Exception``) and go on
    with answers that were the logged layer's (one that does is found where the capture
    ends: ``LayerCalls.failed``)."""


class CallLog:
    """The torch-level calls one block call made, as the ``CallAnnotator`` passed them on:
    per call, the function, the arguments' structure, each leaf (a tensor the block made,
    one from outside by its place in ``outside``, or a value), the dispatch state, and its
    result's leaves (a tensor it made, an argument returned, or a value)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.outside: list = []  # tensors from outside, in order of first use
        self.keys: list = []  # their keys
        self.made: list = []  # tensors the calls returned, new (kept: ids stay theirs)
        self._index: dict[int, tuple] = {}
        self.unloggable = False  # a call raised, changed a DTensor's spec in place, or met an untraced tensor

    def call(self, func, args: tuple, kwargs: dict, dispatch):
        """Dispatch the call, and log it."""
        leaves, structure = flatten((args, kwargs))
        specs = [getattr(x, "_spec", None) for x in leaves]
        state, before = dispatch_state(), versions(leaves)
        try:
            out = dispatch()
        except BaseException:
            self.unloggable = True  # a call that raised is no call to answer later ones with
            raise
        described = []
        for leaf, spec in zip(leaves, specs):
            if isinstance(leaf, torch.Tensor):
                known = self._index.get(id(leaf))
                if known is None:
                    key = traced_key(leaf)
                    self.unloggable |= key is None
                    known = self._index[id(leaf)] = ("outside", len(self.outside))
                    self.outside.append(leaf)
                    self.keys.append(key)
                described.append(known)
                self.unloggable |= spec is not getattr(leaf, "_spec", None)
            else:
                described.append(("value", leaf))
        flat_out, treespec = tree_flatten(out)
        places = {id(x): i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        results = []
        for leaf in flat_out:
            if isinstance(leaf, torch.Tensor) and id(leaf) in places:
                results.append(("arg", places[id(leaf)]))
            elif isinstance(leaf, torch.Tensor) and id(leaf) not in self._index:
                self._index[id(leaf)] = ("made", leaf)
                self.made.append(leaf)
                results.append(("made", leaf))
            elif isinstance(leaf, torch.Tensor):
                results.append(self._index[id(leaf)])  # a tensor it made before, or one from outside
            else:
                results.append(("value", leaf))
        treespec = None if treespec.is_leaf() else treespec  # (one tensor, most calls' result: given as it is)
        self.unloggable |= treespec is not None and holds_size(treespec)  # (rebuilt, a tuple)
        written = writes(before, versions(leaves))
        # A write through a view counts in its base's version too, which a check's fresh tensor has not.
        self.unloggable |= any(leaves[index]._is_view() for index, _, _ in written)
        self.calls.append((func, structure, described, state, treespec, results, written))
        return out

    def alike(self, other: CallLog) -> bool:
        """Whether ``other`` made the calls this log made, its tensors in place of these."""
        if len(self.calls) != len(other.calls) or self.keys != other.keys:
            return False
        made = {}
        for mine, theirs in zip(self.calls, other.calls):
            if mine[0] is not theirs[0] or mine[1] != theirs[1] or mine[3:5] != theirs[3:5] or mine[6] != theirs[6]:
                return False
            for (kind, x), (other_kind, y) in zip([*mine[2], *mine[5]], [*theirs[2], *theirs[5]]):
                if kind != other_kind:
                    return False
                if kind == "made" and made.setdefault(id(x), y) is not y:
                    return False
                if kind in ("outside", "arg") and x != y:
                    return False
                if kind == "value" and not same_value(x, y):
                    return False
        return True


class Checker:
    """A later call of a block class whose calls were logged alike: each torch-level call
    checked against the log's at its place, and answered with a fresh tensor for each the
    logged one made (see the module docstring)."""

    def __init__(self, stand_in: StandIn, recording):
        self.log, self.stand_in, self.recording = stand_in.log, stand_in, recording
        self.at = 0
        self.outside: dict[int, object] = {}  # place in the log's ``outside`` -> this call's tensor
        self.taken: set[int] = set()  # ids of this call's tensors from outside
        self.fresh: dict[int, torch.Tensor] = {}  # id of a logged tensor made -> this call's
        self.outputs: dict[int, TensorProxy] = {}  # place among the symbols' outputs -> this call's
        self.made_here: set[int] = set()  # ids of the tensors it gave (not taken from outside)
        self.failed: str | None = None

    def call(self, func, args: tuple, kwargs: dict, dispatch):
        with torch._C.DisableTorchFunction():  # (no metadata read of its own for the annotator to see)
            return self._answer(func, args, kwargs)

    def _answer(self, func, args: tuple, kwargs: dict):
        leaves, structure = flatten((args, kwargs))
        why = self.failed or self._check(func, leaves, structure)
        if why is not None:
            self.failed = why
            raise VerifyFailed(f"a layer checked against a logged one: {why}")
        treespec, results, written = self.log.calls[self.at - 1][4:]
        count_writes(leaves, written)  # (``_version``, as the logged call's dispatch counted them)
        out = []
        for kind, x in results:
            if kind == "arg":
                out.append(leaves[x])
            elif kind == "made":
                out.append(self._fresh(x))
            else:
                out.append(self.outside[x] if kind == "outside" else x)  # (one it took before, returned)
        return out[0] if treespec is None else tree_unflatten(out, treespec)

    def _fresh(self, logged: torch.Tensor) -> torch.Tensor:
        """This call's tensor for one the logged call made: a new proxy (its fake made
        only when read) in a DTensor like the logged one, where it was one."""
        made = self.fresh.get(id(logged))
        if made is None:
            old = local_proxy(logged)
            place = self.stand_in.made[old.label]
            made = local = self.outputs.get(place)  # (a DTensor's local tensor, returned by another call)
            if local is None:
                made = local = self.outputs[place] = fresh_like(self.recording, old, _CHECKED)
            if isinstance(logged, DTensor):  # (its storage's size given: with symbolic sizes, sympy's to compute)
                made = make_dtensor(local, copy.copy(logged._spec), False, logged.untyped_storage().nbytes())
            self.fresh[id(logged)] = made
            self.made_here.add(id(made))
            made_again(self.recording, (made, local))
        return made

    def _check(self, func, leaves: list, structure) -> str | None:
        if self.at >= len(self.log.calls):
            return f"{_name(func)} is called after the logged calls"
        logged, logged_structure, described, state, _, _, _ = self.log.calls[self.at]
        self.at += 1
        if func is not logged or structure != logged_structure or dispatch_state() != state:
            return f"{_name(func)} where {_name(logged)} was called, or called otherwise"
        for (kind, x), y in zip(described, leaves):
            if kind == "made":
                if self.fresh.get(id(x)) is not y:
                    return f"{_name(func)} takes another tensor"
            elif kind == "outside":
                known = self.outside.get(x)
                if known is None:
                    if id(y) in self.taken or id(y) in self.made_here or self.log.keys[x] != traced_key(y):
                        return f"{_name(func)} takes a tensor unlike the logged one"
                    self.outside[x] = y
                    self.taken.add(id(y))
                elif known is not y:
                    return f"{_name(func)} takes another tensor"
            elif not same_value(x, y):
                return f"{_name(func)} takes another argument ({x!r}, {y!r})"
        return None

    def finish(self) -> str | None:
        """Why the call cannot stand as checked; None where it can."""
        if self.failed is not None:
            return self.failed
        if self.at != len(self.log.calls):
            return "it made fewer calls than the logged one"
        return None


_CHECKED = NoProvenance("a checked layer")


def _name(func) -> str:
    return getattr(func, "__name__", func)


class LayerCalls:
    """For each block class traced as it is (``outlining.Stretches``): its first call
    traced as always; its second and third traced with their submodules (not replayed)
    and their calls logged; the later ones checked, once ``Stretches`` found the two logs
    alike and made a :class:`StandIn` of what the second recorded (``ready``)."""

    def __init__(self, recording, blocks):
        self.recording = recording
        self.blocks = blocks  # (``RepeatedBlocks``: its ``recording_depth`` runs submodules as they are)
        self.calls: dict[type, int | None] = {}  # class -> its calls so far; None: traced at every call
        self.ready: dict[type, StandIn] = {}
        self.pending: list[tuple[BoundSymbol, StandIn, dict]] = []  # a checked call's symbol, and its outputs
        self.failed: str | None = None  # why a check failed, where the user's code went on past it

    def run(self, module, call):
        """``call()`` as the class's place calls for: (its result, its log where it was
        logged, the symbol standing for it where it was checked)."""
        cls = type(module)
        count = self.calls.get(cls, 0)
        if not ENABLED or count is None or torch.is_grad_enabled() or self.recording.call_log is not None:
            return call(), None, None
        if cls in self.ready:
            out, bsym = self._checked(self.ready[cls], call)
            return out, None, bsym
        self.calls[cls] = count + 1
        if count == 0:
            return call(), None, None
        log, counts = CallLog(), recording_counts(self.recording)
        out = self._inside(log, call)
        if log.unloggable or recording_counts(self.recording) != counts:
            self.calls[cls] = None
            return out, None, None
        return out, log, None

    def _inside(self, log, call):
        """``call()`` with its torch-level calls, and DTensor's own (``from_local``,
        ``redistribute``, ``to_local``: a tensor-parallel hook's), passed through ``log``;
        its submodules run as they are."""
        recording = self.recording
        originals = {name: DTensor.__dict__[name] for name in _DTENSOR_CALLS}
        for name, original in originals.items():
            setattr(DTensor, name, _through(original, recording, log))
        recording.call_log = log
        self.blocks.recording_depth += 1
        try:
            return call()
        finally:
            self.blocks.recording_depth -= 1
            recording.call_log = None
            for name, original in originals.items():
                setattr(DTensor, name, original)

    def _checked(self, stand_in: StandIn, call):
        recording = self.recording
        checker = Checker(stand_in, recording)
        counts, length = recording_counts(recording), len(recording.bound_symbols)
        try:
            out = self._inside(checker, call)
        finally:
            self.failed = self.failed or checker.failed
        why = checker.finish()
        if why is None and (recording_counts(recording) != counts or len(recording.bound_symbols) != length):
            why = "it recorded symbols of its own"
        if why is not None:
            self.failed = self.failed or why
            raise VerifyFailed(f"a layer checked against a logged one: {why}")
        args = []
        for place in stand_in.inputs:
            value = checker.outside.get(place)
            if value is None:
                self.failed = "it did not use a tensor the logged one used"
                raise VerifyFailed(f"a layer checked against a logged one: {self.failed}")
            args.append(local_proxy(value))
        bsym = BoundSymbol(PENDING, tuple(args), {}, tuple(checker.outputs.values()))
        self.pending.append((bsym, stand_in, checker.outputs))
        return out, bsym


class StandIn:
    """What a class's second call recorded, as checked calls stand for it: its log, the
    place in the log of each tensor its symbols take from outside, the place of each
    tensor it made among its symbols' outputs (``outlining._own``), and its stretch."""

    def __init__(self, log: CallLog, inputs: list[int], made: dict[str, int], stretch: tuple):
        self.log, self.inputs, self.made, self.stretch = log, inputs, made, stretch


_DTENSOR_CALLS = ("from_local", "redistribute", "to_local")


def _through(original, recording, log):
    """A DTensor method whose calls go through ``log`` as one call each, the calls it
    makes inside not logged (nor checked) on their own."""
    function = original.__func__ if isinstance(original, staticmethod) else original

    def method(*args, **kwargs):
        if recording.call_log is not log:
            return function(*args, **kwargs)
        return log.call(function, args, kwargs, partial(_unlogged, recording, function, args, kwargs))

    PASSING_FRAMES.add(method.__code__)
    return staticmethod(method) if isinstance(original, staticmethod) else method


def _unlogged(recording, function, args: tuple, kwargs: dict):
    log, recording.call_log = recording.call_log, None
    try:
        return function(*args, **kwargs)
    finally:
        recording.call_log = log


def verifiable(symbols: list) -> bool:
    """Whether checked calls may stand for these symbols: none draws random numbers
    (DTensor's take their offsets from Python state)."""
    return not any(b.op is not None and draws_random_numbers(b) for b in symbols)


PENDING = Symbol(name="checked_layer")  # a checked call's, until outlining gives it its program


PASSING_FRAMES.update((CallLog.call.__code__, _unlogged.__code__))
