"""The user's functions that ran while a call was traced though nothing the code reads
names them: a library holds them in its own table and calls them (an attention function
given to Hugging Face's ``AttentionInterface.register``, a KL divergence given to
``register_kl``, a decorator's closure without ``functools.wraps``). What the code can read
is found statically (``python_state.py``), from the function, its globals and what they
name, and library code is not followed: such a function was missed, and the globals it
read were baked in.

While tracing, the annotator hands :meth:`CodeRan.note` the frame of each torch-level call;
the frames above it are walked up to one walked before (held until the trace ends, so that
no other frame takes its id; a generator's, which other callers resume, is walked past). A user frame called by library code is an entry. After
tracing (``python_guards.AfterTracing.code_ran_unfollowed``), each entry's function not
followed is followed (a method's object too), and the library's table that holds it is
guarded by identity: a function registered in its place is seen. When an entry is first
met, the data its globals and its method's object hold is snapshotted
(``snapshots.DataSnapshot.add_frame``), as a hook's is: a change it makes (a statistic
appended to a global list) would happen once, while tracing, so it is refused.
"""

from __future__ import annotations

import gc
import inspect
import types

from ..core.code_origin import library_code

# A generator's or coroutine's frame is resumed by other callers: walked past each time.
_RESUMED = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class CodeRan:
    def __init__(self, tracer_frame, on_entry):
        # The tracer's frame, above the traced code: no walk goes past it (the caller's own
        # code, a test function pytest calls, is not the call's).
        self._frames: dict[int, types.FrameType] = {id(tracer_frame): tracer_frame}
        self._on_entry = on_entry  # (the frame of an entry, when first met)
        self._user: dict[types.CodeType, bool] = {}
        self.entries: dict[types.CodeType, None] = {}  # user code called by library code, in order met

    def note(self, frame) -> None:
        while frame is not None and (id(frame) not in self._frames or frame.f_code.co_flags & _RESUMED):
            self._frames[id(frame)] = frame
            caller = frame.f_back
            if caller is not None and frame.f_code not in self.entries and self._is_user(frame):
                if not self._is_user(caller):
                    self.entries[frame.f_code] = None
                    self._on_entry(frame)
            frame = caller

    def release(self) -> None:
        """Drop the frames walked (when tracing ends): they hold the traced code's locals,
        and the tracer's frame holds this (a cycle that would keep them for the collector);
        and the annotator's method called at an entry (it holds the recording, which holds this)."""
        self._frames.clear()
        self._on_entry = None

    def _is_user(self, frame) -> bool:
        known = self._user.get(frame.f_code)
        if known is None:
            module = frame.f_globals.get("__name__", "") or ""
            known = self._user[frame.f_code] = not library_code(module, frame.f_code.co_filename)
        return known


def found_for(code: types.CodeType) -> list[tuple[object, list[tuple[dict, object]]]]:
    """Each live function whose code is ``code``, and each method bound to one (a library
    table may hold ``obj.forward``), with ``(dict, key)`` for each dict (a library's
    registry, a module's globals) holding it as a value. A search of the whole heap (tens
    of milliseconds): kept for the next compile, and searched again where what was found
    no longer holds."""
    found = _FOUND.get(code)
    if found is None or not all(all(t.get(k) is f for t, k in tables) for f, tables in found):
        functions = [f for f in gc.get_referrers(code) if isinstance(f, types.FunctionType) and f.__code__ is code]
        methods = [
            m for f in functions for m in gc.get_referrers(f) if isinstance(m, types.MethodType) and m.__func__ is f
        ]
        found = _FOUND[code] = [(f, _tables_holding(f)) for f in functions + methods]
    return found


_FOUND: dict = {}


def _tables_holding(function) -> list[tuple[dict, object]]:
    return [
        (holder, key)
        for holder in gc.get_referrers(function)
        if type(holder) is dict
        for key, value in list(holder.items())
        if value is function
    ]
