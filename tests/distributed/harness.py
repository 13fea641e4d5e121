"""Gloo ranks for the multi-process tests, started once and reused by many tests.

Starting a process that imports torch takes seconds, so a :class:`RankPool` starts its
ranks once (per pytest worker) and runs test functions in them: ``pool.run(fn, *args)``
calls ``fn(*args)`` on every rank and returns the list of results, rank by rank. ``fn``
must be a module-level function of a file under ``tests/``; the ranks import that file by
path. An exception on any rank fails the call with that rank's traceback; a call that
does not finish within its timeout (a hang in a collective), or in which a rank dies,
kills the ranks, and the next call starts fresh ones. ``RankPool(2, pg_timeout=4)``
gives the process group a short timeout, for tests where a rank is left waiting in a
collective on purpose.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import multiprocessing
import os
import sys
import tempfile
import traceback
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent


class RankError(AssertionError):
    """A test function failed or hung on some rank."""


def _load(path: str, cache: dict):
    module = cache.get(path)
    if module is None:
        name = "rankpool_" + Path(path).stem + f"_{len(cache)}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        cache[path] = module
    return module


def _worker(rank: int, world_size: int, init_file: str, conn, paths: list[str], pg_timeout: float | None) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    faulthandler.enable()  # a crash in C++ prints the rank's Python stack into the test's output
    sys.path[:0] = paths
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, **timeout)
    modules: dict = {}
    while True:
        message = conn.recv()
        if message is None:
            break
        path, qualname, args, kwargs = message
        try:
            fn = _load(path, modules)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion errors
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` Gloo ranks in spawned processes; ``pg_timeout``: the process group's
    timeout in seconds (Gloo's default when None)."""

    def __init__(self, world_size: int, pg_timeout: float | None = None):
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self._procs: list = []
        self._conns: list = []
        self._tmp = None

    def _start(self) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # DTensor breaks ties between sharding strategies in the order of a set, which
        # depends on the hash seed: ranks with different seeds can pick different
        # strategies (and eager then hangs). One seed for all ranks, as a job should use.
        os.environ.setdefault("PYTHONHASHSEED", "0")
        self._tmp = tempfile.TemporaryDirectory(prefix="dtcompile-ranks-")
        init_file = os.path.join(self._tmp.name, "init")
        ctx = multiprocessing.get_context("spawn")
        paths = [str(TESTS_DIR), str(TESTS_DIR / "distributed")]
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, self.world_size, init_file, child, paths, self.pg_timeout), daemon=True
            )
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)

    def run(self, fn, *args, timeout: float = 300, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results, rank by rank."""
        if any(not proc.is_alive() for proc in self._procs):
            self.close()  # a rank died after the last call: start afresh, not fail every later test
        if not self._procs:
            self._start()
        path = os.path.abspath(sys.modules[fn.__module__].__file__)
        results, errors = [], []
        for conn in self._conns:
            try:
                conn.send((path, fn.__qualname__, args, kwargs))
            except OSError:  # BrokenPipeError: the rank is gone; its recv below says so
                pass
        for rank, conn in enumerate(self._conns):
            # Once a rank has failed, the others may be stuck in a collective: wait less.
            if not conn.poll(min(timeout, 30) if errors else timeout):
                self.close()
                raise RankError(
                    f"{fn.__qualname__} did not finish on rank {rank} within the timeout (a hang?)\n"
                    + "\n".join(errors)
                )
            try:
                status, value = conn.recv()
            except EOFError:  # the rank died (a crash in C++, or killed)
                errors.append(self._died(rank))
                continue
            if status == "ok":
                results.append(value)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            # A rank that failed may have left collectives unmatched: start afresh next time.
            self.close()
            raise RankError(
                f"{fn.__qualname__} failed on {len(errors)} of {self.world_size} ranks:\n" + "\n".join(errors)
            )
        return results

    def _died(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(timeout=5)
        return f"--- rank {rank} ---\nthe rank's process died (exit code {proc.exitcode})"

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns = [], []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
