"""When two blocks play the same part: the keys of a call's arguments, and equivalent modules.

``capture/blocks.py`` replays the recording of a block's first call for a later call only
where the later block and its arguments are equivalent to the first's:

- **Arguments** (:func:`arguments_key`): the same structure; DTensors of the same spec and
  local metadata, tensors of the same metadata, the same tensor at the same places, equal
  scalars; and the same state of what decides how ops run (grad mode, autocast, the default
  dtype, function modes, DTensor's implicit replication and op handlers).
- **Modules** (:func:`why_different`): the same classes and submodule names through the
  subtree; parameters, buffers and tensor attributes of the same metadata and DTensor
  specs; hooks of the same code over equivalent values (tensor parallelism's hooks are
  closures over its styles and the mesh); every other attribute equivalent, or provably
  not read: an attribute that differs (a layer's index) may differ only where its name
  appears nowhere, as an attribute or a string, in the code a call of the block can run
  (its classes' ``forward`` and the methods and properties it names, its hooks, the
  functions and classes these name through globals and closures, nn.Module's own call).
  Code that can read any attribute (``__dict__``, ``vars``) allows no difference.
"""

from __future__ import annotations

import collections

import torch
from torch.distributed.tensor import DTensor

from ..core import TensorProxy
from ..core.symbol import flatten
from ..core.torch_internals import dispatch_modes_off, mask_buffer
from .alike import SCALARS, Equivalence
from .global_state import dispatch_state
from .method_checks import received
from .python_reads import value_key
from .tensor_attributes import attributes_key, user_attributes

# nn.Module's hook tables: a handle's id is the key, so only the hooks are compared.
_HOOK_TABLES = frozenset(
    {
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)
TENSOR_TABLES = ("_parameters", "_buffers")
_TABLES = _HOOK_TABLES | {"_modules", *TENSOR_TABLES}  # copied by block_state


def holds_size(spec) -> bool:
    """Whether a pytree spec holds a ``torch.Size``, which torch's ``tree_unflatten``
    rebuilds as a plain tuple: a result rebuilt from it would not be eager's."""
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    return spec.type is torch.Size or any(map(holds_size, children))


def size_key(size) -> object:
    return size.node.expr if isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)) else size


# A size may be a symbol in one call, a number in another.
_NUMBER_KINDS = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


def same_value(x, y) -> bool:
    """Whether two arguments that are not proxies are the same to an op: by exact type (a
    symbolic size as a number), symbolic sizes by expression, floats and complex numbers by
    :func:`value_key` (``-0.0``, a NaN's sign), NumPy's scalars and arrays by their bytes."""
    kind = _NUMBER_KINDS.get(type(x), type(x))
    if kind is not _NUMBER_KINDS.get(type(y), type(y)):
        return False
    if kind in (int, float, bool) and (type(x) in _NUMBER_KINDS or type(y) in _NUMBER_KINDS):
        return size_key(x) == size_key(y)
    if kind is float or kind is complex:
        return value_key(x) == value_key(y)  # (a NaN by its bits: its sign)
    if isinstance(x, torch.Tensor):
        return x is y
    if hasattr(x, "tobytes") and hasattr(x, "dtype"):  # (``np.float64(-0.0) == 0.0``)
        return value_key(x) == value_key(y)
    return x == y


def tensor_key(t: torch.Tensor) -> tuple:
    """What a proxy's metadata is compared by: sizes and strides (symbolic ones by
    expression, so comparing adds no guard), offset, dtype, device, layout, grad, the
    conjugate and negative bits."""
    fake = t.meta if isinstance(t, TensorProxy) else t
    return (
        tuple(map(size_key, fake.shape)),
        tuple(map(size_key, fake.stride())),
        size_key(fake.storage_offset()),
        fake.dtype,
        fake.device,
        fake.layout,
        t.requires_grad,
        fake.is_conj(),  # ops dispatch on these bits (``resolve_conj`` returns its input without)
        fake.is_neg(),
    )


def holds_data(spec) -> bool:
    """Whether a DTensor's placements hold data of their call (a row-parallel embedding's
    _MaskPartial, the mask of the indices it looked up): such a DTensor is not like
    another with equal placements, nor can its spec be given to another call's output."""
    return any(mask_buffer(placement) is not None for placement in spec.placements)


def local_proxy(value) -> TensorProxy | None:
    """The proxy a traced tensor is, or a traced DTensor holds; None for anything else."""
    if isinstance(value, DTensor):
        value = value._local_tensor
    return value if isinstance(value, TensorProxy) else None


def traced_key(value) -> tuple | None:
    """The key of a traced tensor or DTensor (None where it is not traced)."""
    local = local_proxy(value)
    if local is None:
        return None
    if isinstance(value, DTensor):
        spec = value._spec
        if holds_data(spec):
            return None
        meta = spec.tensor_meta
        return (
            "dtensor",
            id(spec.mesh),
            tuple(spec.placements),
            tuple(map(size_key, meta.shape)),
            tuple(map(size_key, meta.stride)),
            value.requires_grad,
            tensor_key(local),
            attributes_key(value),
            known_value_key(local),
        )
    return ("tensor", tensor_key(local), attributes_key(value), known_value_key(local))


