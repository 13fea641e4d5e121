"""What libraries see while dtcompile traces: a compiler tracing them, as under
torch.compile (``compiling``), but for torch's modules that must run as in eager."""

from __future__ import annotations

import contextlib
import sys
import types

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .errors import TracingError


def _hash_unless_from_data(original):
    def __hash__(self):
        if free_unbacked_symbols(self.node.expr):
            raise TypeError(f"unhashable: {self.node.expr} is a number read from tensor data")
        return original(self)

    return __hash__


class _CompilerNotCompiling:
    """``torch.compiler`` as ``_TorchNotCompiling`` gives it: not compiling, the rest torch's."""

    @staticmethod
    def is_compiling() -> bool:
        return False

    def __getattr__(self, name):
        return getattr(torch.compiler, name)


class _TorchNotCompiling:
    """``torch`` as torch's modules that must run as in eager see it while dtcompile traces
    (``_EAGER_MODULES``): ``torch.distributed.nn.functional``'s autograd collectives refuse
    under torch.compile (Dynamo cannot trace them), but dtcompile records the c10d calls
    they make; torch.optim's functional optimizers would compute Adam's bias corrections
    as float32 tensors, not as eager's Python floats."""

    compiler = _CompilerNotCompiling()

    def __getattr__(self, name):
        return getattr(torch, name)


class _FastPathsAsEager(_TorchNotCompiling):
    """``torch`` as ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` see it:
    their fused inference kernels (eval, no gradients) are taken as in eager, where the
    stand-ins of tracing (which have torch functions) would turn them away: other
    roundings. Eager's are turned away under a torch function mode of the caller's
    (``with torch.device(...)``): so are these, where the call began under one; and so is
    a fused kernel this torch cannot trace (no meta kernel: ``_transformer_encoder_layer_fwd``
    in torch 2.10), but for the encoder's nested-tensor path, refused below."""

    def __init__(self, fused: str):
        traceable = torch._C._dispatch_has_kernel_for_dispatch_key(fused, "Meta")
        encoder = torch.nn.TransformerEncoder.forward.__code__

        def has_torch_function(args) -> bool:
            return _CALLERS_MODES[0] or not (traceable or sys._getframe(1).f_code is encoder)

        self.overrides = types.SimpleNamespace(has_torch_function=has_torch_function)


class _TransformerFastPathRefused(_FastPathsAsEager):
    """``torch`` as ``nn.TransformerEncoder`` sees it: its nested-tensor fast path (eval, a
    padding mask, no gradients: padded positions zeros), which tracing cannot follow
    (nested tensors), refused where eager's checks let it run. Its check that the mask is
    left-aligned reads the mask's data: taken as passed, so a mask that is not is refused too."""

    @staticmethod
    def _nested_tensor_from_mask_left_aligned(*args, **kwargs) -> bool:
        return True

    @staticmethod
    def _nested_tensor_from_mask(*args, **kwargs):
        raise TracingError(
            "dtcompile.jit: nn.TransformerEncoder called in eval mode with a src_key_padding_mask and no "
            "gradients takes eager's nested-tensor fast path (where the mask is left-aligned: padded positions "
            "then zeros), which dtcompile cannot trace; build it with enable_nested_tensor=False, or call it "
            "outside the compiled function"
        )


# The modules that see torch as in eager while dtcompile traces (by name's start), and how.
_EAGER_MODULES = {
    "torch.distributed.nn.functional": _TorchNotCompiling(),
    "torch.optim.": _TorchNotCompiling(),
    "torch.nn.modules.activation": _FastPathsAsEager("aten::_native_multi_head_attention"),
    "torch.nn.modules.transformer": _TransformerFastPathRefused("aten::_transformer_encoder_layer_fwd"),
}


def _not_compiling() -> bool:
    return False


def _not_tracing(tensor=None) -> bool:
    return False


# Functions of libraries' modules that answer as in eager while dtcompile traces: Hugging
# Face's SDPA attention packs a one-token query's heads (GQA) only when not compiling, and
# eager's rounding is that path's; its masks skip a causal mask only when not traced
# (reading the padding mask, a branch on data checked at each call), and then take the
# attention module's own ``is_causal`` (False in a bidirectional model), else always causal.
_EAGER_ANSWERS = {
    "transformers.integrations.sdpa_attention": {"is_torchdynamo_compiling": _not_compiling},
    "transformers.masking_utils": {"is_tracing": _not_tracing},
}

