"""Torch-level calls recorded once and recorded again for inputs like the first's.

A layer that cannot be replayed whole (a Hugging Face decoder layer: its ``layer_idx``
picks its KV cache entry) is traced as it is, and most of its cost is DTensor's dispatch
and the fake tensors of each of its calls (``x * cos``, ``k.transpose(1, 2)``, a cache's
``index_copy_``), the same calls on inputs with the same metadata in every layer. The
user's Python still runs for every layer, so every decision it makes is its own; only a
torch-level call whose inputs are like an earlier call's is not dispatched again: the
symbols the earlier one recorded are recorded again with this call's tensors
(``replay.record_again``: most outputs are fake tensors like the first's), and its
outputs rebuilt with the first call's DTensor specs.

"Like" is :func:`call_key`: the same function, the same arguments but for their
tensors, whose metadata, placements, identity and storage sharing are the same, under the
same dispatch state (``equivalence.arguments_key``). Only calls without gradients (a
traced backward's notes name the forward call each symbol differentiates), whose tensors
are all traced and none with a value known while tracing, and only torch's own functions
(a user's function taking part in ``__torch_function__`` may read anything); a call is
kept only when what
it recorded can be recorded again: aten ops that draw no random numbers, that read
nothing but the call's tensors, made no new symbol (a size read from data is a new one
each time), changed no other state of the recording, and returned traced tensors or
plain values.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core import TensorProxy
from ..core.torch_internals import make_dtensor
from .block_checks import recording_counts, unreplayable
from .equivalence import SCALARS, arguments_key, holds_data, holds_size, local_proxy
from .replay import ReplayDiverged, aliases_of, record_again
from .tensor_versions import made_again


@dataclass
class _Call:
    """What a first call recorded: its symbols, the labels of its tensors' proxies (leaf
    by leaf), and its outputs described (``("arg", leaf index, spec set or None)``,
    ``("dtensor", label, spec)``, ``("tensor", label)``, ``("value", value)``)."""

    symbols: list
    aliases: list
    labels: list[str]
    outputs: list
    treespec: object
    specs: list  # its arguments' DTensor specs: the meshes the key names by id stay alive
    aliasing: bool  # it returned a view, or an alias of an argument (``tensor_versions.made_again``)


MISSED = object()
ENABLED = True  # False dispatches every call (tests compare the two)


class OpMemo:
    """The calls of one trace recorded so far, by :func:`call_key`."""

    def __init__(self, recording, aliases_kept: bool):
        self.recording = recording
        self.aliases_kept = aliases_kept  # (not where a call is traced again: no tensor is made again there)
        self.calls: dict[tuple, _Call] = {}

    def key(self, func, args: tuple, kwargs: dict, flat: list) -> tuple | None:
        return call_key(func, args, kwargs, flat) if ENABLED else None

    def replay(self, key: tuple, flat: list):
        """The call's output, its symbols recorded again; ``MISSED`` where none like it was
        kept, or its tensors map otherwise (two labels to one proxy)."""
        call = self.calls.get(key)
        if call is None:
            return MISSED
        mapping: dict[str, TensorProxy] = {}
        for label, leaf in zip(call.labels, _tensor_leaves(flat), strict=True):
            if mapping.setdefault(label, local_proxy(leaf)) is not local_proxy(leaf):
                return MISSED
        recording = self.recording
        base, names = len(recording.bound_symbols), recording.names_given()
        try:
            with torch._C.DisableTorchFunction():  # no torch-level call runs: nothing for the annotator
                record_again(recording, call.symbols, call.aliases, mapping)
        except (ReplayDiverged, ValueError):
            del recording.bound_symbols[base:]
            recording.forget_names_since(names)
            return MISSED
        out = [_output(entry, flat, mapping) for entry in call.outputs]
        if call.aliasing:  # made again, a view is none, an alias shares no version counter: noted, with its arguments
            made_again(recording, [*out, *mapping.values(), *_tensor_leaves(flat)])
        return tree_unflatten(out, call.treespec)

    def keep(self, key: tuple, flat: list, specs: list, start: int, before: tuple, out) -> None:
        """Keep the call just run (its symbols from ``start``; ``before``: :func:`state`
        before it; ``specs``: its leaves' DTensor specs before it), where it can be
        recorded again."""
        recording = self.recording
        symbols = recording.bound_symbols[start:]
        if not symbols or state(recording) != before or unreplayable(symbols) or any(map(_writes, symbols)):
            return
        tensors = _tensor_leaves(flat)
        labels = [local_proxy(leaf).label for leaf in tensors]
        defined = set(labels)
        for bsym in symbols:
            if any(p.label not in defined for p in bsym.input_proxies()):
                return  # it reads a tensor that is not the call's (a captured one), or a number
            defined.update(p.label for p in bsym.output_proxies())
        flat_out, treespec = tree_flatten(out)
        if holds_size(treespec):
            return
        if not torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in flat_out):
            return  # a view of a weight under no_grad: made again, it would be none autograd knows
        memories = {local_proxy(leaf).memory for leaf in tensors}
        with torch._C.DisableTorchFunction():
            aliasing = any(_aliasing(leaf, memories) for leaf in flat_out)
        if aliasing and not self.aliases_kept:
            return
        if len({id(leaf) for leaf in flat_out if isinstance(leaf, torch.Tensor)}) != len(_tensor_leaves(flat_out)):
            return  # one tensor returned twice: a replay would return two
        index_of = {id(leaf): i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)}
        outputs = []
        for leaf in flat_out:
            if id(leaf) in index_of:  # an argument returned: an in-place op's, which DTensor gives a new spec
                i = index_of[id(leaf)]
                changed = specs[i] is not getattr(leaf, "_spec", None)
                outputs.append(("arg", i, copy.copy(leaf._spec) if changed else None))
            elif isinstance(leaf, torch.Tensor):
                local = local_proxy(leaf)
                if local is None or local.value is not None or local.label not in defined or leaf.requires_grad:
                    return
                if isinstance(leaf, DTensor) and holds_data(leaf._spec):
                    return  # a placement holding this call's data (an embedding's mask)
                outputs.append(
                    ("dtensor", local.label, leaf._spec) if isinstance(leaf, DTensor) else ("tensor", local.label)
                )
            elif type(leaf) in SCALARS:
                outputs.append(("value", leaf))
            else:
                return  # a size (a SymInt), or an object
        aliases = aliases_of(symbols)
        self.calls[key] = _Call(list(symbols), aliases, labels, outputs, treespec, specs, aliasing)


def call_key(func, args: tuple, kwargs: dict, flat: list) -> tuple | None:
    """The key calls like each other share (see the module docstring); None where the
    call is not kept: gradients, a tensor that is not traced or whose value tracing
    knows, an argument that cannot be compared."""
    if torch.is_grad_enabled() or torch._C._current_autograd_node() is not None or not _torch_own(func):
        return None
    tensors = _tensor_leaves(flat)
    if not tensors or any(local_proxy(t) is None or local_proxy(t).value is not None for t in tensors):
        return None
    arguments = arguments_key(args, kwargs, grad=False)
    if arguments is None:
        return None
    proxies, storages = {}, {}
    shared = tuple(
        (proxies.setdefault(id(local), i), storages.setdefault(local.memory, i))
        for i, local in enumerate(map(local_proxy, tensors))
    )
    return (func, arguments, shared)


def state(recording) -> tuple:
    """What a kept call must leave as it found it: the recording's other state and the
    symbols of sizes (a size read from data is a new symbol at each call)."""
    shape_env = recording.fake_mode.shape_env
    return recording_counts(recording), 0 if shape_env is None else len(shape_env.var_to_range)


def _torch_own(func) -> bool:
    """Whether ``func`` is torch's (an op, a Tensor method, a function of ``torch``): a
    user's function that takes part in ``__torch_function__`` may read anything."""
    if isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return True
    owner = getattr(func, "__objclass__", None)  # a method of torch's C tensor class
    module = getattr(owner, "__module__", None) if owner is not None else getattr(func, "__module__", None)
    return isinstance(module, str) and (module == "torch" or module.startswith("torch."))


def _writes(bsym) -> bool:
    """An op that writes to its inputs (``add_``, ``t_``): recorded again, it would neither
    count the write in their version counters (``._version``) nor change their metadata."""
    return bsym.op._schema.is_mutable


def _aliasing(leaf, memories: set) -> bool:
    """A view (``x[:]``, a linear of a 3-d input), or an alias of an argument (``x.detach()``)."""
    local = local_proxy(leaf)
    return isinstance(leaf, torch.Tensor) and (leaf._is_view() or (local is not None and local.memory in memories))


def _tensor_leaves(flat: list) -> list:
    return [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]


def _output(entry: tuple, flat: list, mapping: dict):
    kind = entry[0]
    if kind == "arg":
        leaf = flat[entry[1]]
        if entry[2] is not None:
            leaf._spec = copy.copy(entry[2])
        return leaf
    if kind == "dtensor":
        return make_dtensor(mapping[entry[1]], copy.copy(entry[2]), requires_grad=False)
    if kind == "tensor":
        return mapping[entry[1]]
    return entry[1]