def known_value_key(proxy: TensorProxy) -> object:
    """What a value tracing knows of a tensor is compared by: code may read it as a number
    (``int(t)``, ``t.item()``, ``x.roll(t)``) and the number is baked into what it records.
    Its bytes; a large one by identity (its contents are not compared at each call)."""
    value = proxy.value
    if value is None:
        return None
    if value.numel() > 4096:
        return ("the value of", id(value))
    with torch._C.DisableTorchFunction(), dispatch_modes_off():  # (not ops of the trace)
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return (value.dtype, tuple(value.shape), bytes(data.numpy()))


def arguments_key(args: tuple, kwargs: dict, grad: bool = True) -> tuple | None:
    """The key equivalent arguments share: their structure, each leaf's key and which
    leaves are the same object; None where a leaf cannot be compared (an object, a real
    tensor), so the call is traced as it is. Without ``grad`` (a call made without
    gradients, ``op_memo.py``), what ``is_leaf`` answers is left out: no op it makes
    records autograd's graph."""
    flat, spec = flatten((args, kwargs))
    if not all(map(_keyed_kind, flat)):
        return None  # (before any tensor's key: a decoder layer's KV cache object, after four tensors)
    keys = []
    first: dict[int, int] = {}
    for index, leaf in enumerate(flat):
        if isinstance(leaf, torch.Tensor):
            key = traced_key(leaf)
            if key is None or user_attributes(leaf):
                return None  # not traced, or an attribute of its own (``x.tag``) the block may read
            if grad and leaf.requires_grad:  # what ``is_leaf`` answers: the caller's, for a tensor the call received
                with torch._C.DisableTorchFunction():
                    key = (key, received(leaf) or leaf.is_leaf)
        elif type(leaf) in SCALARS:
            key = value_key(leaf)
        elif isinstance(leaf, torch.SymInt):
            key = ("symint", leaf.node.expr)
        elif type(leaf) is slice:  # an index: ``x[..., : n // 2]``
            key = (slice, *map(_bound_key, (leaf.start, leaf.stop, leaf.step)))
            if None in key:
                return None
        elif leaf is Ellipsis or type(leaf) is torch.memory_format:
            key = leaf
        else:
            return None
        keys.append((key, first.setdefault(id(leaf), index)))
    return (spec, tuple(keys), dispatch_state())


def _keyed_kind(leaf) -> bool:  # (what ``arguments_key`` keys, checked before any key is made)
    return type(leaf) in _KEYED or leaf is Ellipsis or isinstance(leaf, (torch.Tensor, torch.SymInt))


_KEYED = frozenset({*SCALARS, slice, torch.memory_format})


def _bound_key(bound) -> object:
    """A slice bound's key; None where it cannot be compared."""
    if isinstance(bound, torch.SymInt):
        return ("symint", bound.node.expr)
    return value_key(bound) if bound is None or type(bound) is int else None


def named_tensors(module: torch.nn.Module) -> list[tuple[str, object]]:
    """``(dotted name, value)`` of every tensor the subtree holds, in a fixed order."""
    found = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for table in TENSOR_TABLES:
            for name, value in getattr(sub, table).items():
                found.append((f"{prefix}.{table}.{name}", value))
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                found.append((f"{prefix}.{name}", value))
    return found


def tensors_key(module: torch.nn.Module) -> tuple:
    """The names and keys of the tensors a block holds: blocks of one class that differ
    here (a layer's k_proj and its q_proj) differ in what they compute, not only in an
    attribute (a layer's index)."""
    return tuple((name, traced_key(value)) for name, value in named_tensors(module))


# A module's attributes of these types (exact under ``==``: no NaN, no signed zero), and
# its empty tables, are compared all at once (``_Plain``).
_PLAIN = frozenset({type(None), bool, int, str})
_EMPTY_CONTAINERS = frozenset({dict, collections.OrderedDict, set})


class _Plain:
    """A module's attributes that are flags, sizes, names or empty tables (most of them):
    their names, values and exact types, compared in a few C-level passes; ``rest``
    names the others, compared one by one."""

    __slots__ = ("names", "values", "types", "rest")

    def __init__(self, attributes: dict):
        self.names, self.values, self.types, self.rest = [], [], [], []
        for name, value in attributes.items():
            kind = type(value)
            if kind in _PLAIN or (kind in _EMPTY_CONTAINERS and not value):
                self.names.append(name)
                self.values.append(value if kind in _PLAIN else kind())
                self.types.append(kind)
            else:
                self.rest.append(name)

    def differing(self, now: dict) -> str | None:
        """The first attribute of ``now`` (a module's ``vars``, with the same names)
        that differs; None where none does."""
        values = list(map(now.__getitem__, self.names))
        if list(map(type, values)) == self.types and values == self.values:
            return None
        return next(n for n, x, k, y in zip(self.names, self.values, self.types, values) if type(y) is not k or x != y)


