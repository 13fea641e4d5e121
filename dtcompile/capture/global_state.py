"""The torch state a call is traced under besides its inputs (:class:`GlobalState`, which
the prologue guards), and what the traced code changed of it and did not restore: a
compiled program runs the Python code once, while tracing, so it would not change that
state at each call."""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from dataclasses import dataclass

import torch

from ..core import TracingError
from ..core.code_origin import dtcompile_code, library_code
from ..core.torch_internals import (
    dispatch_modes,
    dispatch_modes_off,
    dtensor_implicit_replication,
    dtensor_op_handlers,
    function_mode_count,
    function_modes,
    saved_tensors_hooks,
)
from .around_ops import function_mode_states
from .torch_settings import (
    autocast_cache_seen,
    outer_autocast_cache,
    put_settings_back,
    set_autocast_cache_seen,
    torch_settings,
)
from .upsampling import native_upsampling


@dataclass(frozen=True)
class GlobalState:
    """What the program was traced under besides its inputs and the Python values it reads,
    as it was when tracing began; the prologue guards it. What a factory function
    (``torch.zeros(3)``, ``torch.arange(4) / 3``) takes when the code names no dtype or
    device: the default dtype, the torch function modes active (a default device is one)
    and the default device. What DTensor's dispatch reads besides its arguments: whether
    plain tensors count as replicated (``implicit_replication()``), and the handlers that
    replace ops (``loss_parallel()`` adds some). torch's settings code may read."""

    dtype: torch.dtype
    function_modes: int
    device: torch.device
    implicit_replication: bool
    op_handlers: dict  # the handlers table itself
    op_handler_items: list  # its items then
    settings: tuple  # torch's settings code may read and branch on (:func:`torch_settings`)
    saved_hooks: tuple | None  # the saved_tensors_hooks active (pack, unpack): the program holds what they do
    inference_mode: bool  # (code may branch on ``torch.is_inference_mode_enabled()``)
    function_mode_states: list  # each function mode's class and attributes (:func:`function_mode_states`)

    @classmethod
    def now(cls) -> GlobalState:
        handlers = dtensor_op_handlers()
        return cls(
            torch.get_default_dtype(),
            function_mode_count(),
            torch.get_default_device(),
            dtensor_implicit_replication(),
            handlers,
            list(handlers.items()),
            torch_settings(),
            saved_tensors_hooks(),
            torch.is_inference_mode_enabled(),
            function_mode_states(),
        )


def dispatch_state() -> tuple:
    """What decides how an op runs besides its arguments, which a forward could change between
    its layers (compared where a block is replayed and at each call of a checked layer): grad
    and inference mode, autocast, the default dtype, torch function and dispatch modes, DTensor's
    implicit replication and op handlers (``loss_parallel()`` changes its table in place), the
    saved tensors hooks, torch's settings."""
    handlers = dtensor_op_handlers()
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_default_dtype(),
        *function_modes(),  # by identity (held, so no later mode takes its id): a layer's own mode differs
        None,  # (where the function modes end)
        *dispatch_modes(),
        dtensor_implicit_replication(),
        id(handlers),
        *handlers.items(),  # (a handler replaced for an op it had, too)
        saved_tensors_hooks(),  # what autograd saves for the backward, and gives back
        *torch_settings(),  # (autocast's dtypes, attention backends, deterministic algorithms, matmul precision, ...)
    )


def state_put_back(grad_enabled: bool, state: GlobalState) -> list[str]:
    """The grad mode and default dtype the traced code changed and did not restore, put
    back as the call found them: a compiled program would not change them at each call."""
    changes = []
    if torch.is_grad_enabled() is not grad_enabled:
        changes.append(f"the grad mode (enabled: {grad_enabled} -> {torch.is_grad_enabled()})")
        torch.set_grad_enabled(grad_enabled)
    if torch.get_default_dtype() is not state.dtype:
        changes.append(f"the default dtype ({state.dtype} -> {torch.get_default_dtype()})")
        torch.set_default_dtype(state.dtype)
    if torch_settings() != state.settings:
        changes.append("torch's settings (torch.use_deterministic_algorithms, set_num_threads, a backend's flags...)")
        put_settings_back(state.settings)
    if list(state.op_handlers.items()) != state.op_handler_items:  # (``loss_parallel()`` left by an error)
        changes.append("DTensor's op handlers (loss_parallel())")
        state.op_handlers.clear()
        state.op_handlers.update(state.op_handler_items)
    return changes


def modes_left_changed(state: GlobalState) -> list[str]:
    """The torch function modes and DTensor's implicit replication, if the traced code
    changed them and did not restore them (after tracing's own modes are gone)."""
    changes = []
    if torch.get_default_device() != state.device:
        changes.append(f"the default device ({state.device} -> {torch.get_default_device()})")
    elif function_mode_count() != state.function_modes:
        changes.append("the torch function modes")
    if dtensor_implicit_replication() is not state.implicit_replication:
        changes.append("DTensor's implicit replication")
    return changes


