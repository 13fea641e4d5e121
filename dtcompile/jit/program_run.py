"""What an entry's program runs under: not what already acted on it while it was traced."""

from __future__ import annotations

import warnings

import torch.distributed as dist

from ..capture import LibrarySetUp, TracingError, UnsupportedInputError
from ..capture.global_state import autocast_off
from ..core.code_origin import dtcompile_code
from ..core.torch_internals import function_mode_count, function_modes_off
from .consistency import RankMismatchError


def run_entry(entry, inputs: tuple):
    """Run an entry's program (``entry.run``) on the prologue's result. The torch function
    modes active (guarded: the entry was traced under them, and what they did is in its
    program) are put aside, so that they do not act on the program's ops a second time;
    so is autocast where it was on (``entry.autocast``): the casts it made are in the
    program, and an op the traced code ran with autocast off (``autocast(enabled=False)``
    inside the call) or to another dtype must not be cast again. (A training call's
    backward was traced outside autocast and runs as autograd runs it: under autocast
    where the backward is called under it, as eager's.)"""
    if not function_mode_count() and not entry.autocast:
        return entry.run(inputs)
    with function_modes_off(), autocast_off(entry.autocast):
        return entry.run(inputs)


def eager_after_failing(error: BaseException) -> bool:
    """Whether a call whose tracing raised ``error`` runs eagerly instead, once, to raise it
    as eager does: after the changes the code made before it (an in-place write, an
    attribute set), which tracing made on stand-ins and put back. So where the error is the
    code's own or a torch kernel's check (not dtcompile's refusal or fault), in one process
    (eager on one rank alone would run collectives the others do not)."""
    if isinstance(error, LibrarySetUp):  # (a library's one-time setup, alike on every rank)
        return True
    if isinstance(error, (TracingError, UnsupportedInputError, RankMismatchError)) or not isinstance(error, Exception):
        return False
    if dist.is_initialized() and dist.get_world_size() > 1:
        return False
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else "dtcompile"
    return not dtcompile_code(module)


def run_eagerly(name: str, fn, args: tuple, kwargs: dict, error: BaseException):
    """The call run eagerly after its tracing raised ``error`` (see above): eager's error,
    after eager's changes; or, where eager runs (tracing met a check of torch's that eager's
    kernels do not make), its result, with a warning: each such call is traced again."""
    result = fn(*args, **kwargs)
    warnings.warn(
        f"dtcompile: tracing {name} raised {type(error).__name__}: {str(error)[:300]}; eager runs the call, so it "
        "ran eagerly (each such call is traced again)",
        stacklevel=4,
    )
    return result
