"""The private parts of torch dtcompile relies on, in one place (FSDP2's in
``fsdp_internals.py``, autograd's entry points wrapped while tracing in ``trace_hooks.py``): where a new torch release breaks dtcompile, and the only place to
fix it. Each entry says why no public API serves.

Still used elsewhere, by attribute: a DTensor's ``_local_tensor`` and ``_spec`` (about
30 places; ``to_local()`` is differentiable and waits on async collectives, and
``placements``/``device_mesh`` lack the tensor metadata the spec carries), and the
generated epilogue's ``DTensor(local, spec)`` (``jit/epilogue.py``: the call
:func:`make_dtensor` makes, inlined in generated code); ``torch._C._current_autograd_node``
(``capture/recorder.py``); the Python dispatcher (``capture/tracer.py``,
``core/typecheck.py``); a ShapeEnv's symbols on SymInts (``node.expr``, ``node.hint``,
``core/symbolic.py``); the ShapeEnv's static decisions (``core/data_symbols.py``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor

# The spec of a DTensor (mesh, placements, global shape and strides): built for traced
# outputs and cotangents, whose metadata the trace knows. DTensor.from_local would check
# or recompute it, with collectives for uneven shards.
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401

# The global shape and strides of a local tensor under placements, computed locally (for a
# gradient's spec); the public DTensor.from_local(shape=None) runs a collective for it.
from torch.distributed.tensor._utils import compute_global_tensor_info  # noqa: F401

from dtcompile.core.dict_changes import dict_changes
from dtcompile.core.errors import SymbolsRefused

__all__ = [
    "TensorGuards",
    "dict_version",
    "allgather_into",
    "keep_mask",
    "mask_buffer",
    "runtime_asserts",
    "shape_guards",
    "symbol_range",
    "DTensorSpec",
    "TensorMeta",
    "compute_global_tensor_info",
    "completed_work",
    "work_done",
    "non_overlapping_and_dense",
    "set_data_value",
    "symbol_values",
    "default_store",
    "fake_mode_active",
    "function_mode_count",
    "dtensor_implicit_replication",
    "dtensor_op_handlers",
    "make_dtensor",
    "resolve_process_group",
    "unboxed_process_group",
]


def make_dtensor(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool, storage_size=None) -> DTensor:
    """A DTensor around ``local`` with exactly ``spec``: DTensor's constructor (``from_local``
    is differentiable, checks and may communicate), or, given the size of another such
    DTensor's storage, what it makes (its slots) without computing that (sympy operations)."""
    if storage_size is None:
        return DTensor(local, spec, requires_grad=requires_grad)
    meta = spec.tensor_meta
    made = torch.Tensor._make_wrapper_subclass(
        DTensor, meta.shape, strides=meta.stride, dtype=local.dtype, device=local.device, layout=local.layout,
        requires_grad=requires_grad, storage_size=storage_size,
    )  # fmt: skip
    made._spec, made._local_tensor = spec, local
    return made


# The process group registered under a name (what functional collectives take). Programs
# look groups up by name at each call rather than holding them (a held group outlives
# ``destroy_process_group``); torch has no public lookup by name.
resolve_process_group = _resolve_process_group


def default_store():
    """The default process group's store: the ranks exchange what they compiled through
    it, not through a collective (a rank that did not compile must not make others hang)."""
    return dist.distributed_c10d._get_default_store()


def unboxed_process_group(boxed) -> ProcessGroup:
    """The ProcessGroup a c10d op receives boxed as a ScriptObject (``dist.all_reduce``
    reaching the recorder as ``c10d.allreduce_``)."""
    return ProcessGroup.unbox(boxed) if isinstance(boxed, torch.ScriptObject) else boxed


class _CompletedWork(dist.Work):
    """A ``Work`` already done, whose ``result()`` and ``get_future()`` give the tensors the
    collective wrote (as eager's do; the recorded collective is complete at its wait)."""

    def __init__(self, tensors: list):
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def result(self) -> list:
        return self._tensors

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self._tensors)
        return future


def non_overlapping_and_dense(tensor: torch.Tensor) -> bool:
    """Whether a tensor's elements fill its memory without gaps or overlaps, in any order
    (no guard on symbolic sizes). torch 2.10 has it with an underscore, of sizes and strides."""
    if _DENSE is not None:
        return _DENSE(tensor)
    return torch._prims_common._is_non_overlapping_and_dense_or_false(tensor.shape, tensor.stride())


_DENSE = getattr(torch._prims_common, "is_non_overlapping_and_dense_or_false", None)


def work_done(tensors: list) -> dist.Work:
    """A completed ``Work`` whose results are ``tensors``."""
    return _CompletedWork(tensors)


