"""Repeated blocks recorded once: a submodule call that repeats an earlier one is replayed.

Real models stack 32 to 128 identical layers, and tracing one (DTensor's dispatch and
sharding propagation, the user's Python, fake tensors) is most of a compile. While a
module is traced, :class:`RepeatedBlocks` sees every submodule call (``nn.Module.__call__``
is swapped for the length of the trace). The first call of a block is run and recorded as
it always is, and the symbols it added become a :class:`BlockTemplate`. A later call of
an *equivalent* block, with *equivalent* arguments, is not run: the template's symbols are
recorded again, each through the recording (so each op's output metadata comes from its
fake tensors again, and names are given in the same order), with the later block's
tensors in place of the first one's, and the outputs are rebuilt around the new proxies
with the first call's DTensor specs. The trace is the one the Python would have recorded
(the tests compare the printed programs).

Equivalent blocks (``same_blocks``): the same classes and submodule names through the
subtree, the same training flags, parameters, buffers and tensor attributes of the same
metadata and DTensor specs, hooks of the same code over equivalent values (tensor
parallelism's hooks are closures over its styles and the mesh), and every other attribute
equal, or provably not read: an attribute that differs (a layer's index) may differ only
where its name appears nowhere in the code the block can run (its classes' methods, its
hooks, the functions they name) as an attribute or a string. Equivalent arguments: the
same structure, DTensors of the same spec and local metadata, tensors of the same
metadata, the same tensor at the same places, and equal scalars.

What a template may hold (else the block is only ever traced, ``BlockTemplate.refused``):
tensors from the block's own parameters, buffers and attributes and from its arguments
(anything else the block reads, an object's tensors, a global tensor, cannot be mapped
to a later block); no random ops, collectives called directly, numbers read from data,
module assignments; nothing that requires grad (training traces every block: the
backward of a replayed block is not built yet).
"""

from __future__ import annotations

import copy
import functools
import types

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core import TensorProxy
from ..core.symbol import leaves, map_leaves
from ..core.torch_internals import (
    dtensor_implicit_replication,
    dtensor_op_handlers,
    function_mode_count,
    make_dtensor,
)
from .python_reads import value_key

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout)
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
_TENSOR_TABLES = ("_parameters", "_buffers")
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)
# A name in code that can read any attribute: a differing attribute is then never unread.
_READS_ANY = frozenset({"__dict__", "vars", "__getattribute__", "getattr_static"})
_EQUIVALENCE_DEPTH = 8


def _size_key(size) -> object:
    return size.node.expr if isinstance(size, torch.SymInt) else size


def tensor_key(t: torch.Tensor) -> tuple:
    """What a proxy's metadata is compared by: sizes and strides (symbolic ones by
    expression, so comparing adds no guard), offset, dtype, device, layout, grad."""
    fake = t.fake if isinstance(t, TensorProxy) else t
    return (
        tuple(map(_size_key, fake.shape)),
        tuple(map(_size_key, fake.stride())),
        _size_key(fake.storage_offset()),
        fake.dtype,
        fake.device,
        fake.layout,
        t.requires_grad,
    )


def _local_proxy(value) -> TensorProxy | None:
    """The proxy a traced tensor is, or a traced DTensor holds; None for anything else."""
    if isinstance(value, DTensor):
        value = value._local_tensor
    return value if isinstance(value, TensorProxy) else None


def _traced_key(value) -> tuple | None:
    """The key of a traced tensor or DTensor (None where it is not traced)."""
    local = _local_proxy(value)
    if local is None:
        return None
    if isinstance(value, DTensor):
        spec = value._spec
        meta = spec.tensor_meta
        return (
            "dtensor",
            id(spec.mesh),
            tuple(spec.placements),
            tuple(map(_size_key, meta.shape)),
            tuple(map(_size_key, meta.stride)),
            value.requires_grad,
            tensor_key(local),
        )
    return ("tensor", tensor_key(local))


