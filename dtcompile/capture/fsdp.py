"""Modules managed by FSDP2's ``fully_shard``, traced the SimpleFSDP way.

FSDP2 keeps each parameter sharded over the data-parallel mesh dim (a DTensor, the
module's registered parameter) and, in hooks around each managed module's forward,
all-gathers it into flat buffers, swaps the unsharded parameter in, frees it again, and
reduce-scatters its gradient from a post-accumulate-grad hook. None of that can be
recorded: the buffers are resized in place, the hooks act on autograd's accumulation,
and the state machine runs once per call.

While a call is traced, the FSDP hooks of each managed module are replaced by two that
say the same thing with DTensor: before the module's forward, each sharded parameter
(the proxy DTensor ``ModuleState`` put in the module's table) is redistributed to
Replicate over the dp mesh dim, cast to the mixed-precision ``param_dtype`` first; its
local tensor (for a TP parameter, a DTensor on the TP mesh with the parameter's TP
placements) is put in the module's table, and after the forward the sharded parameter is
put back. The all-gathers are DTensor's; so are the gradient reduce-scatters, which are
the backward of that redistribution: the unsharded gradient is declared ``Partial("avg")``
over dp (FSDP2 averages over the dp ranks), cast to ``reduce_dtype`` before the
collective and back to the parameter's dtype after it. The sharded parameters are the
differentiable inputs, so their gradients come back as DTensors sharded as FSDP2 shards
them (``Shard(0)``, or ``_StridedShard`` with TP).

FSDP2 has no public API for its parameter groups; what is read of its state (the
``FSDPState`` of a module, its ``FSDPParamGroup``\\ s and their ``FSDPParam``\\ s) is read
in :func:`_fsdp_groups` only. Options this route does not express raise
:class:`UnsupportedFSDPError` naming them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..core import TracingError, fsdp_internals
from ..core.fsdp_internals import fsdp_cast_inputs, fsdp_cast_output, fsdp_param_groups, fsdp_unsharded_spec
from .fsdp_gather import buckets, unshard, unshard_group
from .graph_reach import reached_through
from .python_reads import ABSENT, Read


class UnsupportedFSDPError(TracingError):
    """An FSDP2 option or layout dtcompile does not compile."""


@dataclass
class ShardedParameter:
    """One parameter FSDP2 manages: where the module tree holds it and how it is unsharded."""

    owners: list[tuple[torch.nn.Module, str]]  # (module, attribute name): the owner, then shared ones
    name: str  # for messages
    param_dtype: torch.dtype | None  # cast before the all-gather (mixed precision)
    reduce_dtype: torch.dtype | None  # the dtype the gradient is reduced in
    tp_spec: object | None  # the unsharded parameter's spec on the TP mesh; None: a plain tensor
    dp_mesh: object = None  # the 1-D mesh FSDP2 shards over (the dp dim)
    # Sharded evenly on dim 0 (every rank's shard has the same shape): it can share one
    # all-gather with its group's other such parameters (see ``unshard_group``).
    even_on_dim0: bool = False
    dtype: torch.dtype | None = None  # the sharded parameter's
    sharded: object = None  # FSDP2's sharded parameter, which its hooks put back in the module


@dataclass
class ManagedModule:
    """A module ``fully_shard`` manages, with the parameters its forward unshards."""

    module: torch.nn.Module
    state: object  # FSDP2's FSDPState
    params: list[ShardedParameter]
    reshard_after_forward: bool
    reduce_grads: bool  # False after ``set_requires_gradient_sync(False)``
    # The keys of FSDP2's own hooks in the module's forward pre-hook and hook tables.
    hook_ids: tuple[int, int]


def _is_managed(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def reaches_fsdp(modules) -> bool:
    """Whether any of ``modules`` (or their submodules) is managed by ``fully_shard``."""
    return any(_is_managed(m) for module in modules for m in module.modules())


def refuse_fsdp_reached(modules: list) -> None:
    """A function (not the module itself) reaching a module ``fully_shard`` manages: its
    hooks are traced only where the module is what is compiled."""
    if reaches_fsdp(modules):
        raise TracingError(
            "dtcompile.jit: the function calls a module managed by FSDP2's fully_shard; compile the module "
            "itself (dtcompile.jit(model)) and compute the loss outside it"
        )


def _refuse(what: str, where: str) -> UnsupportedFSDPError:
    return UnsupportedFSDPError(
        f"dtcompile.jit: {what} (FSDP2 module {where or 'the root'!r}) is not supported; dtcompile compiles "
        "fully_shard over one data-parallel mesh dim (with or without TP), MixedPrecisionPolicy's param, reduce "
        "and output dtypes, reshard_after_forward and set_requires_gradient_sync"
    )


def info_name(fsdp_param) -> str:
    info = fsdp_param._module_info
    return f"{type(info.module).__name__}.{info.param_name}"


def _fsdp_groups(root: torch.nn.Module) -> list[ManagedModule]:
    """The modules under ``root`` that ``fully_shard`` manages, outermost first, read from
    FSDP2's private state (the one place that does)."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    managed, grad = [], torch.is_grad_enabled()
    in_tree = set(map(id, root.modules()))
    for path, module in root.named_modules():
        if not _is_managed(module):
            continue
        state = module._get_fsdp_state()
        if len(state._modules) != 1:
            raise _refuse("fully_shard of several modules as one group", path)
        params = []
        reduce_grads = True
        reshard = False
        for group in fsdp_param_groups(state):
            info = group.mesh_info
            if (
                isinstance(info, HSDPMeshInfo)
                or not isinstance(info, FSDPMeshInfo)
                or getattr(info, "is_spmd_mesh", False)
            ):
                raise _refuse(f"a data-parallel layout other than one sharded mesh dim ({type(info).__name__})", path)
            if isinstance(group.offload_policy, CPUOffloadPolicy):
                raise _refuse("CPUOffloadPolicy", path)
            if getattr(group, "gradient_divide_factor", None) is not None or getattr(
                group, "force_sum_reduction_for_comms", False
            ):
                raise _refuse("a custom gradient divide factor or sum-only reductions", path)
            if getattr(group, "_all_reduce_hook", None) is not None:
                raise _refuse("an all-reduce hook", path)
            if getattr(group, "reduce_scatter_unused_params", False):
                raise _refuse("set_reduce_scatter_unused_params", path)
            if not getattr(group, "reshard_after_backward", True):  # eager keeps the unsharded ones registered
                raise _refuse("set_reshard_after_backward(False)", path)
            mp = group.mp_policy
            reduce_grads = reduce_grads and group.reduce_grads
            # The root of a module tree is not resharded after forward unless asked
            # (FSDP2's lazy initialization clears it), whatever post_forward_mesh_info says.
            auto = state._auto_reshard_after_forward and module is root
            reshard = reshard or (group.post_forward_mesh_info is not None and not auto)
            for fsdp_param in group.fsdp_params:
                if hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
                    raise _refuse("an all-gather extension (fsdp_pre_all_gather)", path)
                if not group.reduce_grads and fsdp_param.sharded_param._post_accumulate_grad_hooks and grad:
                    raise TracingError(
                        f"dtcompile.jit: a post-accumulate-grad hook on the parameter {info_name(fsdp_param)} while "
                        "FSDP2 accumulates without sync (set_requires_gradient_sync(False)): eager's FSDP2 calls it "
                        "at the synced backward only, a compiled step at every one (it reduces each micro-batch). "
                        "Register it for the synced step, or keep gradient sync on"
                    )
                if fsdp_param.sharded_param._backward_hooks and grad:
                    raise TracingError(
                        f"dtcompile.jit: a tensor hook (register_hook) on the parameter {info_name(fsdp_param)} that "
                        "FSDP2 shards: eager's FSDP2 never calls it (its autograd graph holds the unsharded "
                        "parameter), a compiled step would. Remove it, or use register_post_accumulate_grad_hook"
                    )
                info_ = fsdp_param._module_info
                orig = fsdp_param.sharded_param.dtype
                # FSDP2's clamping (FSDPParam.init_dtype_attrs): no cast to the dtype one has.
                param_dtype = mp.param_dtype
                if param_dtype == orig or not orig.is_floating_point:
                    param_dtype = None
                reduce_dtype = mp.reduce_dtype if mp.reduce_dtype != mp.param_dtype else None
                if reduce_dtype is None and param_dtype is not None:
                    reduce_dtype = param_dtype  # FSDP2 reduces in the gradient's dtype
                owners = [(info_.module, info_.param_name)]
                owners += list(zip(info_.shared_modules, info_.shared_param_names))
                if not all(id(owner) in in_tree for owner, _ in owners):  # (eager's FSDP2 gathers it, unused)
                    raise TracingError(
                        f"dtcompile.jit: the FSDP2 parameter {info_name(fsdp_param)} of {path or 'the root'!r} belongs to a module no "
                        "longer in the model (replaced after fully_shard); apply fully_shard to the model as it is now"
                    )
                size, dim = fsdp_param._orig_size, fsdp_param.fsdp_placement.dim
                params.append(
                    ShardedParameter(
                        owners,
                        f"{path}.{info_.param_name}" if path else info_.param_name,
                        param_dtype,
                        reduce_dtype,
                        fsdp_unsharded_spec(fsdp_param) if fsdp_param.is_dtensor else None,
                        info.mesh,
                        dim == 0 and len(size) > 0 and size[0] % info.shard_mesh_size == 0,
                        orig,
                        fsdp_param.sharded_param,
                    )
                )
        hook_ids = (state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id)
        managed.append(ManagedModule(module, state, params, reshard, reduce_grads, hook_ids))
    return managed


