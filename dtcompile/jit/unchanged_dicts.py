"""Checks a prologue skips while the dicts they read are unchanged since a call that passed
them: told by dict watchers where Python has them (``core/dict_watch.py``), else by each
dict's version. ``b`` is the prologue's builder (``prologue.py``)."""

from __future__ import annotations

from contextlib import contextmanager

from ..core import dict_watch
from ..core.torch_internals import dict_version


@contextmanager
def unless_dicts_changed(b, dicts: list[dict], unless: str = "", passes_if: str = ""):
    """The checks emitted inside run only when one of ``dicts`` (given by the end) has
    changed since the last call that passed them, and every check inside reads nothing but
    their items, scalars or objects compared by identity. Where dict watchers tell each
    change (``core/dict_watch.py``, Python 3.12+), one counter says so, whatever the
    number of dicts; elsewhere each dict's version is read (a dict's version changes with
    each change of its items: ``torch_internals._versions_follow_changes`` checks this
    Python). The counter or versions are read before the checks, so a change made meanwhile
    is seen at the next call. With neither, the checks run at every call. Dict watchers
    only: ``unless``, an expression true when the checks must run anyway; ``passes_if``,
    one true when a call that passed them may be recorded (what they read is still all in
    the dicts watched: a value replaced by an equal new container, not watched, is not)."""
    start = len(b.lines)
    yield
    body, unique = b.lines[start:], list({id(d): d for d in dicts}.values())
    if not body or not unique or not (dict_watch.available or dict_version is not None):
        return
    del b.lines[start:]
    if dict_watch.available:
        passed = b.fresh("PASSED_CHANGES")
        dict_watch.watch(unique)
        b.globals.update({"DICT_CHANGES": dict_watch.changes, passed: [None]})  # no call passed yet
        now = b.bind("DICT_CHANGES.value", "changes")
        b.lines.append(f"    if {now} != {passed}[0]{f' or {unless}' if unless else ''}:")
        b.lines += ["    " + line for line in body]
        b.lines.append(f"        {f'if {passes_if}: ' if passes_if else ''}{passed}[0] = {now}")
        return
    assert not (unless or passes_if), "unless_dicts_changed: these conditions need dict watchers"
    watched, passed = b.fresh("WATCHED_DICTS"), b.fresh("PASSED_VERSIONS")
    b.globals.update({"dict_version": dict_version, watched: unique, passed: []})  # no call passed yet
    now = b.bind(f"list(map(dict_version, {watched}))", "versions")
    b.lines.append(f"    if {now} != {passed}:")
    b.lines += ["    " + line for line in body]
    b.lines.append(f"        {passed}[:] = {now}")