def block_state(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, dict, dict, _Plain]]:
    """``(path, submodule, its attributes, its tensors' keys, its plain attributes)``
    through the subtree, as they are now: the tables (parameters, buffers, submodules,
    hooks) copied, so that a later assignment or hook does not change what was recorded
    with; the key (``traced_key``) of each tensor in a table or attribute, by
    ``(attribute, name)``; the attributes compared all at once (:class:`_Plain`)."""
    state = _BlockState()
    for path, sub in module.named_modules(remove_duplicate=False):
        attributes, keys = {}, {}
        for name, value in vars(sub).items():
            if name in TENSOR_TABLES:
                keys.update(((name, key), traced_key(tensor)) for key, tensor in value.items())
            elif isinstance(value, torch.Tensor):
                keys[(name, None)] = traced_key(value)
            attributes[name] = dict(value) if name in _TABLES and isinstance(value, dict) else value
        state.append((path, sub, attributes, keys, _Plain(vars(sub))))
    state.sharing = _sharing(attributes for _, _, attributes, *_ in state)
    return state


class _BlockState(list):
    """``block_state``'s entries, and which of the block's tensors were the same object."""

    sharing: list[int]


def same_blocks(first: list, other: torch.nn.Module) -> bool:
    """Whether ``other`` is now equivalent to the block whose ``block_state`` is ``first``
    (see the module docstring)."""
    return why_different(first, other) is None


def why_different(first: list, other: torch.nn.Module) -> str | None:
    """What makes ``other`` not equivalent to the block whose ``block_state`` is
    ``first``; None where nothing does. The first block is compared as it was when its
    state was taken (the module may be ``other`` itself, called again after the code
    changed it)."""
    others = list(other.named_modules(remove_duplicate=False))
    if len(first) != len(others):
        return "their submodules differ"
    for (pa, a, *_), (pb, b) in zip(first, others):
        if pa != pb or type(a) is not type(b):
            return f"their submodules differ ({pa!r}: {type(a).__name__}, {pb!r}: {type(b).__name__})"
    equivalent = Equivalence({id(a): b for (_, a, *_), (_, b) in zip(first, others)})
    for (path, _, va, keys, plain), (_, b) in zip(first, others):
        vb = vars(b)
        if list(va) != list(vb):
            return f"{path or 'the block'} has other attributes"
        name = plain.differing(vb)
        if name is not None:
            return f"{_where(path, name)} differs"
        for name in plain.rest:
            x, y = va[name], vb[name]
            if name in TENSOR_TABLES:
                if list(x) != list(y):
                    return f"{_where(path, name)} holds other names"
                for key, tensor in y.items():
                    kx = keys[(name, key)]
                    if kx is None and x[key] is None and tensor is None:
                        continue
                    if kx is None or kx != traced_key(tensor):
                        return f"{_where(path, name)}[{key!r}] differs"
            elif name == "_modules":
                if list(x) != list(y):
                    return f"{_where(path, name)} holds other names"
            elif name in _FLAG_TABLES:  # which hooks take kwargs, or run always: by position
                hooks = _FLAG_TABLES[name]
                if _positions(x, va.get(hooks, {})) != _positions(y, vb.get(hooks, {})):
                    return f"{_where(path, name)} marks other hooks"
            elif name in _HOOK_TABLES:
                if len(x) != len(y) or not all(equivalent(p, q) for p, q in zip(x.values(), y.values())):
                    return f"{_where(path, name)} holds other hooks"
            elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                kx = keys.get((name, None))
                if kx is None or kx != traced_key(y):
                    return f"{_where(path, name)} differs"
            elif not equivalent(x, y):
                return f"{_where(path, name)} differs"
    if first.sharing != _sharing(vars(b) for _, b in others):
        return "their tensors are shared otherwise (tied weights)"  # code may ask ``self.a.weight is self.b.weight``
    return None


def _sharing(attribute_dicts) -> list[int]:
    """Which of a subtree's tensors are the same object: for each (by ``named_tensors``'s
    order), where it first appears."""
    first: dict[int, int] = {}
    found = []
    for attributes in attribute_dicts:
        for name, value in attributes.items():
            values = value.values() if name in TENSOR_TABLES else (value,)
            for tensor in values:
                if isinstance(tensor, torch.Tensor):
                    found.append(first.setdefault(id(tensor), len(first)))
    return found


# Tables of flags keyed by a hook's handle id (True: it takes keyword arguments, or runs
# even when the forward raised), and the hook table the ids are keys of.
_FLAG_TABLES = {
    "_forward_hooks_with_kwargs": "_forward_hooks",
    "_forward_hooks_always_called": "_forward_hooks",
    "_forward_pre_hooks_with_kwargs": "_forward_pre_hooks",
}


def _positions(flags: dict, hooks: dict) -> list:
    """Where the hooks ``flags`` marks are in ``hooks`` (the handle ids differ between
    blocks; the order of the hooks is what the call follows)."""
    order = {key: index for index, key in enumerate(hooks)}
    return sorted(order.get(key, -1) for key in flags)


def _where(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