# FSDP2's options of a parameter group that its setters change (``set_all_reduce_hook``,
# ``set_reshard_after_backward``, ``set_reshard_after_forward``, ``set_gradient_divide_factor``):
# refused or traced as they are when compiling, so guarded. (``reduce_grads``, which
# ``set_requires_gradient_sync`` sets, changes nothing the program computes: see the README.)
_OPTIONS = (
    "_all_reduce_hook",
    "gradient_divide_factor",
    "force_sum_reduction_for_comms",
    "reduce_scatter_unused_params",
    "reshard_after_backward",
    "post_forward_mesh_info",
    "offload_policy",
)


def option_reads(root: torch.nn.Module) -> list[Read]:
    """The FSDP2 options of the modules ``fully_shard`` manages under ``root``, as they are
    now, for the prologue to guard: one set after compiling makes the call compile again.
    A managed parameter replaced in its module is refused: eager's FSDP2 puts its own back
    at the next forward and uses it."""
    reads = []
    for managed in _fsdp_groups(root):
        for param in managed.params:
            owner, name = param.owners[0]
            reads.append(Read(owner._parameters, name, param.sharded, f"FSDP2's parameter {param.name}"))
            for hooks in ("_backward_hooks", "_post_accumulate_grad_hooks"):  # (registered later: compiled anew)
                where = f"the {hooks.strip('_').replace('_', ' ')} of {param.name}"
                reads.append(Read(param.sharded, None, getattr(param.sharded, hooks), where, attribute=hooks))
            if owner._parameters.get(name) is not param.sharded and isinstance(owner._parameters.get(name), DTensor):
                raise TracingError(
                    f"dtcompile.jit: the FSDP2 parameter {param.name} was replaced by another Parameter; eager's "
                    "FSDP2 puts its own sharded one back at the next forward and uses it. Replace parameters "
                    "before fully_shard, or copy into the sharded one (with torch.no_grad(): w.copy_(new))"
                )
    for path, module in root.named_modules():
        if _is_managed(module):
            for i, group in enumerate(fsdp_param_groups(module._get_fsdp_state())):
                for option in _OPTIONS:
                    where = f"FSDP2's {option} of the parameter group {i} of {path or 'the root'!r}"
                    reads.append(Read(group, None, getattr(group, option, ABSENT), where, attribute=option))
    return reads


