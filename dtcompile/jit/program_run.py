"""What an entry's program runs under: not what already acted on it while it was traced."""

from __future__ import annotations

from ..capture.global_state import autocast_off
from ..core.torch_internals import function_mode_count, function_modes_off


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
