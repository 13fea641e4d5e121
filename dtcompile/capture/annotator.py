"""Notes on the recorded symbols: the torch-level call each came from.

:class:`CallAnnotator`, a TorchFunctionMode active while a call is traced (with the
recorder, ``recorder.py``), sees each torch-level call the user's code makes
(``F.linear``, ``Tensor.view``) and notes it, with the placements of its DTensor inputs
and outputs, on the symbols recorded while it ran, and on the autograd nodes it made (so
the backward's symbols say which forward call they differentiate). It also refuses data
reads and checks hooks registered on traced tensors, and swaps a closed-over DTensor for
its traced stand-in.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from torch._subclasses.fake_tensor import FakeTensor, is_fake
from torch.distributed.tensor import DTensor, Replicate
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_map

from ..core import Note, TensorProxy, TracingError, data_dependent_error
from ..core.code_origin import dtcompile_code, framework_code
from ..core.proxy import PASSING_FRAMES
from ..core.symbol import leaves as leaves_of
from ..core.torch_internals import dtensor_implicit_replication
from . import closed_over, traced_errors
from .block_training import BlockReplayFailed
from .code_ran import CodeRan
from .data_branches import branch_refused
from .data_sized_calls import READ_AS_NUMBERS, sizes_decided
from .eager_errors import dtype_checked, eager_error, eager_failure, out_with_grad
from .graph_reach import tag_backward_nodes
from .method_checks import (
    AUTOGRAD_ATTRIBUTES,
    CALLER_ATTRIBUTES,
    CHECKED,
    NOT_ANSWERED,
    autograd_attribute,
    caller_read_refusal,
    check_method,
    non_leaf_argument,
    real_tensor,
    received,
    received_base,
)
from .number_tensors import FACTORIES, bools_as_bools, holds_traced_numbers, tensor_of_numbers
from .op_memo import MISSED, OpMemo, state
from .placements import describe_argument, describe_output
from .recorder import Recording
from .tensor_versions import made_again_history
from .traced_errors import data_read_refusal, lost_out_write, out_tensors, out_written, refusal, symbolic_sizes_refusal
from .verified import VerifyFailed

# Tensor methods that hand the caller a tensor's data outside torch (NumPy, Python lists).
_DATA_READS = {torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.data_ptr, torch.Tensor.__dlpack__}
# Factories that read the values of the tensors in a (nested) list of their data.
_NEW_TENSORS = {torch.tensor, torch.as_tensor, torch.asarray}
_HOOK_REGISTRATIONS = {torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook}

# Tensor methods that read a tensor's metadata and dispatch no op. On a proxy or a fake,
# what dtcompile's own code asks while tracing (a replayed block's output, an equivalence
# key), they need none of the checks, DTensor captures or memo keys of a torch-level call.
_METADATA_NAMES = ("stride", "storage_offset", "untyped_storage", "is_conj", "is_neg", "size", "dim")
_METADATA_READS = {getattr(torch.Tensor, name) for name in _METADATA_NAMES}

_SYMBOLIC_NUMEL = "Cannot call numel() on tensor with symbolic sizes/strides"


_REAL_METADATA_GETTERS = frozenset(
    {"shape", "dtype", "requires_grad", "ndim", "is_cuda", "layout", "device", "nbytes", "itemsize"}
)
_REAL_METADATA_METHODS = {
    getattr(torch.Tensor, name)
    for name in ("size", "stride", "dim", "numel", "is_contiguous", "storage_offset", "__len__", "element_size")
    + ("dim_order", "nelement", "untyped_storage")
}


def _real_metadata_read(func, value) -> bool:
    """Whether ``func`` reads the metadata of a plain tensor the traced code holds as it is."""
    if not real_tensor(value) or isinstance(value, DTensor) or value.device.type == "meta" or value.requires_grad:
        return False  # (one that requires grad would become a differentiable input of the program)
    if getattr(func, "__name__", "") == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _REAL_METADATA_GETTERS
    return func in _REAL_METADATA_METHODS


def _is_traced(value) -> bool:
    """A proxy, or a DTensor around one."""
    return isinstance(value, TensorProxy) or isinstance(getattr(value, "_local_tensor", None), TensorProxy)


def _replicated(value, mesh):
    """A plain tensor as the replicated DTensor ``implicit_replication()`` takes it for."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value


