"""Proxies: the values of a trace, each named by its ``label``.

A TensorProxy is the stand-in for a local tensor while a call is traced: a
``torch.Tensor`` wrapper subclass, so DTensor can hold it as its ``_local_tensor`` and run
its own dispatch on it. It carries a FakeTensor (the meta: shape, strides, dtype, device
exactly as eager produces them), a name in the trace and its provenance. It never holds
data; its ops are recorded by the active recorder.

A NumberProxy is a Python number the program computes (a size under symbolic values); a
FutureProxy an opaque run-time object the program waits on (a started collective's
work handle).
"""

from __future__ import annotations

import sys

import sympy
import torch

from .code_origin import library_code, standard_library
from .errors import TracingError, data_dependent_error
from .provenance import InputPath, Provenance
from .symbolic import known_equal
from .torch_internals import storage_id

DTYPE_ABBREVIATIONS = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def contiguous_strides(shape) -> tuple:
    """The row-major strides of ``shape`` (ints, or SymInts under symbolic values), as torch
    lays them out: a size 0 steps as a size 1 (``torch.empty(2, 0, 3)``: ``(3, 3, 1)``)."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step = step if type(size) is int and size == 0 else step * size
    return tuple(reversed(strides))


def is_contiguous_stride(shape, stride) -> bool:
    """True when ``stride`` is the row-major stride of ``shape`` (size-1 dims ignored),
    for every value of symbolic sizes (asked without recording a guard)."""
    expected = 1
    for size, st in zip(reversed(tuple(shape)), reversed(tuple(stride))):
        if not known_equal(size, 1) and not known_equal(st, expected):
            return False
        expected = expected * size
    return True


# What a proxy holds in its ``__dict__`` (a user's attributes on a traced tensor are the rest).
PROXY_ATTRIBUTES = frozenset({"_fake", "_make_fake", "label", "provenance", "value"})


class TensorProxy(torch.Tensor):
    """A named, metadata-only tensor whose operations become bound symbols of a trace."""

    label: str
    provenance: Provenance
    value: torch.Tensor | None  # the real value at trace time, for values made from constants only
    # whether that value is one of a tensor the code closes over (or made from one): it may
    # change between calls, so code reading it as a number reads it at each call
    value_is_state: bool = False

    # Torch functions reach the dispatcher untouched; recording happens at dispatch.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, fake: torch.Tensor, name: str, provenance: Provenance, requires_grad: bool = False):
        proxy = _wrapping(cls, fake, requires_grad)
        # The conjugate and negative bits are metadata like strides: ops dispatch on them.
        if fake.is_conj():
            torch._C._set_conj(proxy, True)
        if fake.is_neg():
            torch._C._set_neg(proxy, True)
        proxy._fake, proxy._make_fake = fake, None
        proxy.label = name
        proxy.provenance = provenance
        proxy.value = None
        return proxy

    @classmethod
    def deferred(
        cls,
        like: torch.Tensor,
        make_fake,
        name: str,
        provenance: Provenance,
        requires_grad: bool | None = None,
    ) -> TensorProxy:
        """A proxy with the metadata of ``like`` (a plain tensor: no conjugate or negative
        bit), whose fake ``make_fake()`` makes when first asked for: a tensor with memory
        of its own, which no other tensor of the trace views until the fake is made. Most
        of a deep model's parameters only pass through to a block's call, and never need
        one; nor do most fresh outputs of a call recorded again (``capture/replay.py``)."""
        requires_grad = like.requires_grad if requires_grad is None else requires_grad
        proxy = _wrapping(cls, like, requires_grad)
        proxy._fake, proxy._make_fake = None, make_fake
        proxy.label = name
        proxy.provenance = provenance
        proxy.value = None
        return proxy

    @property
    def memory(self) -> object:
        """Which memory its data lives in, equal for tensors sharing it (the fake is not
        made for this): its fake's storage, or, while its fake is deferred, memory of its
        own. Compare keys taken together: one taken before a deferred fake is made differs
        from one taken after."""
        return ("own", id(self)) if self._fake is None else storage_id(self._fake)

    @property
    def meta(self) -> torch.Tensor:
        """What to read the metadata from without making a deferred fake: the fake, or the
        proxy itself, made with the metadata the fake will have."""
        return self if self._fake is None else self._fake

    @property
    def fake(self) -> torch.Tensor:
        fake = self._fake
        if fake is None:
            with torch._C.DisableTorchFunction():
                inference = self.is_inference()
            with torch.inference_mode(inference):  # (as the proxy was made, not as the first read is)
                fake, self._make_fake = self._make_fake(), None
            self._fake = fake
        return fake

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # The recorder (a dispatch mode) sees every op first while tracing, and leaves ops
        # with a DTensor argument to DTensor. The dispatcher then tries each subclass in
        # argument order, so a proxy passed beside a DTensor (``proxy * dtensor``) gets here
        # before DTensor does: defer to the other subclass, as the recorder did.
        if any(not issubclass(t, TensorProxy) for t in types):
            return NotImplemented
        # Otherwise reaching here means a proxy escaped its trace, or (while a call is traced)
        # code dispatched past the recording modes: a tensor of another class made around one.
        names = [a.label for a in args if isinstance(a, TensorProxy)]
        if TextRefusals.active:
            raise TracingError(
                f"dtcompile.jit: the traced code made a tensor of another class around a traced one ({func}: "
                "Tensor.as_subclass, torch.Tensor._make_subclass), which dispatches past dtcompile's recording. "
                "Make it outside the call, or use x.view_as(x)"
            )
        raise RuntimeError(
            f"dtcompile: {func} was called on proxy {', '.join(names)} outside of tracing; "
            "proxies only exist while a call is being traced"
        )

    def tolist(self):
        """The value as (nested) lists: known now for a proxy made from constants only (the
        recorder knows its value while tracing; DTensor's own index arithmetic reads such
        values), else numbers the program reads at run time (:func:`read_elements`)."""
        if self.value is None or self.value_is_state:
            return read_elements(self)
        return self.value.tolist()

    def wait(self) -> TensorProxy:
        """``AsyncCollectiveTensor.wait()``: functional collectives hand back a waited
        tensor while a compiler traces (as under torch.compile), so waiting again is the
        identity."""
        return self

    def type_string(self, memo: dict | None = None) -> str:
        """``f32[4, 16]``, with the strides added when they are not row-major. ``memo``:
        the strings already made by one printing of a trace, by metadata (the deep layers'
        tensors repeat the first's, and asking whether symbolic strides are row-major costs
        a few sympy operations)."""
        if memo is None:
            return self._type_string()
        key = (self.dtype, *map(_expression, self.shape), None, *map(_expression, self.stride()))
        key += (self.is_conj(), self.is_neg())
        text = memo.get(key)
        if text is None:
            text = memo[key] = self._type_string()
        return text

    def _type_string(self) -> str:
        dtype = DTYPE_ABBREVIATIONS.get(self.dtype, str(self.dtype).removeprefix("torch."))
        text = f"{dtype}[{', '.join(str(s) for s in self.shape)}]"
        if not is_contiguous_stride(self.shape, self.stride()):
            text += f" stride=({', '.join(str(s) for s in self.stride())})"
        return text + " conj" * self.is_conj() + " neg" * self.is_neg()

    def __reduce_ex__(self, protocol):
        # (``torch.save``, ``pickle``) a proxy has no data; the tensor's leaves torch
        raise TracingError(
            "dtcompile.jit: a traced tensor is pickled (torch.save, pickle): the data leaves torch, which a "
            "compiled program cannot record. Save it outside the call"
        )

    def __deepcopy__(self, memo):
        raise TracingError(
            "dtcompile.jit: copy.deepcopy of a traced tensor: the copy is not recorded. Use x.clone() (with "
            ".detach() for a tensor of its own) inside the call"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        if _refuse_user_text(self):
            return self._refused_text()
        return f"TensorProxy({self.label}: {self.type_string()}, {self.provenance})"

    def __format__(self, spec: str) -> str:
        if _refuse_user_text(self):  # (``f"{x:.2f}"`` too: refused, not a TypeError)
            return self._refused_text()
        return object.__format__(self, spec)

    def _refused_text(self) -> str:
        """The text the user's code gets until the refusal is raised (it goes on: its own
        error, formatting the tensor, is raised as eager's)."""
        return f"<a traced tensor of shape {tuple(self.shape)}: dtcompile refuses its text>"