def completed_work(tensors: list, alive: list):
    """A completed ``Work``, boxed as c10d ops return one: what a recorded collective gives
    back to ``dist.all_reduce(..., async_op=True)`` while tracing (``tensors``: what it wrote).
    The Python object is kept in ``alive``: boxed alone, the C++ side would lose its methods."""
    work = _CompletedWork(tensors)
    alive.append(work)
    return work.boxed()


_FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE


def dtensor_implicit_replication() -> bool:
    """Whether DTensor's dispatch takes plain tensors as replicated (``implicit_replication()``
    sets it; a property of the dispatcher)."""
    return DTensor._op_dispatcher._allow_implicit_replication


def dtensor_op_handlers() -> dict:
    """DTensor's handlers replacing ops' dispatch (``loss_parallel()``'s, context parallelism's)."""
    return DTensor._op_dispatcher._custom_op_handlers


def function_mode_count() -> int:
    """How many torch function modes are active (a default device is one)."""
    return torch._C._len_torch_function_stack()


def fake_like(fake_mode, like: torch.Tensor, base: torch.Tensor | None, requires_grad: bool) -> torch.Tensor:
    """A fake tensor of ``fake_mode`` with ``like``'s sizes, strides and dtype: a view of
    ``base``'s storage at ``like``'s offset, or (``base`` None) fresh storage. What the fake
    mode would make for an op's output, without running the op's meta function (the same
    kernel invocation the fake mode uses, and its converter's wrapping). No torch function
    mode sees it: while tracing, the annotator would look at each of its calls."""
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    with torch._C.DisableTorchFunction():
        with torch.no_grad(), in_kernel_invocation_manager(fake_mode):
            if base is None:
                meta = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")
            else:
                meta = torch.ops.aten.as_strided.default(base, like.shape, like.stride(), like.storage_offset())
        meta.requires_grad_(requires_grad)
        return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, like.device)


def fake_in_storage(fake_mode, like: torch.Tensor, holder: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``fake_mode`` with ``like``'s sizes, strides, offset and dtype, in
    the storage of the fake ``holder`` (which may have another dtype), on ``holder``'s
    device (``like`` may be a meta tensor)."""
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    with torch.no_grad(), in_kernel_invocation_manager(fake_mode):
        meta = torch.empty(0, dtype=like.dtype, device="meta")
        meta.set_(holder.untyped_storage(), like.storage_offset(), like.shape, like.stride())
    meta.requires_grad_(like.requires_grad)
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, holder.device)


def storage_id(t: torch.Tensor) -> int:
    """Which storage a (fake) tensor's data lives in: equal for tensors sharing memory."""
    return t.untyped_storage()._cdata


def function_modes() -> list:
    """The torch function modes active now, innermost last."""
    count = torch._C._len_torch_function_stack()
    return [torch._C._get_function_stack_at(i) for i in range(count)] if count else []


@contextlib.contextmanager
def function_modes_off():
    """The torch function modes put aside, and back after."""
    modes = []
    while torch._C._len_torch_function_stack():
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def dispatch_modes() -> list:
    """The torch dispatch modes active now, innermost last (a user's: dtcompile's own
    recording modes are among them while it traces)."""
    count = torch._C._len_torch_dispatch_stack()
    return [torch._C._get_dispatch_stack_at(i) for i in range(count)] if count else []


def mutation_on_saved_allowed() -> bool:
    """Whether ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` is active (its flag
    is a private global of that module; no public API tells)."""
    return bool(getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False))