def _short_name(func) -> str:
    name = resolve_name(func) or getattr(func, "__name__", repr(func))
    for prefix, short in (("torch.nn.functional.", "F."), ("torch.Tensor.", "Tensor."), ("torch._C._nn.", "F.")):
        if name.startswith(prefix):
            return short + name[len(prefix) :]
    return name


# Tensor attributes whose assignment changes the tensor outside any op, and what to do instead.
_UNRECORDED_SETS = {
    "data": "use x.copy_(y), or return y",
    "grad": "set gradients outside the call",
}


def _calling_module(depth: int) -> str:
    """The Python module of the code running the current torch-level call (``depth`` frames up)."""
    frame = sys._getframe(depth + 1)
    if frame.f_globals.get("__name__") == "torch.overrides" and frame.f_back is not None:
        frame = frame.f_back  # a Tensor method written in Python (``__len__``) hands the call on
        if frame.f_globals.get("__name__") == "torch._tensor" and frame.f_back is not None:
            frame = frame.f_back
    return frame.f_globals.get("__name__", "")


def _user_frame(depth: int = 2) -> bool:
    """Whether the Python code running the current torch-level call (``depth`` frames up:
    this mode's handler is called from it) is the user's, not torch's or dtcompile's."""
    return not framework_code(_calling_module(depth))


def _grad_called_by_user() -> bool:
    """Whether the ``torch.autograd.grad`` running now was called by the user's code."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not torch.autograd.grad.__code__:
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    return caller is not None and not framework_code(caller.f_globals.get("__name__", ""))


def _is_dtensor(value) -> bool:
    return isinstance(value, DTensor)


def _reads_grad_of_the_call(tensor) -> bool:
    """Whether the user's code reads ``.grad`` of a traced tensor, or any code (a library's:
    ``clip_grad_norm_`` of the call's parameters) that of a tensor the call received,
    outside a traced backward: the traced tensor has no gradient, the caller's may."""
    if not _is_traced(tensor):
        return False
    return (received(tensor) is not None and torch._C._current_autograd_node() is None) or _user_frame(3)


_LEAF_IN_PLACE = "a leaf Variable that requires grad is being used in an in-place operation"