class TextRefusals:
    """Whether a call is traced (``active``, counted by the tracer: the torch function
    modes are off inside a mode's handler, so they cannot tell). A refusal the user's
    code swallows (``logging`` reports an error in a handler and goes on) is raised after
    the traced code, as every ``TracingError`` is."""

    active = 0


# The code of dtcompile's own frames between a dispatch mode and torch (the annotator's
# dispatch, a layer's call log: ``capture/verified.py``): they ask for no text.
PASSING_FRAMES: set = set()


def _refuse_user_text(proxy: TensorProxy) -> bool:
    """The user's code turning a traced tensor into text while tracing (``print(x)``,
    ``f"{x.sum():.2f}"``, a DTensor's repr, a log line): eager's text shows the data,
    which a trace does not have, and a compiled call would not print. Who asks is the
    first frame past torch's, the standard library's (``logging``) and the dispatch
    modes'; dtcompile's own code and other libraries' (a log line of transformers) get the
    proxy's description."""
    if not TextRefusals.active:
        return False  # not while tracing: a trace's proxy, inspected
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        passing = module.partition(".")[0] == "torch" or standard_library(module) or frame.f_code in PASSING_FRAMES
        if not passing and frame.f_code.co_name not in ("__torch_function__", "__torch_dispatch__"):
            break
        frame = frame.f_back
    if frame is not None and not library_code(module, frame.f_code.co_filename):
        # Made, not raised: it is raised once the traced code is done (``TracingError.made``),
        # so code that formats a tensor into the error it is about to raise (a library's
        # check, the user's ``raise ValueError(f"bad {x}")``) raises its own, as eager does.
        what = proxy.provenance if isinstance(proxy.provenance, InputPath) else "a tensor"
        TracingError(
            f"dtcompile.jit: the traced code turns {what} into text (print, str, repr, format, logging): its "
            "data is not known while tracing, and a compiled call would not do it at each call. Print outside "
            "the call"
        )
        return True
    return False