def arguments_key(args: tuple, kwargs: dict) -> tuple | None:
    """The key equivalent arguments share: their structure, each leaf's key and which
    leaves are the same object; None where a leaf cannot be compared (an object, a real
    tensor), so the call is traced as it is."""
    flat, spec = tree_flatten((args, kwargs))
    keys = []
    first: dict[int, int] = {}
    for index, leaf in enumerate(flat):
        if isinstance(leaf, torch.Tensor):
            key = _traced_key(leaf)
            if key is None:
                return None
        elif type(leaf) in _SCALARS:
            key = value_key(leaf)
        elif isinstance(leaf, torch.SymInt):
            key = ("symint", leaf.node.expr)
        else:
            return None
        keys.append((key, first.setdefault(id(leaf), index)))
    return (spec, tuple(keys), dispatch_state())


def dispatch_state() -> tuple:
    """What decides how an op runs besides its arguments, which a forward could change
    between its layers: grad and inference mode, autocast, the default dtype, the torch
    function modes (a default device), DTensor's implicit replication and op handlers."""
    handlers = dtensor_op_handlers()
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        tuple((torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")),
        torch.get_default_dtype(),
        function_mode_count(),
        dtensor_implicit_replication(),
        id(handlers),
        tuple(handlers),
    )


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, object]]:
    """``(dotted name, value)`` of every tensor the subtree holds, in a fixed order."""
    found = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for table in _TENSOR_TABLES:
            for name, value in getattr(sub, table).items():
                found.append((f"{prefix}.{table}.{name}", value))
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                found.append((f"{prefix}.{name}", value))
    return found


# Where a module's code starts: what its call runs, and how it looks up attributes.
_ENTRY_POINTS = ("forward", "__call__", "_call_impl", "__getattr__", "__getattribute__")


_names_of_class: dict[type, tuple[tuple, frozenset]] = {}  # class -> (its namespace's ids, names)


def _class_names(cls: type) -> frozenset:
    """The attribute names and strings the code a call of ``cls`` can run names: its
    ``forward`` (and ``__call__``, ``__getattr__`` overrides up to nn.Module), the methods
    and properties of the class these name, and the functions they name through their
    globals (see :func:`_callable_names`). Methods only construction calls (``__init__``,
    ``reset_parameters``) are not followed, unless the forward names them. Found again
    when the class's namespace changed (a method patched)."""
    namespace: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if klass is torch.nn.Module or klass is object or not issubclass(klass, torch.nn.Module):
            continue
        namespace.update(vars(klass))
    ids = tuple((name, id(value)) for name, value in namespace.items())
    cached = _names_of_class.get(cls)
    if cached is not None and cached[0] == ids:
        return cached[1]
    names: set[str] = set()
    pending = [name for name in _ENTRY_POINTS if name in namespace]
    followed: set[str] = set()
    while pending:
        name = pending.pop()
        if name in followed:
            continue
        followed.add(name)
        found: set[str] = set()
        _callable_names(namespace[name], found, 3)
        names |= found
        pending.extend(n for n in found if n in namespace and n not in followed)
    _names_of_class[cls] = (ids, frozenset(names))
    return _names_of_class[cls][1]


def _callable_names(value, names: set, depth: int) -> None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        for accessor in (value.fget, value.fset):
            _callable_names(accessor, names, depth)
        return
    if isinstance(value, functools.partial):
        _callable_names(value.func, names, depth)
        return
    if isinstance(value, types.MethodType):
        value = value.__func__
    if isinstance(value, type) and depth > 0 and not _is_torch(value):
        for member in vars(value).values():  # a helper class the code names
            if isinstance(member, (types.FunctionType, staticmethod, classmethod, property)):
                _callable_names(member, names, depth - 1)
        return
    if isinstance(value, types.FunctionType):
        _code_names(value.__code__, names)
        if depth > 0:
            # A decorator's wrapper holds the function it wraps in a closure cell.
            for cell in value.__closure__ or ():
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if callable(contents):
                    _callable_names(contents, names, depth - 1)
            # The functions and classes it names through its globals (a helper reading ``module.x``).
            for name in value.__code__.co_names:
                target = value.__globals__.get(name)
                if isinstance(target, (types.FunctionType, type)) and not _is_torch(target):
                    _callable_names(target, names, depth - 1)


def _is_torch(fn) -> bool:
    return (getattr(fn, "__module__", None) or "").startswith("torch.")


def _code_names(code: types.CodeType, names: set) -> None:
    names.update(code.co_names)
    for const in code.co_consts:
        if isinstance(const, str):
            names.add(const)
        elif isinstance(const, types.CodeType):
            _code_names(const, names)


