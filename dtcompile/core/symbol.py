"""Symbols and bound symbols: the instructions of a trace.

A :class:`Symbol` is something a trace can call: an aten op while the trace is being
built, an executor's implementation once it is lowered. A :class:`BoundSymbol` is one
call of a symbol: its arguments (proxies and constants), its output and a :class:`Note`
that says which DTensor-level op it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_is_leaf, tree_map

from .printing import call_source, output_target
from .proxy import PROXY_TYPES, TensorProxy, is_proxy


@dataclass(frozen=True)
class Note:
    """The torch-level call a bound symbol came from, with the DTensor placements of its
    inputs and outputs: ``F.linear(x: Replicate(), up_weight: Shard(0)) -> Shard(1)``.

    ``template`` has a ``{i}`` where ``proxies[i]``'s name goes, so that a pass that
    renames a value renames it in the note too.
    """

    template: str
    proxies: tuple = ()

    def __str__(self) -> str:
        return self.template.format(*(p.label for p in self.proxies))

    def renamed(self, mapping: dict[str, TensorProxy]) -> Note:
        if not any(p.label in mapping for p in self.proxies):
            return self
        return Note(self.template, tuple(mapping.get(p.label, p) for p in self.proxies))


def backward_note() -> Note | None:
    """While a traced backward runs: the note of the autograd node running now."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    forward = node.metadata.get("dtcompile_note") if hasattr(node, "metadata") else None
    if forward is None:
        return Note(f"backward: {node.name()}")
    return Note("backward of " + forward.template, forward.proxies)


@dataclass(frozen=True)
class Symbol:
    """A callable a trace can refer to.

    ``name`` is how calls print (``aten.mm.default``, ``torch.mm``); programs run from
    their printed source. A symbol with ``method=True`` prints as a method of its first
    argument (``t0.view([4, 16])``). ``globals`` maps the names the printed call needs to
    ``(object, source)`` pairs, ``source`` being how the trace's header recreates it.
    """

    name: str
    method: bool = False
    globals: tuple[tuple[str, object, str], ...] = ()
    pure: bool = False  # a symbol with no op of its own may be dropped or merged by passes if pure

    def call(self, args: tuple, kwargs: dict) -> str:
        if self.method:
            return call_source(f"{args[0].label}.{self.name}", args[1:], kwargs)
        return call_source(self.name, args, kwargs)

    def lines(self, bsym: BoundSymbol) -> list[str]:
        """The statements that run ``bsym``; lowered symbols may emit several."""
        return [f"{output_target(bsym.output)} = {self.call(bsym.args, bsym.kwargs)}"]


# torch's own op namespaces print under their names (no input takes them); another (a
# custom op library's, ``torch.ops.mylib``) prints as ``ops_mylib``, a name no input takes:
# an argument called ``mylib`` would otherwise hide the library.
TORCH_OP_NAMESPACES = frozenset({"aten", "_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"})


def aten_symbol(op: torch._ops.OpOverload) -> Symbol:
    """The symbol of an OpOverload, printed by its qualified name (``aten.mm.default``)."""
    namespace = op.namespace
    printed = namespace if namespace in TORCH_OP_NAMESPACES else f"ops_{namespace}"
    return Symbol(
        name=f"{printed}.{op._opname}.{op._overloadname}",
        globals=((printed, getattr(torch.ops, namespace), f"torch.ops.{namespace}"),),
    )


@dataclass
class BoundSymbol:
    """One call in a trace: ``output = symbol(*args, **kwargs)``."""

    symbol: Symbol
    args: tuple
    kwargs: dict
    output: object
    note: Note | None = None
    op: torch._ops.OpOverload | None = None  # the aten op this call runs or was lowered from
    in_backward: bool = False  # recorded while autograd ran a training call's backward

    # What the two methods below found: each pass asks them of every symbol, and a symbol
    # is never changed in place (passes make new ones with ``replace``, which resets these).
    _inputs: list | None = field(default=None, init=False, repr=False, compare=False)
    _outputs: list | None = field(default=None, init=False, repr=False, compare=False)

    def input_proxies(self) -> list:
        """The proxies (tensors, numbers, futures) this call reads."""
        if self._inputs is None:
            self._inputs = proxies_in((self.args, self.kwargs))
        return self._inputs

    def output_proxies(self) -> list:
        """The proxies (tensors, numbers, futures) this call defines."""
        if self._outputs is None:
            self._outputs = proxies_in(self.output)
        return self._outputs

    def input_tensors(self) -> list[TensorProxy]:
        return [x for x in self.input_proxies() if isinstance(x, TensorProxy)]

    def output_tensors(self) -> list[TensorProxy]:
        return [x for x in self.output_proxies() if isinstance(x, TensorProxy)]

    def lines(self) -> list[str]:
        return self.symbol.lines(self)

    def but(self, **changes) -> BoundSymbol:
        """A copy with ``changes`` (as ``dataclasses.replace``, without its per-field work:
        passes and replays make many), what it found of its proxies kept where it holds."""
        copy = object.__new__(BoundSymbol)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        if "args" in changes or "kwargs" in changes:
            copy._inputs = None
        if "output" in changes:
            copy._outputs = None
        return copy

    def with_inputs_renamed(self, mapping: dict[str, TensorProxy]) -> BoundSymbol:
        """A copy whose proxy arguments are swapped by name through ``mapping``."""
        note = self.note.renamed(mapping) if self.note is not None else None
        if note is self.note and not any(p.label in mapping for p in self.input_proxies()):
            return self  # nothing to rename (the usual case in a pass that renames a few values)
        return self.but(args=renamed(self.args, mapping), kwargs=renamed(self.kwargs, mapping), note=note)


