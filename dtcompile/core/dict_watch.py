"""Being told when a dict changes, so that a prologue's checks that read only dicts (a
module tree's tables, hook tables, instance dicts, globals) need not read them at all while
none has changed: Python 3.12's dict watchers (``PyDict_AddWatcher``). Every change of a
watched dict (an item set, replaced or deleted, an attribute set through the instance,
``clear``, ``update``) bumps a counter, :data:`changes` (``changes.value``), so a prologue
compares one number instead of reading a version per dict, whatever the depth of the model.

The callback is a few lines of C, built once with the system's C compiler into a cache
directory and loaded with ctypes: CPython runs it inside every change of a watched dict,
wherever that happens (at the recursion limit, while an exception unwinds, as a dict is
freed, at exit), where Python code could fail and lose the change. Where dict watchers are
missing (Python 3.11), no C compiler is found, or they do not see every such change
(:func:`_watchers_follow_changes`), :data:`available` is False and prologues read the
dicts' versions instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

from dtcompile.core.dict_changes import dict_changes

_SOURCE = b"""
volatile unsigned long long dtcompile_dict_changes = 0;  /* no headers: a bare compiler will do */
int dtcompile_dict_changed(int event, void *dict, void *key, void *value) {
    dtcompile_dict_changes++;
    return 0;
}
"""

changes: ctypes.c_ulonglong | None = None  # the counter (``changes.value``); None where not available
_watcher: int | None = None
_watch = None


def _library_path() -> str | None:
    """The callback's shared library, built if not yet (None: no C compiler, or it failed)."""
    digest = hashlib.sha256(_SOURCE + sys.version.encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for folder in (os.path.join(base, "dtcompile"), os.path.join(tempfile.gettempdir(), "dtcompile")):
        path = os.path.join(folder, f"dict_watch-{digest}.so")
        if os.path.exists(path):
            return path
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            return None
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as work:  # ranks building at once: one rename wins
                source, built = os.path.join(work, "dict_watch.c"), os.path.join(work, "dict_watch.so")
                with open(source, "wb") as file:
                    file.write(_SOURCE)
                subprocess.run(
                    [compiler, "-shared", "-fPIC", "-O2", "-o", built, source],
                    check=True,
                    capture_output=True,
                    timeout=60,
                )
                os.replace(built, path)
            return path
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def _start() -> bool:
    global changes, _watcher, _watch
    if sys.version_info < (3, 12) or not hasattr(ctypes.pythonapi, "PyDict_AddWatcher"):
        return False
    path = _library_path()
    if path is None:
        return False
    try:
        library = ctypes.CDLL(path)
    except OSError:
        return False
    add = ctypes.pythonapi.PyDict_AddWatcher
    add.argtypes, add.restype = [ctypes.c_void_p], ctypes.c_int
    _watch = ctypes.pythonapi.PyDict_Watch
    _watch.argtypes, _watch.restype = [ctypes.c_int, ctypes.py_object], ctypes.c_int
    try:
        _watcher = add(ctypes.cast(library.dtcompile_dict_changed, ctypes.c_void_p).value)
    except ValueError:  # no free watcher slot (an interpreter has 8)
        return False
    changes = ctypes.c_ulonglong.in_dll(library, "dtcompile_dict_changes")
    return True


def watch(dicts: list[dict]) -> None:
    """Watch ``dicts`` from now on (a watched dict costs a C call at each of its changes)."""
    for d in dicts:
        _watch(_watcher, d)


def _watchers_follow_changes() -> bool:
    """Whether every change prologues rely on (``dict_changes``) is told on this Python.
    Where one is not, dict watchers are not used at all."""
    dicts, kinds = dict_changes()
    watch(dicts)
    for change in kinds:
        before = changes.value
        change()
        if changes.value == before:
            return False
    return True


available = _start() and _watchers_follow_changes()