def _hook_names(module: torch.nn.Module, names: set) -> None:
    for table in _HOOK_TABLES:
        for hook in getattr(module, table, {}).values():
            if callable(hook):
                _callable_names(hook, names, 3)
                for cell in getattr(hook, "__closure__", None) or ():
                    try:
                        _callable_names(cell.cell_contents, names, 2)
                    except ValueError:  # an empty cell
                        pass


class _Equivalence:
    """Whether two values play the same part in two blocks: the same object, equal
    scalars and placements, corresponding modules, functions of the same code over
    equivalent closures, partials and bound methods of such, and plain objects whose
    attributes are equivalent (a few levels down)."""

    def __init__(self, modules: dict[int, torch.nn.Module]):
        self.modules = modules  # id of a module of the first block -> the module in the same place

    def __call__(self, a, b, depth: int = 0) -> bool:
        if isinstance(a, torch.nn.Module) or isinstance(b, torch.nn.Module):
            mapped = self.modules.get(id(a))
            return mapped is b if mapped is not None else a is b
        if a is b:
            return True
        if type(a) is not type(b):
            return False
        if type(a) in _SCALARS:
            return value_key(a) == value_key(b)
        if isinstance(a, Placement):
            return a == b
        if depth > _EQUIVALENCE_DEPTH:
            return False
        if isinstance(a, (tuple, list)):
            return len(a) == len(b) and all(self(x, y, depth + 1) for x, y in zip(a, b))
        if isinstance(a, dict):
            return list(a) == list(b) and all(self(a[k], b[k], depth + 1) for k in a)
        if isinstance(a, types.FunctionType):
            return (
                a.__code__ is b.__code__
                and a.__globals__ is b.__globals__
                and self(a.__defaults__, b.__defaults__, depth + 1)
                and self(a.__kwdefaults__, b.__kwdefaults__, depth + 1)
                and self._cells(a.__closure__ or (), b.__closure__ or (), depth)
            )
        if isinstance(a, types.MethodType):
            return a.__func__ is b.__func__ and self(a.__self__, b.__self__, depth + 1)
        if isinstance(a, functools.partial):
            return (
                self(a.func, b.func, depth + 1)
                and self(a.args, b.args, depth + 1)
                and self(a.keywords, b.keywords, depth + 1)
            )
        if isinstance(a, (torch.Tensor, type, types.ModuleType, types.BuiltinFunctionType)):
            return False  # by identity only
        if type(a).__module__ == "builtins" or not hasattr(a, "__dict__") or _has_slots(type(a)):
            return False
        return self(vars(a), vars(b), depth + 1)

    def _cells(self, a: tuple, b: tuple, depth: int) -> bool:
        if len(a) != len(b):
            return False
        for x, y in zip(a, b):
            try:
                xv = x.cell_contents
            except ValueError:
                xv = _EMPTY
            try:
                yv = y.cell_contents
            except ValueError:
                yv = _EMPTY
            if not self(xv, yv, depth + 1):
                return False
        return True


_EMPTY = object()


def _has_slots(cls: type) -> bool:
    """Whether instances of ``cls`` hold values outside their ``__dict__`` (``abc.ABC``'s
    empty ``__slots__`` holds none)."""
    return any(
        name not in ("__dict__", "__weakref__")
        for klass in cls.__mro__
        for name in (
            (vars(klass).get("__slots__") or ())
            if not isinstance(vars(klass).get("__slots__"), str)
            else (vars(klass)["__slots__"],)
        )
    )


def same_blocks(first: torch.nn.Module, other: torch.nn.Module) -> bool:
    """Whether ``other`` is equivalent to ``first`` (see the module docstring)."""
    return first is other or why_different(first, other) is None