def _expression(size):
    """A size as a key: an int, or a SymInt's expression (equal expressions print alike)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _wrapping(cls, like: torch.Tensor, requires_grad: bool) -> TensorProxy:
    # A proxy holds no data, so the size of its storage is given, not computed: with
    # symbolic sizes, computing it is a dozen sympy operations (most of a proxy's cost).
    # Under inference mode, one like a normal tensor (a view of one) is made normal, as
    # eager's is: autograd then gives a view its base's version counter. Outside it, one
    # like an inference tensor (a view of one) is one: autograd refuses to save it.
    if torch.is_inference_mode_enabled() is not like.is_inference():
        with torch.inference_mode(like.is_inference()):
            return _wrapping(cls, like, requires_grad)
    return torch.Tensor._make_wrapper_subclass(
        cls,
        like.shape,
        strides=like.stride(),
        storage_offset=like.storage_offset(),
        dtype=like.dtype,
        device=like.device,
        layout=like.layout,
        requires_grad=requires_grad,
        storage_size=like.untyped_storage().nbytes(),
    )


def read_elements(tensor: torch.Tensor):
    """``tensor.tolist()`` while tracing: each element read with ``.item()``, a number of
    the trace (read at run time, unless its value is known now). The sizes iterated over
    are guarded constants."""
    if tensor.dim() == 0:
        return tensor.item()
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        length = int(tensor.shape[0])
    except GuardOnDataDependentSymNode as error:
        raise data_dependent_error(
            "Tensor.tolist",
            f"a list of {tensor.shape[0]} items, a length read from tensor data that tracing cannot compute: one "
            "a collective computes, say",
        ) from error
    return [read_elements(tensor[i]) for i in range(length)]


class NumberProxy:
    """A Python number the program computes at run time: a size under symbolic values.

    ``expr`` is its symbolic value (a sympy expression over the trace's size symbols,
    such as ``s49`` or ``2*s26*s49``); ``hint`` its value in the call that was traced.
    """

    __slots__ = ("label", "expr", "hint", "provenance")

    def __init__(self, label: str, expr, hint, provenance: Provenance):
        self.label = label
        self.expr = expr
        self.hint = hint
        self.provenance = provenance

    def type_string(self) -> str:
        boolean = isinstance(self.expr, (sympy.logic.boolalg.BooleanFunction, sympy.core.relational.Relational))
        kind = "bool" if boolean else "int" if self.expr.is_integer else "float"
        return f"{kind} {self.expr}"

    def __repr__(self) -> str:
        return f"NumberProxy({self.label} = {self.expr}, {self.provenance})"


class FutureProxy:
    """An opaque run-time object the program makes and later waits on: the work handle of
    a collective started by the collectives executor (a ``torch.distributed.Work``). It has
    no tensor metadata; the symbol that waits on it reads it, so ``verify`` sees that the
    wait comes after the start."""

    __slots__ = ("label", "provenance")

    def __init__(self, label: str, provenance: Provenance):
        self.label = label
        self.provenance = provenance

    def type_string(self) -> str:
        return "future"

    def __repr__(self) -> str:
        return f"FutureProxy({self.label}, {self.provenance})"


PROXY_TYPES = (TensorProxy, NumberProxy, FutureProxy)


def is_proxy(value: object) -> bool:
    """A value the trace computes (a tensor, a number or a future), named by its ``label``."""
    return isinstance(value, PROXY_TYPES)
