"""The nvFuser executor on one GPU: op-info numerics, the Llama-style block, and timings.

Launched by ``scripts/gpu_check.sh`` as ``torchrun --nproc-per-node 1`` (a 1-rank NCCL mesh):

1. every op of the op-info table over its placements on the 1-rank mesh, compiled with
   the nvFuser executor first in line (every region fused, one op or more) and compared
   with eager DTensor on CUDA: values, placements, local shapes and strides;
2. the Llama-style block, forward under no_grad and forward+backward (input and parameter
   gradients), nvFuser executor against eager;
3. time per call of the block: eager DTensor, dtcompile with the torch executor, dtcompile
   with nvFuser, torch.compile; interleaved call by call, medians and ratios printed.

Exits non-zero when a comparison fails.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))

import dtcompile  # noqa: E402
from dtcompile.executors import FusionExecutor  # noqa: E402
from dtcompile.executors.fusion import CACHE  # noqa: E402
from dtcompile.testing.models import parallel_block  # noqa: E402


class CaseTimeout(Exception):
    """A case that ran past its time limit."""


def _on_alarm(signum, frame):
    raise CaseTimeout()


def op_table(mesh, args) -> int:
    from opinfo import OPS
    from test_ops import cases, check_case

    failures, checked, fused_ops, skipped = [], 0, 0, 0
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _on_alarm)
    for op in OPS:
        compiled = CACHE.misses + CACHE.hits
        for case_id, placements in cases(op, mesh.size()):
            if time.perf_counter() - start > args.op_table_seconds:
                break
            if _shards_a_size_one_dim(op, placements) or _cpu_attention_shard(op, placements, args.device):
                skipped += 1
                continue
            executors = [FusionExecutor(args.fusion_backend, min_ops=1), "torch"]
            signal.alarm(args.case_seconds)
            try:
                with torch.no_grad():
                    failure = check_case(op, placements, mesh, executors=executors)
            except CaseTimeout:
                failure = f"took more than {args.case_seconds} s"
            except Exception as error:  # a failure of the comparison itself
                failure = f"comparing raised {type(error).__name__}: {error}"
            finally:
                signal.alarm(0)
            checked += 1
            if failure is not None:
                failures.append(f"{case_id}: {failure[:400]}")
        fused_ops += CACHE.misses + CACHE.hits > compiled
    if time.perf_counter() - start > args.op_table_seconds:
        print(f"op table: stopped at its time limit, {args.op_table_seconds:.0f} s")
    print(
        f"op table on {args.device} with {args.fusion_backend}: {checked} cases, {len(failures)} differ from eager; "
        f"{fused_ops} ops compiled fusions, {len(CACHE)} fusions in all"
    )
    print(f"  ({skipped} cases left out: sharded size-1 dims, and on CPU sharded fused attention, which DTensor")
    print("   propagates through decompositions: seconds in eager on one rank, minutes under tracing)")
    for line in failures[:40]:
        print("  ", line)
    return len(failures)


def _shards_a_size_one_dim(op, placements) -> bool:
    from torch.distributed.tensor import Shard

    shapes = [op.args[i].shape for i in op.tensor_positions]
    return any(isinstance(p, Shard) and shape[p.dim] == 1 for p, shape in zip(placements, shapes))


def _cpu_attention_shard(op, placements, device: str) -> bool:
    from torch.distributed.tensor import Shard

    return device == "cpu" and op.name.startswith("sdpa_fused") and any(isinstance(p, Shard) for p in placements)


def _block(mesh, args, seed=0):
    block = parallel_block(mesh, dim=args.dim, n_heads=args.heads, hidden=args.hidden, seed=seed)
    return block.to(getattr(torch, args.dtype))


def _close(got, expected, what, tolerance) -> list[str]:
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    expected = expected.full_tensor() if hasattr(expected, "full_tensor") else expected
    try:
        torch.testing.assert_close(got, expected, **tolerance)
        return []
    except AssertionError as error:
        return [f"{what}: {' '.join(str(error).split())[:300]}"]


def block_checks(mesh, args) -> int:
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if args.dtype == "float32" else {"atol": 3e-2, "rtol": 3e-2}
    x = torch.randn(args.batch, args.seq, args.dim, device=args.device, dtype=getattr(torch, args.dtype))
    eager, compiled = _block(mesh, args), _block(mesh, args)
    # On CUDA nvFuser is the default; --fusion-backend reference names it (a dry run on CPU).
    executors = None if args.fusion_backend == "nvfuser_direct" else [FusionExecutor(args.fusion_backend), "torch"]
    jitted = dtcompile.jit(compiled, executors=executors)
    problems = []
    with torch.no_grad():
        problems += _close(jitted(x), eager(x), "block forward", tolerance)
    print(str(dtcompile.last_traces(jitted)[-1]).split("\ndef ")[0])
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e, out_c = eager(xe), jitted(xc)
    problems += _close(out_c.detach(), out_e.detach(), "block forward (training)", tolerance)
    cotangent = torch.randn_like(out_e)
    out_e.backward(cotangent)
    out_c.backward(cotangent)
    problems += _close(xc.grad, xe.grad, "input gradient", tolerance)
    for (name, pe), (_, pc) in zip(eager.named_parameters(), compiled.named_parameters()):
        problems += _close(pc.grad, pe.grad, f"gradient of {name}", tolerance)
    traces = dtcompile.last_traces(jitted)
    headers = [t.header_notes for t in traces if t.title.startswith("execution")]
    print("block forward+backward:", "; ".join(n for h in headers for n in h if "fusion" in n))
    print(f"block checks: {len(problems)} differ from eager")
    for line in problems:
        print("  ", line)
    return len(problems)


def _median_ms(samples) -> float:
    return statistics.median(samples) * 1e3


def timings(mesh, args) -> None:
    x = torch.randn(args.batch, args.seq, args.dim, device=args.device, dtype=getattr(torch, args.dtype))
    variants = {"eager DTensor": _block(mesh, args)}
    variants["dtcompile torch"] = dtcompile.jit(_block(mesh, args), executors=["torch"])
    fused = [FusionExecutor(args.fusion_backend), "torch"]
    variants["dtcompile nvFuser"] = dtcompile.jit(_block(mesh, args), executors=fused)
    if not args.no_inductor:
        variants["torch.compile"] = torch.compile(_block(mesh, args))
    for training in (False, True):
        first, samples = {}, {name: [] for name in variants}
        for name, fn in list(variants.items()):
            start = time.perf_counter()
            try:
                _step(fn, x, training)
            except Exception as error:
                print(f"  {name}: failed ({type(error).__name__}: {str(error)[:200]}); left out")
                variants.pop(name)
                continue
            _synchronize()
            first[name] = time.perf_counter() - start
        for _ in range(3):
            for fn in variants.values():
                _step(fn, x, training)
        _synchronize()
        for _ in range(args.iters):
            for name, fn in variants.items():
                _synchronize()
                start = time.perf_counter()
                _step(fn, x, training)
                _synchronize()
                samples[name].append(time.perf_counter() - start)
        mode = "forward+backward" if training else "forward (no_grad)"
        base = _median_ms(samples["dtcompile nvFuser"]) if "dtcompile nvFuser" in variants else None
        print(f"\nblock {mode}, batch {args.batch}, seq {args.seq}, dim {args.dim}, {args.dtype}, {args.iters} calls:")
        print(f"  {'variant':22s} {'median ms':>10s} {'/ nvFuser':>10s} {'first call s':>13s}")
        for name in variants:
            median = _median_ms(samples[name])
            ratio = f"{median / base:10.2f}" if base else f"{'':10s}"
            print(f"  {name:22s} {median:10.3f} {ratio} {first[name]:13.2f}")


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _step(fn, x, training: bool) -> None:
    if training:
        fn(x.detach().requires_grad_()).sum().backward()
    else:
        with torch.no_grad():
            fn(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op-table-seconds", type=float, default=150)
    parser.add_argument("--case-seconds", type=int, default=20, help="time limit of one op-table case")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2816)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--no-inductor", action="store_true", help="leave torch.compile out of the timings")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of this script")
    parser.add_argument("--fusion-backend", default="nvfuser_direct", choices=["nvfuser_direct", "reference"])
    args = parser.parse_args()

    executor = FusionExecutor(args.fusion_backend)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {device}, {args.fusion_backend}: {executor.reason}")
    if not executor.available:
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    failed = op_table(mesh, args)
    block_args = argparse.Namespace(
        **{**vars(args), "dtype": "float32", "seq": 64, "dim": 256, "hidden": 512, "heads": 8}
    )
    failed += block_checks(mesh, block_args)
    timings(mesh, args)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