def why_different(first: torch.nn.Module, other: torch.nn.Module) -> str | None:
    """What makes ``other`` not equivalent to ``first``; None where nothing does."""
    pairs = list(zip(first.named_modules(remove_duplicate=False), other.named_modules(remove_duplicate=False)))
    if len(pairs) != sum(1 for _ in other.named_modules(remove_duplicate=False)) or len(pairs) != sum(
        1 for _ in first.named_modules(remove_duplicate=False)
    ):
        return "their submodules differ"
    for (pa, a), (pb, b) in pairs:
        if pa != pb or type(a) is not type(b):
            return f"their submodules differ ({pa!r}: {type(a).__name__}, {pb!r}: {type(b).__name__})"
    equivalent = _Equivalence({id(a): b for (_, a), (_, b) in pairs})
    differing: set[str] = set()
    for path, a in (pair[0] for pair in pairs):
        b = equivalent.modules[id(a)]
        va, vb = vars(a), vars(b)
        if list(va) != list(vb):
            return f"{path or 'the block'} has other attributes"
        for name, x in va.items():
            y = vb[name]
            where = f"{path}.{name}" if path else name
            if name in _TENSOR_TABLES:
                if list(x) != list(y):
                    return f"{where} holds other names"
                for key in x:
                    kx, ky = _traced_key(x[key]), _traced_key(y[key])
                    if kx != ky or (kx is None and not (x[key] is None and y[key] is None)):
                        return f"{where}[{key!r}] differs"
            elif name == "_modules":
                if list(x) != list(y):
                    return f"{where} holds other names"
            elif name in _HOOK_TABLES:
                if len(x) != len(y) or not all(equivalent(p, q) for p, q in zip(x.values(), y.values())):
                    return f"{where} holds other hooks"
            elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                kx = _traced_key(x)
                if kx is None or kx != _traced_key(y):
                    return f"{where} differs"
            elif not equivalent(x, y):
                differing.add(name)
    if not differing:
        return None
    # Differing attributes are allowed only where no code the block runs names them.
    names: set[str] = set()
    for _, (_, module) in pairs:
        names |= _class_names(type(module))
        _hook_names(module, names)
    if names & _READS_ANY:
        return f"attributes differ ({', '.join(sorted(differing))}) and its code reads {sorted(names & _READS_ANY)[0]}"
    read = differing & names
    return f"attributes its code reads differ ({', '.join(sorted(read))})" if read else None


