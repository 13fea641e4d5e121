"""Timing helpers for the torchrun-launched scripts.

On 2 ranks and 2 cores the ratios drift when variants are timed one after another, so
variants are interleaved call by call, each call preceded by a barrier, and reported as
medians.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves


def sync() -> None:
    """A barrier made of a one-element all_reduce (Gloo's barrier holds on to every earlier
    collective's tensors until a worker thread gets round to it; see ``finish``)."""
    dist.all_reduce(torch.zeros(1))


def init_gloo() -> int:
    """Join the torchrun job with Gloo, one thread per rank; returns this rank."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank()


def completed(output):
    """``output`` once its collectives are done. Eager DTensor may return before its last
    collective finishes (an AsyncCollectiveTensor, waited at first use); a fair timing
    includes that wait, as the compiled program's does."""
    for leaf in tree_leaves(output):
        local = leaf._local_tensor if isinstance(leaf, DTensor) else leaf
        if isinstance(local, AsyncCollectiveTensor):
            local.wait()
    return output


def interleaved_medians(variants: dict, calls: int, warmup: int = 10) -> dict[str, float]:
    """Median seconds per call of each variant (a no-argument callable), its collectives
    included."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + calls):
        for name, fn in variants.items():
            sync()
            start = time.perf_counter()
            completed(fn())
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    # Every rank reports the slowest rank's median: a collective program is as slow as that.
    medians = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(variants, medians.tolist()))


def print0(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def finish(exit_code: int = 0) -> None:
    """Leave the job together and end the process.

    The ranks meet through the store rather than a collective, then the process group is
    destroyed and the process ends at once (``os._exit``, after flushing its output),
    skipping the interpreter's teardown: Gloo's worker threads let go of a collective's
    tensors just after it completes, and a process whose process group is torn down at
    that moment during interpreter exit aborts (``terminate called without an active
    exception``, pytorch/pytorch#190489); on a loaded machine that happened in about one
    run in ten."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"finish/{dist.get_rank()}", "done")
    store.wait([f"finish/{rank}" for rank in range(dist.get_world_size())])
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