class CallAnnotator(TorchFunctionMode):
    """Notes on each recorded symbol the torch-level call it came from, and tells the
    recording when DTensor is handling a call (its factory ops are then its own). A
    DTensor the code closes over is replaced by its traced stand-in (``capture_dtensor``)."""

    def __init__(self, recording: Recording, memo: bool = True):
        super().__init__()
        self.recording = recording
        self.memo = OpMemo(recording, memo)
        self.in_backward = 0  # inside torch.autograd.grad (closed_over.grad_under)
        self.code_ran = recording.code_ran = CodeRan(
            sys._getframe(1), self._entry_met
        )  # (read after tracing: ``python_guards``)

    def _entry_met(self, frame) -> None:
        """User code that library code called (``code_ran.py``): what it can change is
        snapshotted, as a hook's is."""
        if self.recording.snapshot is not None:
            self.recording.snapshot.add_frame(frame, f"{frame.f_code.co_qualname}, which library code called")

    def __enter__(self):
        self._entry_points = closed_over.stand_ins_at_entry_points(self.recording)
        self._entry_points.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._entry_points.__exit__(*exc)
        self.code_ran.release()
        return super().__exit__(*exc)

    def _check_hook(self, func, args) -> None:
        """A hook registered on a traced tensor runs while the backward is traced: its
        effects on Python data are checked like the function's own (``recording.snapshot``)."""
        if func is not torch.Tensor.register_hook:
            raise TracingError(
                f"dtcompile.jit: {_short_name(func)} inside the call (a forward pre-hook's: Hugging Face's "
                "ReplicatedWithGradAllReduce, whose Qwen3 and Gemma3 plans train only eagerly) is not supported; "
                "one the caller registered on a parameter before the call runs"
            )
        self.recording.tensor_hooks += 1  # (no block registering one is replayed)
        if self.recording.snapshot is not None and (hook := args[1] if len(args) > 1 else None) is not None:
            self.recording.snapshot.add_callable(hook, f"the tensor hook {getattr(hook, '__qualname__', hook)}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.code_ran.note(sys._getframe(1))
        if self.in_backward:
            if not _user_frame():
                return func(*args, **kwargs)  # torch's and DTensor's own code in a traced backward
            self.recording.users_backward_ran = True  # (its Python state is checked at each backward)
        made = self.recording.made_again
        if made and (history := made_again_history(func, args, kwargs, made)) and _user_frame():
            raise VerifyFailed(f"{history} of a tensor made again, not dispatched")  # (none is a view: traced again)
        if (
            func is torch.Tensor.retain_grad
            and self.memo.aliases_kept
            and _is_traced(args[0])
            and torch.is_grad_enabled()
        ):
            # A replayed block's code does not run (its retain_grad() neither), and a block's recorded
            # backward would set the retained gradient of its output: traced again, every block as it is.
            raise BlockReplayFailed("retain_grad() in the call")
        if func in CHECKED:
            answer = check_method(func, args, self.recording, kwargs)
            if answer is not NOT_ANSWERED:
                return answer
        if func is torch.autograd.grad:
            on_dtensors = any(map(_is_dtensor, leaves_of((args, kwargs))))
            return closed_over.grad_under(self, func, args, kwargs, on_dtensors, users=_grad_called_by_user())
        if func in _METADATA_READS and isinstance(args[0], (TensorProxy, FakeTensor)):
            return func(*args, **kwargs)
        if args and _real_metadata_read(func, args[0]) and _user_frame():
            # A closed-over tensor's sizes or dtype, baked into the program: it becomes an input
            # of the program, whose metadata the prologue guards (``t.resize_(5)`` is seen).
            self.recording.capture(args[0])
        if getattr(func, "__name__", "") in ("__get__", "__set__"):
            attribute = getattr(getattr(func, "__self__", None), "__name__", "")
            if func.__name__ == "__set__" and attribute in _UNRECORDED_SETS and args and not is_fake(args[0]):
                # On a traced tensor, or on a real one the call closes over (``w.grad = g``,
                # ``zero_grad()`` inside): made once, while tracing, with a traced value.
                what = "a traced tensor" if _is_traced(args[0]) else "a tensor the call closes over"
                raise TracingError(
                    f"dtcompile.jit: Tensor.{attribute} is assigned on {what}; that is not recorded, so a "
                    f"compiled call would not make it: {_UNRECORDED_SETS[attribute]}"
                )
            if func.__name__ == "__get__" and attribute in closed_over.COMPUTED_ATTRIBUTES and args:
                args = (closed_over.stand_in(self.recording, args[0]), *args[1:])  # ``w.T`` of a closed-over DTensor
            if func.__name__ == "__get__" and attribute in AUTOGRAD_ATTRIBUTES and args and _user_frame():
                answer = autograd_attribute(attribute, args[0], self.recording)
                if answer is not NOT_ANSWERED:
                    return answer
            if func.__name__ == "__get__" and attribute in CALLER_ATTRIBUTES and args and _user_frame():
                path = received_base(args[0], self.recording)
                if path is not None:
                    raise caller_read_refusal(f".{attribute}", path)
                if attribute == "_version" and real_tensor(args[0]):
                    raise TracingError(
                        "dtcompile.jit: the traced code reads ._version of a tensor the call closes over: it counts "
                        "the writes to it, which change from call to call. Read it before the call"
                    )
            if func.__name__ == "__get__" and attribute == "nbytes" and args and _is_traced(args[0]):
                return args[0].numel() * args[0].element_size()  # torch's asks for a concrete count
            if func.__name__ == "__get__" and attribute == "grad" and args and real_tensor(args[0]):
                grad = func(*args, **kwargs)  # a closed-over tensor's: guarded to be this one (tracer)
                self.recording.grad_reads.append((args[0], grad))
                return grad
            if func.__name__ == "__get__" and attribute == "grad" and args and _reads_grad_of_the_call(args[0]):
                raise TracingError(
                    "dtcompile.jit: the traced code reads .grad of a tensor of the call; a traced tensor has no "
                    "gradient while tracing, and a compiled call would not read the one it has then. Pass the "
                    "gradient as an argument"
                )
            return func(*args, **kwargs)
        if func in closed_over.DATA_READS and args and _user_frame():  # (a closed-over tensor's: as an argument's)
            args = (closed_over.read_through_proxy(self.recording, args[0]), *args[1:])
            if func is torch.Tensor.tolist and isinstance(args[0], TensorProxy):
                return args[0].tolist()
        leaves = leaves_of((args, kwargs))
        if func in _DATA_READS and any(_is_traced(x) for x in leaves):
            raise data_read_refusal(_short_name(func), func, args, kwargs)
        if func in _NEW_TENSORS and not isinstance(args[0], torch.Tensor) and any(_is_traced(x) for x in leaves):
            raise data_dependent_error(
                _short_name(func), "it reads the values of the traced tensors in its data; use torch.stack"
            )
        sizes_decided(func, args, kwargs, bool(self.recording.deferred_checks.sizes_made))  # (``squeeze``)
        if func in READ_AS_NUMBERS and any(map(_is_traced, leaves)):
            return READ_AS_NUMBERS[func](*args, **kwargs)  # (``torch.equal``)
        args, kwargs = bools_as_bools(func, args, kwargs, leaves)
        if func in FACTORIES and holds_traced_numbers(func, args, kwargs):
            func = tensor_of_numbers(func)  # (a size, a number read from data: computed at run time)
        if func in _HOOK_REGISTRATIONS and _is_traced(args[0]):
            self._check_hook(func, args)
        if any(map(closed_over.needs_stand_in, leaves)) and not dtcompile_code(_calling_module(1)):
            # (dtcompile's own calls on the real ones: putting back what tracing changed)
            writes = closed_over.writes_in_place(func, kwargs)
            args, kwargs = tree_map(lambda v: closed_over.stand_in(self.recording, v, writes), (args, kwargs))
            leaves = leaves_of((args, kwargs))
        if self.recording.call_log is not None:  # a layer's calls logged, or checked (``verified.py``)
            return self.recording.call_log.call(func, args, kwargs, partial(self._dispatch, func, args, kwargs, leaves))
        return self._dispatch(func, args, kwargs, leaves)

    def _dispatch(self, func, args: tuple, kwargs: dict, leaves: list):
        start = len(self.recording.bound_symbols)
        memo_key = self.memo.key(func, args, kwargs, leaves)
        if memo_key is not None:
            out = self.memo.replay(memo_key, leaves)
            if out is not MISSED:
                return out
            specs, before = [getattr(x, "_spec", None) for x in leaves], state(self.recording)
        grad = out_with_grad(kwargs, leaves)
        if (grad or dtype_checked(func, leaves)) and (eager := eager_failure(func, args, kwargs, grad)) is not None:
            raise eager  # a dtype eager's kernel rejects, which the traced form does not check
        handled_by_dtensor = any(isinstance(x, DTensor) for x in leaves)
        if handled_by_dtensor:
            self.recording.dtensor_modes.note()
        outer_dtensor_calls = self.recording.dtensor_calls
        if self.in_backward and not handled_by_dtensor:
            self.recording.dtensor_calls = 0  # the user's code in a backward, on plain tensors: the program's
        self.recording.dtensor_calls += handled_by_dtensor
        outer_call = self.recording.current_call, self.recording.call_start
        self.recording.current_call, self.recording.call_start = _short_name(func), len(self.recording.bound_symbols)
        outs = out_tensors(func, kwargs)
        try:
            out = traced_errors.operator_call(func, args, kwargs, handled_by_dtensor)
        except GuardOnDataDependentSymNode as error:  # ``bool(x.sum() > 0)``: named by this call
            raise data_dependent_error(_short_name(func), branch_refused(self.recording, error.cond)) from error
        except ValueError as error:
            if not str(error).startswith("Cannot view a tensor with shape"):
                raise
            raise RuntimeError(  # (torch's meta kernel raised a ValueError; eager's kernel this)
                f"view size is not compatible with input tensor's size and stride ({error}). Use .reshape(...) instead."
            ) from error
        except RuntimeError as error:
            if _SYMBOLIC_NUMEL in str(error) and func is torch.Tensor.__bool__ and not free_unbacked_symbols(args[0]):
                if all(size == 1 for size in args[0].shape):  # one element, at an offset a symbol gives
                    return self.__torch_function__(func, (), (args[0].clone(),), kwargs)
                raise RuntimeError(
                    "Boolean value of Tensor with more than one value is ambiguous"
                ) from error  # (sizes >= 2)
            refused = refusal(_short_name(func), error, received(args[0]) if args else None)
            if refused is not None:
                raise refused from error
            if (
                _SYMBOLIC_NUMEL in str(error)
                and handled_by_dtensor
                and not all(isinstance(x, DTensor) for x in leaves if isinstance(x, torch.Tensor))
            ):
                # DTensor asks a plain tensor beside a DTensor for its element count (one
                # element is replicated); a symbolic count is never one: eager's error, but
                # under implicit_replication(), where DTensor replicates it whatever its count.
                if not dtensor_implicit_replication():
                    raise RuntimeError(
                        f"{_short_name(func)} got mixed torch.Tensor and DTensor, need to convert all torch.Tensor "
                        "to DTensor before calling distributed operators!"
                    ) from error
                mesh = next(x.device_mesh for x in leaves if isinstance(x, DTensor))
                args, kwargs = tree_map(lambda v: _replicated(v, mesh), (args, kwargs))
                out = func(*args, **kwargs)
            else:
                argument = _LEAF_IN_PLACE in str(error) and non_leaf_argument(self.recording, leaves)
                if argument:  # a proxy is a leaf; eager's argument is not, and its in-place change runs
                    raise TracingError(
                        f"dtcompile.jit: {_short_name(func)} changes {argument} in place, a tensor that requires grad "
                        "and is not a leaf (made by an op that autograd records); a compiled call cannot extend its "
                        "graph. Clone it before the call, or change it outside"
                    ) from error
                # Torch's fake kernels may raise another type than eager's; a refusal of ours
                # stands (eager's kernel on zero stand-ins fails where it reads values).
                eager = None if isinstance(error, TracingError) else eager_error(func, args, kwargs, error)
                if eager is not None:
                    raise eager from error
                if _SYMBOLIC_NUMEL in str(error):  # (C++ code asking a symbolic size's value)
                    raise symbolic_sizes_refusal(_short_name(func), leaves) from error
                raise
        finally:
            self.recording.dtensor_calls = outer_dtensor_calls
            self.recording.current_call, self.recording.call_start = outer_call
        if outs is not None and not out_written(self.recording.bound_symbols[start:], outs):
            raise lost_out_write(_short_name(func))
        new = self.recording.bound_symbols[start:]
        if new:
            if self.in_backward:  # (only the user's calls reach here in a backward)
                self.recording.users_backward += new
            proxies: list[TensorProxy] = []
            inputs = [d for d in (describe_argument(v, proxies) for v in (*args, *kwargs.values())) if d is not None]
            name = _short_name(func).replace("{", "{{").replace("}", "}}")
            note = Note(f"{name}({', '.join(inputs)}) -> {describe_output(out)}", tuple(proxies))
            for bsym in new:
                if bsym.note is None:
                    bsym.note = note
            if torch.is_grad_enabled():
                tag_backward_nodes(leaves, leaves_of(out), note)
        if memo_key is not None:
            self.memo.keep(memo_key, leaves, specs, start, before, out)
        return out


PASSING_FRAMES.update((CallAnnotator._dispatch.__code__, traced_errors.operator_call.__code__))
