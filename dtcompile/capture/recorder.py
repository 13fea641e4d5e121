"""Recording a call below DTensor.

Two modes are active while a call is traced:

* :class:`OpRecorder`, a TorchDispatchMode, sees every aten op. An op with a DTensor
  argument is left to DTensor (``NotImplemented``): its local ops come back here with
  TensorProxy arguments and are recorded, as are ops with no tensor argument
  (``zeros``). The output metadata comes from running the op on FakeTensors.
* :class:`CallAnnotator` (``annotator.py``), a TorchFunctionMode, sees each torch-level
  call the user's code makes (``F.linear``, ``Tensor.view``) and notes it, with the
  placements of its DTensor inputs and outputs, on the symbols recorded while it ran.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext, free_unbacked_symbols
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..core import (
    BoundSymbol,
    FromData,
    InputPath,
    NoProvenance,
    NumberProxy,
    TensorProxy,
    TracingError,
    aten_symbol,
)
from ..core.op_classes import valued_while_traced
from ..core.printing import NamedConstant, Unprintable, python_literal
from ..core.symbol import backward_note, leaves, map_leaves
from ..core.symbolic import LARGEST_SYMBOLIC_SIZE, is_symbolic, symbolic_expr
from ..core.torch_internals import fake_mode_active, make_dtensor, set_data_value
from .c10d import is_c10d_op, record_c10d
from .data_branches import size_values_now, value_now
from .deferred_checks import DeferredChecks
from .dtensor_modes import DTensorModes
from .fake_calls import DataReads, fake_errors_unlogged, refuse_metadata_changes
from .grad_checks import grad_state
from .input_fakes import InputFakes
from .kernel_autograd import refuse_without_autograd
from .placements import same_spec
from .restrided import restrided_in_call
from .torch_settings import kernel_settings, kernel_settings_changed, kernel_settings_differ

_DATA_DEPENDENT_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_LIFT_FRESH_COPY = torch.ops.aten.lift_fresh_copy.default


class Recording:
    """The state of one trace being recorded: its symbols, names and captured constants."""

    def __init__(self, fake_mode: FakeTensorMode, static_dims: frozenset = frozenset()):
        self.fake_mode, self.static_dims = fake_mode, static_dims  # ((input path, dim)s whose sizes stay)
        self.fakes = InputFakes(fake_mode)  # the fake of each real tensor entering the trace
        self.data_reads = DataReads()  # fakes torch holds a number read from their data on
        self.default_dtype, self.kernel_settings = torch.get_default_dtype(), kernel_settings()  # (every op's)
        self.bound_symbols: list[BoundSymbol] = []
        self.captured: list[torch.Tensor] = []  # real tensors the program closes over
        self.captured_proxies: list[TensorProxy] = []
        self._captured_index: dict[int, TensorProxy] = {}
        self._next_name, self._prefix = 0, "t"
        self._given: list[str] = []  # the names new_name gave, in order
        self.used_names: set[str] = set()
        self.dtensor_calls = 0  # how many torch-level calls with DTensor arguments run now (CallAnnotator)
        self.c10d_calls = 0  # c10d collectives the user's code called (``dist.all_reduce``)
        self.tensor_hooks = 0  # hooks the user's code registered on traced tensors (they run in the backward)
        self.valued: list[TensorProxy] = []  # proxies whose trace-time value is known
        self.read_by: dict[object, str] = {}  # symbol of a number read from data -> the call that read it
        self.real_of: dict[str, torch.Tensor] = {}  # input label -> the call's real tensor (while tracing)
        self.dtensor_of: dict[str, DTensor] = {}  # a DTensor input's local label -> the call's DTensor
        self.input_proxies: list[TensorProxy] = []
        self.cones: dict[int, list[int]] = {}  # index of a read computed now -> indices of its cone
        self.size_reads: dict = {}  # a size read from data valued now (size_values_now) -> (index, output, dim)
        self.deferred_checks = DeferredChecks()  # which op deferred each check on data to run time
        self.input_sizes: dict = {}  # a symbol of an input's size -> (the input's proxy, its dim)
        self.values_now: dict = {}  # label -> its real value, computed now (data_branches.real_now)
        self.numbers_now: dict = {}  # symbol of a number read from data -> its value computed when read
        self.sizes_now: dict = {}  # a size read from data met computing them -> its value
        self.constants: dict[str, NamedConstant] = {}  # arguments with no literal, by name
        self.retained: set[str] = set()  # labels of the proxies the traced code called retain_grad() on
        self.grad_reads: list[tuple[torch.Tensor, object]] = []  # (a closed-over tensor, its .grad when read)
        self.users_backward: list = []  # symbols the user's code recorded in a backward (a hook, a Function's)
        self.users_backward_ran = False  # the user's code called torch in a backward
        self.works: list = []  # the Works recorded collectives returned, alive while tracing (c10d.py)
        self.current_call: str | None = None  # the torch-level call of the user's code running now
        self.call_start: int | None = None  # the index of its first symbol
        self.snapshot = None  # a DataSnapshot of the user's data the traced code must not change
        self.captured_held: list[torch.Tensor] = []  # what the program holds of each: the tensor, or its DTensor
        self.captured_flags: list[tuple[torch.Tensor, str, tuple]] = []  # (a closed-over tensor, where, grad_state)
        self.captured_dtensors: dict[int, DTensor] = {}  # id of a closed-over DTensor -> its traced stand-in
        self.dtensor_modes = DTensorModes()  # entered inside the call (loss_parallel): kept for the backward
        self.call_log = None  # a layer's torch-level calls logged, or checked against a log (``verified.py``)
        self.made_again: set[int] = set()  # ids of tensors made, not dispatched (``tensor_versions``)

    @contextlib.contextmanager
    def names_apart(self, prefix: str):
        """New names with ``prefix``, from a counter of their own, while recording symbols not in the
        trace (a repeated block's backward, a template): the trace's names are given as if unrecorded."""
        saved = self._next_name, self._prefix
        self._next_name, self._prefix = 0, prefix
        try:
            yield
        finally:
            self._next_name, self._prefix = saved

    def names_given(self) -> tuple[int, int]:
        """Where naming is now, for :meth:`forget_names_since`."""
        return self._next_name, len(self._given)

    def forget_names_since(self, given: tuple[int, int]) -> None:
        """Give again the names given since ``names_given`` (a repeated block's abandoned replay's)."""
        self._next_name = given[0]
        for name in self._given[given[1] :]:
            self.used_names.discard(name)
            self.values_now.pop(name, None)  # a value computed now for a symbol taken out
        del self._given[given[1] :]

    def new_name(self) -> str:
        while True:
            name = f"{self._prefix}{self._next_name}"
            self._next_name += 1
            if name not in self.used_names:
                self.used_names.add(name)
                self._given.append(name)
                return name

    def input_proxy(self, real: torch.Tensor, name: str, provenance: InputPath, dynamic: bool = False) -> TensorProxy:
        proxy = self._input_proxy(real, name, provenance, dynamic)
        self.input_proxies.append(proxy)  # (what a tensor made inside may share memory with)
        return proxy

    def _input_proxy(self, real: torch.Tensor, name: str, provenance: InputPath, dynamic: bool) -> TensorProxy:
        """A proxy for a real tensor entering the trace; with ``dynamic`` its sizes are symbols of the
        fake mode's ShapeEnv (but 0s and 1s, and ``static_dims``), at most ``LARGEST_SYMBOLIC_SIZE``
        (the prologue checks it: ``x[:, 3]``'s full slice of a sharded dim is one). Duck sizing:
        equal sizes share one symbol (torch.compile's default): a program may assume them equal."""
        self.used_names.add(name)
        self.real_of[name] = real
        if dynamic and self.fake_mode.shape_env is not None:
            static = {d for p, d in self.static_dims if p == str(provenance)} | {
                d for d, n in enumerate(real.shape) if n > LARGEST_SYMBOLIC_SIZE
            }
            sizes = [DimDynamic.STATIC if d in static else DimDynamic.DUCK for d in range(real.dim())]
            fake = self.fakes.symbolic(real, StatelessSymbolicContext(dynamic_sizes=sizes))
            if not isinstance(fake, torch.Tensor):  # (one like an earlier tensor: that one's symbols, made later)
                return TensorProxy.deferred(fake.like, fake, name, provenance, real.requires_grad)
            proxy = TensorProxy(fake, name, provenance, requires_grad=real.requires_grad)
            for dim, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    self.input_sizes.setdefault(size.node.expr, (proxy, dim))
                    self.fake_mode.shape_env.constrain_symbol_range(size.node.expr, 2, LARGEST_SYMBOLIC_SIZE)
            return proxy
        else:
            make_fake = self.fakes.deferred(real)
            if make_fake is not None:
                return TensorProxy.deferred(real, make_fake, name, provenance)
            # Static explicitly: a fake mode with a ShapeEnv would otherwise give every
            # tensor it converts symbolic sizes (a module's parameters, captured tensors).
            fake = self.fakes.static(real)
        return TensorProxy(fake, name, provenance, requires_grad=real.requires_grad)

    def capture(self, real: torch.Tensor) -> TensorProxy:
        """The proxy of a real tensor the program uses without receiving it in the call.
        The program reads it at every call (in-place changes to it are seen); while tracing,
        its value is known, so that code reading values computed from it works."""
        proxy = self._captured_index.get(id(real))
        if proxy is None:
            index = len(self.captured)
            name = f"captured{index}"
            proxy = self.input_proxy(real, name, InputPath("captured").index(index))
            proxy.value = real
            self.valued.append(proxy)
            proxy.value_is_state = True  # (a tensor the code closes over: a global refilled between calls)
            self.captured.append(real)
            self.captured_held.append(real)
            self.captured_proxies.append(proxy)
            self.captured_flags.append((real, _closed_over(real), grad_state(real)))
            self._captured_index[id(real)] = proxy
        return proxy

    def trace_time_value(self, func, args: tuple, kwargs: dict, proxies: list[TensorProxy]):
        """The op's real result when every proxy among its arguments has a known value, so
        that code reading values made from constants and captured tensors works while
        tracing (DTensor's ``arange(n)...tolist()`` index arithmetic in ``redistribute``);
        else None. The op stays in the program either way. In-place ops get no value (run
        at trace time, one would change a captured tensor once more than eager does), nor
        do those ``valued_while_traced`` names (random ops, collectives)."""
        if func._schema.is_mutable:
            # It may change a valued tensor, or a view of one: those values are stale now.
            for proxy in self.valued:
                proxy.value = None
            self.valued.clear()
            return None
        if not valued_while_traced(func):
            return None
        symbolic = any(is_symbolic(x) for x in leaves((args, kwargs)))
        if symbolic or any(p.value is None for p in proxies):
            return None
        to_value = lambda x: x.value if isinstance(x, (NamedConstant, TensorProxy)) else x  # noqa: E731
        return func(*tree_map(to_value, args), **tree_map(to_value, kwargs))

    def capture_dtensor(self, real: DTensor) -> DTensor:
        """What the traced code uses for a DTensor it closes over (a parameter of a model
        called inside a loss function): a DTensor around the captured proxy of its local
        tensor, with its spec, so that its ops are recorded and run at every call, and
        gradients flow to it when it requires grad."""
        traced = self.captured_dtensors.get(id(real))
        if traced is None:
            proxy = self.capture(real._local_tensor)
            self.captured_held[next(i for i, p in enumerate(self.captured_proxies) if p is proxy)] = real
            traced = make_dtensor(proxy, real._spec, requires_grad=real.requires_grad)
            self.captured_flags.append((traced, _closed_over(real), grad_state(traced)))  # what the code uses
            self.captured_dtensors[id(real)] = traced
        return traced

    def respecced(self) -> str | None:
        """What names a closed-over DTensor whose spec the traced code changed in place; None."""
        for held in self.captured_held:
            if isinstance(held, DTensor) and not same_spec(self.captured_dtensors[id(held)]._spec, held._spec):
                return _closed_over(held)
        return None

    def closed_over_differentiable(self) -> list[tuple[TensorProxy, torch.Tensor]]:
        """``(proxy, what the trace differentiates)`` for each captured tensor or DTensor
        that requires grad (a closed-over parameter): gradients flow to it as to an input."""
        found = []
        for held, proxy in zip(self.captured_held, self.captured_proxies):
            if held.requires_grad:
                # A DTensor's stand-in; a plain tensor, or its proxy where it is no leaf (``closed_over.needs_stand_in``)
                traced = held if held.grad_fn is None else proxy
                found.append((proxy, self.captured_dtensors[id(held)] if isinstance(held, DTensor) else traced))
        return found

    def _captured_tensor(self, x):
        """A real tensor's proxy (see :meth:`capture`); anything else as it is."""
        if isinstance(x, torch.Tensor) and not isinstance(x, TensorProxy):
            return self.capture(x)
        return x

    def _captured(self, x):
        """An argument as the trace holds it: a proxy for a real tensor, a named constant
        for an object with no literal."""
        if isinstance(x, torch.Tensor):
            return self._captured_tensor(x)
        try:
            python_literal(x)
        except Unprintable:
            constant = next((c for c in self.constants.values() if c.value is x), None)
            if constant is None:
                constant = NamedConstant(f"const{len(self.constants)}", x)
                self.constants[constant.label] = constant
            return constant
        return x

    def forget_values(self) -> None:
        """Drop the trace-time values once tracing is over: they are not part of the program."""
        for proxy in self.valued:
            proxy.value = None
        self.valued.clear()
        self.real_of.clear()
        self.dtensor_of.clear()
        self.values_now.clear()

    def record(self, func, args: tuple, kwargs: dict):
        flat = leaves((args, kwargs))
        if self.dtensor_calls and not any(isinstance(x, TensorProxy) for x in flat) and not _sized_by_symbols(flat):
            # DTensor's own bookkeeping while it handles an op: factory ops and arithmetic
            # on its own tensors (meta tensors for its sharding propagation, index
            # arithmetic it reads back: ``arange(n).tolist()`` of a _StridedShard). It needs
            # real values; where the program uses one, it is captured. (The user's code runs
            # outside DTensor's handling: its ops on closed-over tensors are recorded.) One
            # sized by a symbolic size, but for its meta tensors, is recorded: run, it fixed the
            # size (``loss_parallel``'s backward's ``arange(n)``: a compile per length).
            return func(*args, **kwargs)
        if is_c10d_op(func):  # ``dist.all_reduce(y)`` in the user's code
            self.c10d_calls += 1
            return record_c10d(self, func, *tree_map(self._captured_tensor, (args, kwargs)))
        if torch.get_default_dtype() is not self.default_dtype:
            raise TracingError(
                f"dtcompile.jit: {self.current_call or func} ran under the default dtype {torch.get_default_dtype()}, "
                f"set by the traced code (the call began under {self.default_dtype}); factory ops and arithmetic "
                "with Python floats follow it, and the compiled program runs every op under the call's own. Pass "
                "dtype= explicitly, or set the default dtype before the call"
            )
        if kernel_settings_differ(func, self.kernel_settings):
            raise kernel_settings_changed(self.current_call or func, self.kernel_settings)
        if func is _LIFT_FRESH:
            # ``torch.tensor([1., 2.])``: a new tensor at each eager call. The program holds the
            # value as a constant, so it lifts a copy: an in-place change (by the program or by
            # the caller, of a returned one) must not reach the next call.
            func = _LIFT_FRESH_COPY
        args, kwargs = map_leaves(self._captured, (args, kwargs))
        if func is _LIFT_FRESH_COPY:
            args[0].value_is_state = False  # (the literal's values are the code's)
        proxies = [x for x in leaves((args, kwargs)) if isinstance(x, TensorProxy)]
        value = self.trace_time_value(func, args, kwargs, proxies)
        if (restrided := restrided_in_call(self, func, args, kwargs)) is not None:
            return restrided  # (``x.unsqueeze_(0)`` of an ``x`` that torch's code made inside the call)
        from_state = any(p.value_is_state for p in proxies)
        if value is not None and not any(isinstance(v, torch.Tensor) for v in tree_flatten(value)[0]):
            if not from_state:
                return value  # ``.item()``, ``equal`` of values made from constants: known now
            value = None  # of a closed-over tensor's: read at each call, as an argument's
        if func in _DATA_DEPENDENT_OPS:
            return self._read_number(func, args, kwargs)

        def to_fake(x):
            if isinstance(x, NamedConstant):
                return x.value
            return x.fake if isinstance(x, TensorProxy) else x

        fake_args, fake_kwargs = map_leaves(to_fake, (args, kwargs))
        fake_out = self.deferred_checks.run(self, func, fake_args, fake_kwargs)  # (with run_on_fakes)
        self.data_reads.after(func, fake_args, fake_kwargs, unbacked := bool(free_unbacked_symbols(fake_out)))
        refuse_metadata_changes(func, proxies, self.current_call)
        made_by = NoProvenance(str(func))

        def to_output_proxy(x):
            if isinstance(x, torch.Tensor):
                return TensorProxy(x, self.new_name(), made_by, requires_grad=x.requires_grad)
            return x

        output = map_leaves(to_output_proxy, fake_out)
        if value is not None:
            for proxy, real in zip(tree_flatten(output)[0], tree_flatten(value)[0]):
                if isinstance(proxy, TensorProxy):
                    proxy.value = real
                    self.valued.append(proxy)
                    proxy.value_is_state = from_state
        note = backward_note()  # None in the forward: the CallAnnotator notes those
        self.bound_symbols.append(BoundSymbol(aten_symbol(func), tuple(args), dict(kwargs), output, note, op=func))
        if unbacked:
            size_values_now(self, len(self.bound_symbols) - 1)
        return output

    def _read_number(self, func, args: tuple, kwargs: dict):
        """``.item()`` of a tensor whose value is not known while tracing: a number of the
        trace with no trace-time value (an unbacked symbol of the ShapeEnv), read by the
        program at each call. The traced code goes on with the symbol; sizes that follow
        from it are symbolic in it. A bool is Python's, as eager's (``flag is True``): a
        question on its value, checked at run time."""
        (source,) = args
        with self.fake_mode, fake_errors_unlogged():
            symbol = func(source.fake, **kwargs)
        self.data_reads.after(func, (source.fake,), kwargs, True)
        number = NumberProxy(self.new_name(), symbolic_expr(symbol), None, FromData(str(func)))
        self.read_by[number.expr] = self.current_call or str(func)
        unbacked = free_unbacked_symbols(symbol)
        computed = value_now(self, source, unbacked)  # its value now, to branch on (``data_branches.py``)
        if computed is not None and len(unbacked) == 1:
            value, cone = computed
            value = int(value) if isinstance(value, bool) else value  # a SymBool is Eq(u, 1)
            set_data_value(self.fake_mode.shape_env, unbacked.pop(), value)
            self.cones[len(self.bound_symbols)] = cone
        note = backward_note()
        self.bound_symbols.append(BoundSymbol(aten_symbol(func), tuple(args), dict(kwargs), number, note, op=func))
        return bool(symbol) if isinstance(symbol, torch.SymBool) and computed is not None else symbol


def _closed_over(real: torch.Tensor) -> str:
    return f"a {type(real).__name__} of shape {tuple(real.shape)} it closes over (a global or a closure's)"


class OpRecorder(TorchDispatchMode):
    """Records the local ops below DTensor (see the module docstring)."""

    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if fake_mode_active() or _meta_only((args, kwargs)):
            return func(*args, **kwargs)  # DTensor's sharding propagation (its fake mode, or meta tensors)
        if any(issubclass(t, DTensor) for t in types):
            if func.namespace == "c10d":  # ``dist.all_reduce(dtensor)``: DTensor's error, as eager's
                raise NotImplementedError(f"Operator {func} does not have a sharding strategy registered.")
            return NotImplemented
        result = self.recording.record(func, args, kwargs)
        refuse_without_autograd(func, args, kwargs, result)  # (an op of the user's library)
        return result


def _meta_only(arguments) -> bool:
    tensors = [x for x in leaves(arguments) if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "meta" and not isinstance(t, TensorProxy) for t in tensors)


def _sized_by_symbols(flat: list) -> bool:
    """Whether an op's arguments hold a symbolic size and no meta device (DTensor's own
    sharding propagation makes meta tensors of symbolic sizes, which it keeps)."""
    return any(map(is_symbolic, flat)) and not any(str(x) == "meta" for x in flat if isinstance(x, (torch.device, str)))