class BlockTemplate:
    """The symbols the first call of a block recorded, and how to record them again for an
    equivalent block (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, key: tuple):
        self.module = module
        self.key = key
        self.symbols: list = []
        self.sources: dict[str, list[tuple[str, object]]] = {}  # free proxy label -> where each block has it
        self.output = None  # (treespec, leaves described)
        self.refused: str | None = None  # why the block is only traced

    def sources_in(self, module: torch.nn.Module, flat_args: list) -> dict[str, TensorProxy] | None:
        """The later block's proxy for each free proxy of the template; None where one has
        none, or two sources disagree."""
        held = dict(_named_tensors(module))
        found: dict[str, TensorProxy] = {}
        for label, sources in self.sources.items():
            for kind, where in sources:
                proxy = _local_proxy(held.get(where) if kind == "module" else flat_args[where])
                if proxy is None or found.setdefault(label, proxy) is not proxy:
                    return None
        return found


class RepeatedBlocks:
    """While a module is traced: submodule calls recorded once and replayed (see the
    module docstring)."""

    def __init__(self, recording, module_state):
        self.recording = recording
        self.paths = module_state.paths  # id of each module of the traced tree -> its path
        self.root = module_state.modules[0] if module_state.modules else None
        self.templates: dict[type, list[BlockTemplate]] = {}
        self.recording_depth = 0
        self.replayed: dict[str, list[str]] = {}  # path of a recorded block -> the blocks replayed from it
        self._original = None

    def __enter__(self) -> RepeatedBlocks:
        self._original = torch.nn.Module.__call__
        original, blocks = self._original, self

        def call(module, *args, **kwargs):
            return blocks.call(original, module, args, kwargs)

        torch.nn.Module.__call__ = call
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.Module.__call__ = self._original

    def call(self, original, module, args: tuple, kwargs: dict):
        if (
            self.recording_depth
            or module is self.root
            or id(module) not in self.paths
            or self.recording.dtensor_calls
            or any(getattr(torch.nn.modules.module, table) for table in _GLOBAL_HOOKS)
        ):
            return original(module, *args, **kwargs)
        key = arguments_key(args, kwargs)
        if key is None:
            return original(module, *args, **kwargs)
        for template in self.templates.get(type(module), ()):
            if template.key == key and same_blocks(template.module, module):
                if template.refused is not None:
                    return original(module, *args, **kwargs)
                replayed = self._replay(template, module, args, kwargs)
                if replayed is not _FAILED:
                    self.replayed.setdefault(self.paths[id(template.module)], []).append(self.paths[id(module)])
                    return replayed
                return original(module, *args, **kwargs)
        template = BlockTemplate(module, key)
        self.templates.setdefault(type(module), []).append(template)
        return self._record(template, original, module, args, kwargs)

    def notes(self) -> list[str]:
        """The trace's header lines on what was replayed."""
        lines = []
        for first, later in self.replayed.items():
            shown = ", ".join(later[:3]) + (", ..." if len(later) > 3 else "")
            lines.append(f"{first} recorded once, replayed for {len(later)} more ({shown})")
        return lines

    def _record(self, template: BlockTemplate, original, module, args: tuple, kwargs: dict):
        recording = self.recording
        start = len(recording.bound_symbols)
        counts = _counts(recording)
        tables = [(t, dict(t)) for t in _python_state(module)]
        flat_args, _ = tree_flatten((args, kwargs))
        specs = [(leaf, leaf._spec) for leaf in flat_args if isinstance(leaf, DTensor)]
        self.recording_depth += 1
        try:
            out = original(module, *args, **kwargs)
        finally:
            self.recording_depth -= 1
        template.symbols = recording.bound_symbols[start:]
        template.refused = (
            "it changed the recording's other state"
            if _counts(recording) != counts
            else "it changed Python state it can read"
            if _tables_changed(tables)
            else "it changed an argument's placements"
            if any(leaf._spec is not spec for leaf, spec in specs)
            else _unreplayable(template.symbols)
        )
        if template.refused is None:
            template.refused = self._describe(template, module, args, kwargs, out)
        return out

    def _describe(self, template: BlockTemplate, module, args: tuple, kwargs: dict, out) -> str | None:
        """The template's free proxies' sources and its output's description; or why it
        cannot be replayed."""
        defined: set[str] = set()
        free: dict[str, TensorProxy] = {}
        for bsym in template.symbols:
            for proxy in bsym.input_proxies():
                if proxy.label not in defined:
                    if not isinstance(proxy, TensorProxy):
                        return f"it reads {proxy.label}, a number from outside it"
                    free.setdefault(proxy.label, proxy)
            defined.update(p.label for p in bsym.output_proxies())
        sources: dict[str, list] = {}
        for name, value in _named_tensors(module):
            proxy = _local_proxy(value)
            if proxy is not None:
                sources.setdefault(proxy.label, []).append(("module", name))
        flat_args, _ = tree_flatten((args, kwargs))
        for index, leaf in enumerate(flat_args):
            proxy = _local_proxy(leaf)
            if proxy is not None:
                sources.setdefault(proxy.label, []).append(("arg", index))
        template.sources = {}
        for label, proxy in free.items():
            if label not in sources:
                return f"it reads {label}, a tensor neither its own nor an argument"
            if proxy.value is not None:
                return f"it reads {label}, whose value tracing knows"
            template.sources[label] = sources[label]
        flat_out, spec = tree_flatten(out)
        described = []
        arg_ids = {id(leaf): index for index, leaf in enumerate(flat_args)}
        for leaf in flat_out:
            if isinstance(leaf, torch.Tensor):
                local = _local_proxy(leaf)
                if local is None or leaf.requires_grad:
                    return "it returns a tensor that is not traced, or requires grad"
                if id(leaf) in arg_ids:
                    described.append(("arg", arg_ids[id(leaf)]))
                elif local.label not in defined and local.label not in template.sources:
                    return "it returns a tensor from outside it"
                elif isinstance(leaf, DTensor):
                    described.append(("dtensor", local, leaf._spec))
                else:
                    described.append(("tensor", local))
            elif type(leaf) in _SCALARS or isinstance(leaf, torch.SymInt):
                described.append(("value", leaf))
            else:
                return f"it returns a {type(leaf).__name__}"
        template.output = (spec, described)
        return None

    def _replay(self, template: BlockTemplate, module, args: tuple, kwargs: dict):
        recording = self.recording
        flat_args, _ = tree_flatten((args, kwargs))
        mapping = template.sources_in(module, flat_args)
        if mapping is None:
            return _FAILED
        base = len(recording.bound_symbols)
        try:
            with torch._C.DisableTorchFunction():  # no torch-level call runs: nothing for the annotator
                _record_again(recording, template.symbols, mapping)
        except (_ReplayDiverged, ValueError):
            del recording.bound_symbols[base:]
            return _FAILED
        spec, described = template.output
        result = []
        for entry in described:
            kind = entry[0]
            if kind == "arg":
                result.append(flat_args[entry[1]])
            elif kind == "dtensor":
                result.append(make_dtensor(mapping[entry[1].label], copy.copy(entry[2]), requires_grad=False))
            elif kind == "tensor":
                result.append(mapping[entry[1].label])
            else:
                result.append(entry[1])
        return tree_unflatten(result, spec)