class RandomStates:
    """The random number generators Python code can draw from or seed: Python's
    ``random``, NumPy's global one (if imported) and torch's default CPU generator, as
    they were when tracing began. Code that changes them (draws ``random.random()``,
    calls ``torch.manual_seed(0)``) would do so only while tracing: the number drawn
    would be a constant of the program, the seed set once, not at each call."""

    def __init__(self):
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None
        self.torch = torch.default_generator.get_state()

    def changed(self) -> list[str]:
        """Which the traced code changed, each put back as it was (compared outside the
        tracing modes: nothing here is part of the program)."""
        with torch._C.DisableTorchFunction(), dispatch_modes_off():
            return self._changed()

    def _changed(self) -> list[str]:
        changes = []
        if random.getstate() != self.python:
            changes.append("Python's random module (random.random(), random.seed())")
            random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if self.numpy is not None and numpy is not None:
            now = numpy.random.get_state()
            if now[0] != self.numpy[0] or not (now[1] == self.numpy[1]).all() or now[2:] != self.numpy[2:]:
                changes.append("NumPy's global random generator (np.random)")
                numpy.random.set_state(self.numpy)
        if not torch.equal(torch.default_generator.get_state(), self.torch):
            changes.append("torch's default random generator (torch.manual_seed(), torch.set_rng_state())")
            torch.default_generator.set_state(self.torch)
        return changes


def generators_made(constants: dict, snapshot, reads: list) -> list[str]:
    """The torch generators the program's random ops take (``constants``: the trace's named
    constants) that are neither a default one nor one reached from the call's data before
    it (``snapshot``, ``reads``: a generator held by a module, a global): one made in the
    forward (``torch.Generator()``), which the program would draw from at every call where
    eager makes a new one."""
    known = [torch.default_generator, *(torch.cuda.default_generators if torch.cuda.is_initialized() else ())]
    known += [read.value for read in reads if issubclass(type(read.value), torch.Generator)]
    known += [value for value in snapshot.values() if isinstance(value, torch.Generator)]
    with torch._C.DisableTorchFunction(), dispatch_modes_off():
        return [
            f"a torch.Generator it made ({constant.label}), which each call of eager makes anew"
            for constant in constants.values()
            if isinstance(constant.value, torch.Generator)
            and not any(_same_generator(constant.value, other) for other in known)
        ]