_ATOMS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.SymInt, torch.SymFloat, torch.SymBool)
# Leaves by exact type (most of what symbols hold), found with one set lookup.
_LEAF_TYPES = frozenset({*_ATOMS, *PROXY_TYPES})


def _is_leaf(x) -> bool:
    return isinstance(x, _ATOMS) or is_proxy(x) or isinstance(x, torch.Tensor)


def leaves(value) -> list:
    """The leaves of ``value`` in torch's pytree order: tuples, lists and dicts (what
    symbols and ops hold) are walked here, without pytree's per-node overhead; anything
    else by torch's pytree."""
    found = []
    _walk_leaves(value, found)
    return found


# (The walkers are module functions, not closures: a recursive closure is a reference
# cycle, left for the cyclic collector, and tracing calls these thousands of times.)
def _walk_leaves(x, found: list) -> None:
    kind = type(x)
    if kind in _LEAF_TYPES:
        found.append(x)
    elif kind is tuple or kind is list:
        for item in x:
            _walk_leaves(item, found)
    elif kind is dict:
        for item in x.values():
            _walk_leaves(item, found)
    elif _is_leaf(x) or tree_is_leaf(x):  # (a slice, a placement: pytree's leaves, without its walk)
        found.append(x)
    else:
        found.extend(tree_flatten(x)[0])


def flatten(value) -> tuple[list, object]:
    """The leaves of ``value`` (as :func:`leaves`) and what tells its structure apart from
    another's: the container types, dict keys and where leaves are (None), a pytree spec
    where torch's pytree flattens. For comparing structures, not for rebuilding them."""
    found = []
    structure = _walk_structure(value, found)
    return found, structure


_PYTREE_LEAF = tree_flatten(object())[1]  # (the spec pytree gives any leaf)


def _walk_structure(x, found: list):
    kind = type(x)
    if kind in _LEAF_TYPES:
        found.append(x)
        return None
    if kind is tuple or kind is list:
        return (kind, tuple([_walk_structure(item, found) for item in x]))
    if kind is dict:
        return (dict, tuple(map(_exact_key, x)), tuple([_walk_structure(item, found) for item in x.values()]))
    if _is_leaf(x):
        found.append(x)
        return None
    if tree_is_leaf(x):  # (a slice, a placement)
        found.append(x)
        return _PYTREE_LEAF
    items, spec = tree_flatten(x)
    found.extend(items)
    return spec


def _exact_key(key) -> object:
    """A dict key as code reading it tells it apart: ``1``, ``1.0`` and ``True`` are one
    key to a dict, not to ``type(next(iter(d)))``; floats by ``repr`` (``-0.0``, NaN)."""
    kind = type(key)
    if kind is float:
        return (kind, repr(key))
    if kind is tuple:
        return (kind, tuple(map(_exact_key, key)))
    return (kind, key)


def map_leaves(fn, value):
    """``value`` with ``fn`` applied to each leaf (``tree_map``, fast for tuples, lists
    and dicts, as :func:`leaves`)."""
    kind = type(value)
    if kind in _LEAF_TYPES:
        return fn(value)
    if kind is tuple:
        return tuple(map_leaves(fn, item) for item in value)
    if kind is list:
        return [map_leaves(fn, item) for item in value]
    if kind is dict:
        return {key: map_leaves(fn, item) for key, item in value.items()}
    if _is_leaf(value):
        return fn(value)
    return tree_map(fn, value)


def proxies_in(value) -> list:
    """The proxies in ``value``, in pytree order."""
    return [x for x in leaves(value) if is_proxy(x)]


def renamed(value, mapping: dict) -> object:
    """``value`` (a pytree) with each proxy swapped by name through ``mapping``."""
    return map_leaves(lambda x: mapping.get(x.label, x) if is_proxy(x) else x, value)