_CALLERS_MODES = [False]  # whether the call began under a torch function mode of the caller's
_found: list = [0, []]  # (how many modules were loaded, the namespaces then found)


def _eager_namespaces() -> list:
    """``(namespace, torch as it sees it)`` of each loaded module of ``_EAGER_MODULES``;
    looked for again only where modules were loaded since (about 2,000 names: 2 ms)."""
    if _found[0] != len(sys.modules):
        _found[:] = [len(sys.modules), []]
        for name, module in list(sys.modules.items()):
            seen = next((seen for prefix, seen in _EAGER_MODULES.items() if name.startswith(prefix)), None)
            if seen is not None and module is not None:
                _found[1].append((vars(module), seen))
    return _found[1]


# What Python's bool has of int's and a SymBool lacks: each is Python's bool's, by a
# branch on the value (one read from data is traced as taken and checked at each call).
_BOOL_AS_INT = (
    *("__float__", "__index__", "__neg__", "__pos__", "__abs__", "__invert__", "__round__", "__trunc__"),
    *("__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__divmod__"),
    *("__pow__", "__rpow__", "__lshift__", "__rshift__", "__sub__", "__rsub__", "__radd__"),
    *("__lt__", "__le__", "__gt__", "__ge__", "__xor__", "__rxor__"),
)


def _bool_equal(original):
    """A SymBool ``==`` a number (``(x == y).all().item() == 1``, ``1 in flags``): Python's
    bool equals 1 or 0, where sympy's never equals a number (False, with no check)."""

    def __eq__(value, other):
        if type(other) in (int, float, bool, torch.SymInt, torch.SymFloat):
            return int(bool(value)) == other  # (a branch on the value: traced as taken, checked at each call)
        return original(value, other)

    return __eq__


def _as_int(name: str):
    def method(value, *args):
        return getattr(bool(value), name)(*args)  # (Python's bool's own: ``b ^ True`` is a bool)

    return method


@contextlib.contextmanager
def compiling():
    """Inside, ``torch.compiler.is_compiling()`` is True, and numbers read from tensor data
    are unhashable.

    - Libraries skip, while dtcompile traces, the eager-only paths they skip under
      torch.compile (Hugging Face's check for packed sequences reads tensor data into a
      Python branch). torch keeps the answer in a module flag, which torch.compile sets the
      same way; there is no public setter.
    - DTensor caches sharding strategies by hashing an op's arguments, and skips the cache
      when hashing raises TypeError (a SymInt's does). A SymFloat or SymBool hashes its
      value instead: for one read from data (``t * x.max().item()``) that is a guard on
      data, which fails. Raising TypeError for those takes DTensor's uncached path."""
    import torch.compiler
    import torch.distributed.nn.functional  # noqa: F401

    _CALLERS_MODES[0] = torch._C._is_torch_function_mode_enabled()  # (before tracing enters its own)
    saved = torch.compiler._is_compiling_flag
    hashes = {cls: cls.__hash__ for cls in (torch.SymFloat, torch.SymBool)}
    torch.compiler._is_compiling_flag = True
    eager = []
    for namespace, seen in _eager_namespaces():
        if namespace.get("torch") is torch:
            namespace["torch"] = seen
            eager.append(namespace)
    answers = [(vars(sys.modules[m]), dict(a)) for m, a in _EAGER_ANSWERS.items() if sys.modules.get(m) is not None]
    for namespace, replaced in answers:
        for name, answer in replaced.items():
            replaced[name], namespace[name] = namespace.get(name), answer
    for cls, original in hashes.items():
        cls.__hash__ = _hash_unless_from_data(original)
    equal = vars(torch.SymBool)["__eq__"]
    torch.SymBool.__eq__ = _bool_equal(equal)
    own = {name: vars(torch.SymBool).get(name) for name in _BOOL_AS_INT}
    for name in _BOOL_AS_INT:  # (``float(b)``, ``-b``, ``b / 2`` of a Python bool: as of 1 or 0)
        if own[name] is None:
            setattr(torch.SymBool, name, _as_int(name))
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = saved
        for namespace in eager:
            namespace["torch"] = torch
        for namespace, replaced in answers:
            namespace.update(replaced)
        for cls, original in hashes.items():
            cls.__hash__ = original
        torch.SymBool.__eq__ = equal
        for name, method in own.items():
            if method is None:
                delattr(torch.SymBool, name)