def saved_tensors_hooks() -> tuple | None:
    """The innermost ``saved_tensors_hooks`` (pack, unpack) active now; None without."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def dtensor_refused_symbols(error: BaseException) -> bool:
    """An error raised inside DTensor about symbolic sizes (its sharding propagation, a
    spec it hashes), or an assertion there (``argmax`` asserts its shard offsets are
    ints): what eager, with no symbols, never meets. (Traced again with the call's sizes,
    an error that is not about symbols is met again, and raised.)"""
    words = ("symbolic", "SymInt", "Size must be int")  # (the last: torch 2.10's reshape under inference_mode)
    if isinstance(error, SymbolsRefused):
        return True
    if not isinstance(error, AssertionError) and not any(word in str(error) for word in words):
        return False
    frame = error.__traceback__
    while frame is not None:
        if "torch/distributed/tensor/" in frame.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.tb_next
    return False


def functorch_transform() -> str | None:
    """The torch.func transform running now (``grad``, ``vmap``, ...), or None."""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    return None if interpreter is None else interpreter.key().name.lower()


def dispatch_modes_off():
    """No torch dispatch mode active (as inside a mode's ``__torch_dispatch__``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def fake_mode_active() -> bool:
    """Whether a FakeTensorMode is the active dispatch mode (DTensor's sharding propagation
    runs its metadata computations under one): there is no public query."""
    return torch._C._get_dispatch_mode(_FAKE_MODE_KEY) is not None


# A ShapeEnv's values of its symbols, for a number read from tensor data whose value is
# computed while tracing (capture/data_branches.py). The ShapeEnv then answers branches on
# it and records each as a runtime assert, as for torch.compile's real-tensor propagation.
# No public API sets these; torch 2.11 renamed all three.


def set_data_value(shape_env, symbol, value) -> None:
    setter = getattr(shape_env, "set_real_tensor_prop_unbacked_vals", None) or shape_env.set_unbacked_var_to_val
    setter(symbol, value)


def symbol_values(shape_env) -> dict:
    """The values known of the ShapeEnv's symbols: sizes traced, and numbers read from data."""
    backed = getattr(shape_env, "backed_var_to_val", None)
    data = getattr(shape_env, "real_tensor_prop_unbacked_vals", None)
    return {
        **(shape_env.var_to_val if backed is None else backed),
        **(shape_env.unbacked_var_to_val if data is None else data),
    }


# A _MaskPartial placement (a row-parallel embedding's output) keeps the mask of the
# indices each rank looked up, for the reduction that follows; the epilogue fills it with
# each call's mask as eager's embedding would. DTensor has no public API for it.


def mask_buffer(placement):
    """A placement's mask buffer (a _MaskPartial's), or None."""
    return getattr(placement, "mask_buffer", None)


def keep_mask(placement, mask) -> None:
    """What eager's embedding does after its lookup: the placement keeps this call's mask."""
    placement.mask_buffer.materialize_mask(mask)


# Gathering a tensor from every rank into one buffer without Python's checks: the
# ProcessGroup's own method (what ``dist.all_gather_into_tensor`` ends in), about 20 us
# less per call on Gloo. Generated programs call it by this name.
def allgather_into(group, output: torch.Tensor, source: torch.Tensor):
    return group._allgather_base(output, source)


def shape_guards(shape_env) -> list:
    """What a trace assumed of its symbolic sizes: the ShapeEnv's guards, simplified (no
    public API lists them; torch.compile turns them into its own guards)."""
    return [shape_env.simplify(guard.expr) for guard in shape_env.guards]


def symbol_range(shape_env, symbol):
    """The range the ShapeEnv knows for a size symbol (``ValueRanges``), or None."""
    return shape_env.var_to_range.get(symbol)


def runtime_asserts(shape_env) -> list:
    """``(expression, message)`` of each assertion the ShapeEnv deferred to run time
    (branches answered with a number read from data, among others)."""
    return [(a.expr, a.msg) for asserts in shape_env.deferred_runtime_asserts.values() for a in asserts]


try:  # torch's C++ check of many tensors' metadata at once (what Dynamo's guards use)
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # prologues then check each tensor in Python
    TensorGuards = None

try:  # a dict's version: changes whenever the dict does (Dynamo's dict guards use it)
    from torch._C._dynamo.guards import dict_version
except ImportError:  # prologues then compare dicts' contents at every call
    dict_version = None


def _versions_follow_changes() -> bool:
    """Whether every change prologues rely on (``dict_changes``) gives the dict a new
    version on this Python. Where one does not, versions are not used at all."""
    dicts, changes = dict_changes()
    for change in changes:
        before = [dict_version(d) for d in dicts]
        change()
        if [dict_version(d) for d in dicts] == before:
            return False
    return True


if dict_version is not None and not _versions_follow_changes():
    dict_version = None


@contextlib.contextmanager
def decomposed_strategies_untraced():
    """DTensor's strategies for ops it derives through a decomposition (``addmv_`` of a
    ``Shard(0)`` DTensor), found outside the tracing modes where the op's schema holds no
    symbol: the decomposition runs once per candidate placement on meta tensors, and under
    tracing's fake mode DTensor takes its uncached path, each through the recorder (19 s for
    one ``addmv_``, eager's 1 s). The strategy is a function of the specs alone. (torch 2.10
    has no such strategies.)"""
    from torch.utils._pytree import tree_flatten

    try:
        from torch.distributed.tensor._decompositions import DecompShardingStrategy
    except ImportError:
        yield
        return

    propagate = DecompShardingStrategy.propagate_strategy

    def untraced(self, op_schema):
        leaves = tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))[0]
        shapes = [getattr(getattr(leaf, "tensor_meta", None), "shape", ()) for leaf in leaves]
        if any(isinstance(s, torch.SymInt) for shape in shapes for s in shape):
            return propagate(self, op_schema)
        with dispatch_modes_off(), torch._C.DisableTorchFunction(), torch._C._DisablePythonDispatcher():
            return propagate(self, op_schema)

    DecompShardingStrategy.propagate_strategy = untraced
    try:
        yield
    finally:
        DecompShardingStrategy.propagate_strategy = propagate
