"""Checks a prologue skips while the dicts they read are unchanged since a call that passed
them: told by dict watchers where Python has them (``core/dict_watch.py``), else by each
dict's version. ``b`` is the prologue's builder (``prologue.py``)."""

from __future__ import annotations

from contextlib import contextmanager

from ..core import dict_watch
from ..core.torch_internals import dict_version


@contextmanager
def unless_dicts_changed(b, dicts: list[dict], unless: str = ""):
    """The checks emitted inside run only when one of ``dicts`` (given by the end) has
    changed since the last call that passed them, and every check inside reads nothing but
    their items, scalars or objects compared by identity. Where dict watchers tell each
    change (``core/dict_watch.py``, Python 3.12+), one counter says so, whatever the
    number of dicts; elsewhere each dict's version is read (a dict's version changes with
    each change of its items: ``torch_internals._versions_follow_changes`` checks this
    Python). The counter or versions are read before the checks, so a change made meanwhile
    is seen at the next call. With neither, the checks run at every call. ``unless``: an
    expression true when the checks must run anyway (dict watchers only)."""
    start = len(b.lines)
    yield
    body, unique = b.lines[start:], list({id(d): d for d in dicts}.values())
    if not body or not unique or not (dict_watch.available or dict_version is not None):
        return
    del b.lines[start:]
    if dict_watch.available:
        passed = b.fresh("PASSED_CHANGES")
        if "WATCH_TOKEN" not in b.globals:  # the dicts are watched for as long as the prologue lives
            b.globals["WATCH_TOKEN"] = _WatchToken()
        dict_watch.watch(unique, b.globals["WATCH_TOKEN"])
        b.globals.update({"DICT_CHANGES": dict_watch.changes, passed: [None]})  # no call passed yet
        now = b.bind("DICT_CHANGES[0]", "changes")
        b.lines.append(f"    if {now} != {passed}[0]{f' or {unless}' if unless else ''}:")
        b.lines += ["    " + line for line in body]
        b.lines.append(f"        {passed}[0] = {now}")
        return
    assert not unless, "unless_dicts_changed: an extra condition needs dict watchers"
    watched, passed = b.fresh("WATCHED_DICTS"), b.fresh("PASSED_VERSIONS")
    b.globals.update({"dict_version": dict_version, watched: unique, passed: []})  # no call passed yet
    now = b.bind(f"list(map(dict_version, {watched}))", "versions")
    b.lines.append(f"    if {now} != {passed}:")
    b.lines += ["    " + line for line in body]
    b.lines.append(f"        {passed}[:] = {now}")


class _WatchToken:
    """Held by a prologue's globals: the dicts it watches are released with it."""

    def __repr__(self) -> str:
        return "<the dicts this prologue watches>"