def _same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether two generators are one: the ops' arguments are new Python objects around
    the user's generator, so identity cannot tell; seeding one and reading the other can
    (twice, in case the other was seeded so), then its state is put back."""
    if a is b:
        return True
    if a.device != b.device:
        return False
    state = a.get_state()
    try:
        return all(torch.equal(a.manual_seed(seed).get_state(), b.get_state()) for seed in (0x5EED, 0xD1CE))
    finally:
        a.set_state(state)


@contextlib.contextmanager
def autocast_cache_off():
    """While tracing, autocast does not cache its casts of weights. An entry made then
    (a proxy, keyed by the weight) would outlive the call: the user's next eager call
    in the same autocast region would be given the proxy. The code asking whether it
    caches (``torch.is_autocast_cache_enabled()``) is told what the caller set, and may
    set it (put back after the call, as torch's other settings are)."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    outer_autocast_cache.append(enabled)
    original_get, original_set = torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled
    torch.is_autocast_cache_enabled = autocast_cache_seen
    torch.set_autocast_cache_enabled = set_autocast_cache_seen
    try:
        yield
    finally:
        torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled = original_get, original_set
        torch.set_autocast_cache_enabled(outer_autocast_cache.pop())


@contextlib.contextmanager
def parametrize_cache_off():
    """While tracing, ``torch.nn.utils.parametrize.cached()`` keeps what the call computes
    for the call only (a proxy would outlive it), as eager's call computes each
    parametrization once in a region and reuses it; one the region held before the call
    is not read (a real tensor, it would be baked into the program, read at every call,
    outside the region too): the program computes it again, equal unless the parameter
    changed in place in between. Outside a region it computes each at each use, as eager."""
    from torch.nn.utils import parametrize

    saved = parametrize._cache_enabled, parametrize._cache
    parametrize._cache = {}
    try:
        yield
    finally:
        parametrize._cache_enabled, parametrize._cache = saved


def autocast_devices() -> tuple[str, ...]:
    """The devices autocast is on for now."""
    return tuple(device for device in ("cpu", "cuda") if torch.is_autocast_enabled(device))


@contextlib.contextmanager
def autocast_off(devices: tuple[str, ...] | None = None):
    """Autocast off for ``devices`` (default: those it is on for now; each on), and back
    after (not by ``torch.autocast``: the traced code's regions are told from dtcompile's)."""
    devices = autocast_devices() if devices is None else devices
    for device in devices:
        torch.set_autocast_enabled(device, False)
    try:
        yield
    finally:
        for device in devices:
            torch.set_autocast_enabled(device, True)


@contextlib.contextmanager
def autocast_regions(entered: list):
    """While tracing: the device of each autocast region the code enters with gradients on
    that changes autocast (``with torch.autocast("cpu", enabled=False)`` under the caller's
    autocast; ``torch.amp.custom_fwd``'s), added to ``entered``."""
    autocast, thread = torch.amp.autocast_mode.autocast, threading.get_ident()
    enter = autocast.__enter__

    def noted(self):
        if threading.get_ident() == thread and torch.is_grad_enabled() and _changes_autocast(self):
            entered.append(self.device)
        return enter(self)

    autocast.__enter__ = noted
    try:
        yield
    finally:
        autocast.__enter__ = enter


def _changes_autocast(region) -> bool:
    device, enabled = region.device, getattr(region, "_enabled", True)
    if enabled != torch.is_autocast_enabled(device):
        return True
    return enabled and getattr(region, "fast_dtype", None) != torch.get_autocast_dtype(device)


@contextlib.contextmanager
def torch_caches_off():
    """What tracing changes of torch's state while it runs (each put back after)."""
    with autocast_cache_off(), parametrize_cache_off(), native_upsampling():
        yield


_SEEDING = ("manual_seed", "seed", "set_rng_state", "fork_rng")  # in torch and torch.random
_SEED_READS = ("initial_seed", "get_rng_state")  # the values they give would be held by the program


# torch's code that seeds, or saves and restores the generators, around random ops it runs
# (DTensor's random regions, ``fork_rng``'s own calls, a checkpoint's saved state), which
# the program runs as it was traced. Other torch code that seeds (``torch.testing``'s
# wrappers, ``torch._numpy.random``) is the user's code here.
_SEEDS_WHILE_TRACED = (
    *("torch.distributed.", "torch.random", "torch.utils.checkpoint", "torch._higher_order_ops."),
    *("torch._prims", "torch._decomp", "torch.cuda.", "torch.xpu.", "torch.mtia."),
)


@contextlib.contextmanager
def seeding_refused(reads: list = ()):
    """While tracing, torch's seeding functions raise where the user's code calls them:
    code that seeds, or restores the generator's state to draw the same numbers again
    (``fork_rng``), would do so once, while tracing, not at each call. Torch's own calls
    for the random ops it runs (DTensor's random regions) go through."""
    saved = [
        (owner, name, getattr(owner, name))
        for owner in (torch, torch.random)
        for name in (*_SEEDING, *_SEED_READS)
        if hasattr(owner, name)
    ]
    # Python's and NumPy's global generators' states, read by the user's code itself (a draw
    # is seen as a change of the state; one read, and set back, is not).
    numpy = sys.modules.get("numpy")
    saved += [(random, "getstate", random.getstate)]
    saved += [(numpy.random, "get_state", numpy.random.get_state)] if numpy is not None else []

    def refuse(name, original):
        def refused(*args, **kwargs):
            caller = sys._getframe(1)
            if name in ("getstate", "get_state"):
                if not library_code(caller.f_globals.get("__name__", ""), caller.f_code.co_filename):
                    raise TracingError(
                        f"dtcompile.jit: the traced code called {original.__module__}.{name}: a compiled program "
                        "runs the Python code once, while tracing, so it would hold the state read then"
                    )
                return original(*args, **kwargs)
            while dtcompile_code(caller.f_globals.get("__name__", "")):  # (a wrapper of ours)
                caller = caller.f_back
            if caller.f_globals.get("__name__", "").startswith(_SEEDS_WHILE_TRACED):
                return original(*args, **kwargs)
            if name in _SEED_READS:
                raise TracingError(
                    f"dtcompile.jit: the traced code called torch.{name}: a compiled program runs the Python "
                    "code once, while tracing, so it would hold the value read then; read it outside the call "
                    "and pass it in"
                )
            raise TracingError(
                f"dtcompile.jit: the traced code called torch.{name}: a compiled program runs the Python code "
                "once, while tracing, so it would set the generator once, not at each call; seed outside the call"
            )

        return refused

    # Also where the user's code holds one under its own name (``from torch import initial_seed``,
    # a global or a closure cell ``reads`` found).
    names = {id(original): name for _, name, original in saved}
    held = [r for r in reads if id(r.value) in names and (r.key is not None or r.attribute == "cell_contents")]
    for owner, name, original in saved:
        setattr(owner, name, refuse(name, original))
    for read in held:
        _hold(read, refuse(names[id(read.value)], read.value))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        for read in held:
            _hold(read, read.value)


def _hold(read, value) -> None:
    if read.key is not None:
        read.holder[read.key] = value
    else:
        read.holder.cell_contents = value