class FSDPTracing:
    """While entered, the FSDP hooks of the managed modules under ``root`` are replaced by
    unsharding with DTensor (see the module docstring); on exit they are put back."""

    def __init__(self, root: torch.nn.Module):
        self.managed = _fsdp_groups(root)
        self._saved: list[tuple[dict, int, object]] = []  # (hook table, hook id, FSDP's hook)
        self._sharded: dict[int, list[list[torch.Tensor]]] = {}  # id(managed) -> sharded values, per call
        # The labels of the sharded parameters' local proxies whose modules reshard after
        # forward: the backward all-gathers them again (transforms/split.py).
        self.recompute_from: set[str] = set()
        self._methods = fsdp_internals.forward_methods_refused(bool(self.managed))
        # Eager's FSDP2 leaves a module that does not reshard after forward unsharded, its
        # parameters full tensors until the root's forward ends: (managed, sharded) to put back then.
        self._root = self.managed[0] if self.managed and self.managed[0].module is root else None
        self._unsharded: dict[int, tuple] = {}

    def __enter__(self) -> FSDPTracing:
        self._methods.__enter__()
        for managed in self.managed:
            pre_id, post_id = managed.hook_ids
            for table, key, hook in (
                (managed.module._forward_pre_hooks, pre_id, self._pre_forward(managed)),
                (managed.module._forward_hooks, post_id, self._post_forward(managed)),
            ):
                self._saved.append((table, key, table[key]))
                table[key] = hook
        return self

    def __exit__(self, *exc) -> None:
        for table, key, hook in reversed(self._saved):
            table[key] = hook
        self._saved.clear()
        self._methods.__exit__(*exc)

    def _pre_forward(self, managed: ManagedModule):
        def hook(module, args, kwargs):
            args, kwargs = fsdp_cast_inputs(managed.state, args, kwargs)
            if id(managed) in self._unsharded:  # (called again in the call: still unsharded, as in eager)
                self._sharded.setdefault(id(managed), []).append(self._unsharded.pop(id(managed))[1])
                return args, kwargs
            sharded = []
            for param in managed.params:
                owner, name = param.owners[0]
                value = owner._parameters[name]
                if not isinstance(value, DTensor):
                    raise TracingError(
                        f"dtcompile.jit: the FSDP2 parameter {param.name} is not sharded when its module's forward "
                        "starts: its module was unsharded before the call (unshard(), an explicit prefetch, or an "
                        "eager call of the module, whose root FSDP2 leaves unsharded; call reshard() first: the "
                        "compiled program gathers the parameters itself), or it is called within itself"
                    )
                sharded.append(value)
                if managed.reshard_after_forward:
                    self.recompute_from.add(value._local_tensor.label)
            for bucket in buckets(managed.params):
                params = [managed.params[i] for i in bucket]
                values = [sharded[i] for i in bucket]
                fulls = unshard_group(values, params) if len(bucket) > 1 else [unshard(values[0], params[0])]
                for value, full in zip(values, fulls) if len(bucket) > 1 else ():  # (its gradient None where eager's)
                    reached_through(value, full)
                for param, full in zip(params, fulls):
                    for table_owner, table_name in param.owners:
                        table_owner._parameters[table_name] = full
            self._sharded.setdefault(id(managed), []).append(sharded)
            return args, kwargs

        return hook

    def _post_forward(self, managed: ManagedModule):
        def hook(module, args, output):
            sharded, restored = self._sharded[id(managed)].pop(), []
            if managed is self._root:
                restored, self._unsharded = [*self._unsharded.values()], {}
            elif not managed.reshard_after_forward and self._root is not None:
                self._unsharded[id(managed)], sharded = (managed, sharded), None
            for held, values in [*restored, (managed, sharded)] if sharded is not None else ():
                for param, value in zip(held.params, values):
                    for owner, name in param.owners:
                        owner._parameters[name] = value
            return fsdp_cast_output(managed.state, output)

        return hook


def refusing_recomputes(managed: bool, capture_backward, *args):
    """``capture_backward(*args)``, where activation checkpointing's recompute inside a
    module FSDP2 manages (``managed``: the call has some) fails with a clear error: eager's
    FSDP2 unshards the parameters again for it, the hooks of :class:`FSDPTracing` do not."""
    try:
        return capture_backward(*args)
    except Exception as error:
        if managed and _recomputing(error.__traceback__):
            raise TracingError(
                "dtcompile.jit: the backward runs the module's code again (activation checkpointing's "
                "recompute) inside a module FSDP2 manages, whose parameters are sharded again by then; this "
                f"is not supported yet ({type(error).__name__}: {error}). Compile without checkpointing inside "
                "fully_shard'ed modules"
            ) from error
        raise


def _recomputing(frames) -> bool:
    """Whether an error's traceback passes through activation checkpointing's recompute."""
    while frames is not None:
        if frames.tb_frame.f_globals.get("__name__") == "torch.utils.checkpoint":
            return True
        frames = frames.tb_next
    return False