def _record_again(recording, symbols: list, mapping: dict[str, TensorProxy]) -> None:
    """Record ``symbols`` again through ``recording``, each proxy swapped through
    ``mapping`` (label -> proxy), which learns each new output."""

    def mapped(x):
        return mapping[x.label] if isinstance(x, TensorProxy) else x

    for bsym in symbols:
        before = len(recording.bound_symbols)
        out = recording.record(bsym.op, *map_leaves(mapped, (bsym.args, bsym.kwargs)))
        if len(recording.bound_symbols) != before + 1:
            raise _ReplayDiverged
        for old, new in zip(leaves(bsym.output), leaves(out), strict=True):
            if isinstance(old, TensorProxy) != isinstance(new, TensorProxy):
                raise _ReplayDiverged
            if isinstance(old, TensorProxy):
                if tensor_key(old) != tensor_key(new):
                    raise _ReplayDiverged
                mapping[old.label] = new
        if bsym.note is not None:
            recording.bound_symbols[-1].note = bsym.note.renamed(mapping)


class _ReplayDiverged(Exception):
    """A replayed op recorded otherwise than the template's (it should not happen)."""


_FAILED = object()


def _counts(recording) -> tuple:
    return (
        len(recording.captured),
        len(recording.read_by),
        len(recording.cones),
        recording.c10d_calls,
    )


def _python_state(module: torch.nn.Module) -> list[dict]:
    """The dicts a block's code reads Python values from: its modules' tables and
    attributes, the plain objects these hold (a config), its classes' dicts and their
    functions' globals. A first call that changes one is not replayed (a later block
    would have read the new value)."""
    found: dict[int, dict] = {}
    for sub in module.modules():
        for table in (*(getattr(sub, name) for name in _TENSOR_TABLES), vars(sub)):
            found[id(table)] = table
        for value in vars(sub).values():
            if not isinstance(value, (torch.nn.Module, torch.Tensor, type)) and isinstance(
                getattr(value, "__dict__", None), dict
            ):
                found[id(vars(value))] = vars(value)
        for klass in type(sub).__mro__:
            if klass is torch.nn.Module:
                break
            found[id(klass)] = klass.__dict__
            for value in vars(klass).values():
                if isinstance(value, types.FunctionType):
                    found[id(value.__globals__)] = value.__globals__
    return list(found.values())


def _tables_changed(tables: list[tuple[dict, dict]]) -> bool:
    return any(t.keys() != before.keys() or any(t[k] is not v for k, v in before.items()) for t, before in tables)


def _unreplayable(symbols: list) -> str | None:
    for bsym in symbols:
        if bsym.op is None:
            return f"it records {bsym.symbol.name}, which is not an aten op"
        if torch.Tag.nondeterministic_seeded in bsym.op.tags and not _without_dropout(bsym):
            return f"it draws random numbers ({bsym.op})"
    return None


def _without_dropout(bsym) -> bool:
    """Whether a seeded op draws nothing: attention with ``dropout_p`` 0. Other random ops
    are not replayed: DTensor's random ops on shards take their offsets from Python state
    at trace time, which a replay would not advance."""
    for index, argument in enumerate(bsym.op._schema.arguments):
        if argument.name == "dropout_p":
            if argument.kwarg_only or index >= len(bsym.args):
                value = bsym.kwargs.get("dropout_p", argument.default_value)
            else:
                value = bsym.args[index]
            return type(value) in (int, float) and value == 0
    return False
