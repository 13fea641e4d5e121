"""Ranks that disagree on 2 Gloo ranks (issue 11, items 9-13): every rank finishes, with
eager's results or a clear error, within a stated bound; none waits for the sync timeout.

Each rank times its own calls; the tests assert every rank's time against the bound and
that the errors name the failing rank or argument."""

import os
import time
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from checks import assert_same
from harness import RankPool
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dtcompile

TIMEOUT = 120  # the harness's: a rank that hangs fails the test
FAST = 5.0  # seconds within which every rank must raise when a peer failed or disagrees
PG_TIMEOUT = 4.0  # the process group's timeout in the pool of the cached-call test
SYNC_TIMEOUT = "3"  # DTCOMPILE_SYNC_TIMEOUT there


@pytest.fixture(scope="module")
def ranks2_short():
    """Two ranks whose process group times out after PG_TIMEOUT seconds."""
    pool = RankPool(2, pg_timeout=PG_TIMEOUT)
    yield pool
    pool.close()


@contextmanager
def sync_timeout(seconds: str):
    previous = os.environ.get("DTCOMPILE_SYNC_TIMEOUT")
    os.environ["DTCOMPILE_SYNC_TIMEOUT"] = seconds
    try:
        yield
    finally:
        if previous is None:
            del os.environ["DTCOMPILE_SYNC_TIMEOUT"]
        else:
            os.environ["DTCOMPILE_SYNC_TIMEOUT"] = previous


def _timed(fn, *args, **kwargs):
    """``(kind, value, seconds)``: ``kind`` is "ok" or the error's type name, ``value`` the
    result or the error's message."""
    start = time.perf_counter()
    try:
        with torch.no_grad():
            kind, value = "ok", fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        kind, value = type(error).__name__, str(error)
    return kind, value, time.perf_counter() - start


def _gathered_double(x):
    if isinstance(x, DTensor):  # (a plain tensor is doubled only)
        x = x.redistribute(x.device_mesh, [Replicate()])
    return x * 2


def _other(t):
    return t + 1


# --- 9. the key comes from what is compiled, not from the order of jit calls ----------


def extra_jit_on_rank_0():
    mesh = init_device_mesh("cpu", (2,))
    with sync_timeout("20"):  # a key that does not match would show as a 20 s wait
        if dist.get_rank() == 0:
            dtcompile.jit(_gathered_double)  # never called
            dtcompile.jit(_other)(torch.ones(3))  # called: plain tensors, nothing to agree on
            dtcompile.jit(_gathered_double)(torch.ones(2))  # the same code, plain: no collective
        jitted = dtcompile.jit(_gathered_double)
        times = []
        for rows in (4, 6, 4):  # two misses, then a hit
            x = distribute_tensor(torch.arange(rows * 3.0).reshape(rows, 3), mesh, [Shard(0)])
            kind, got, seconds = _timed(jitted, x)
            assert kind == "ok", got
            with torch.no_grad():
                assert_same(got, _gathered_double(x))
            times.append(seconds)
        assert (dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)) == (2, 1)
        # Two compiled functions of one code, called in turn: their compilations are told apart.
        first, second = dtcompile.jit(_gathered_double), dtcompile.jit(_gathered_double)
        x = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
        for jf in (first, second, first):
            kind, got, seconds = _timed(jf, x)
            assert kind == "ok", got
            times.append(seconds)
    return max(times)


def test_extra_jit_calls_on_one_rank_do_not_matter(ranks2):
    assert max(ranks2.run(extra_jit_on_rank_0, timeout=TIMEOUT)) < FAST


# --- 10. local arithmetic may differ between ranks; collectives may not ----------------


def _rank_scaled(d):
    return (d * (1.0 + dist.get_rank())).redistribute(d.device_mesh, [Replicate()]) + 1


def rank_dependent_constants():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    kind, got, _ = _timed(dtcompile.jit(_rank_scaled), x)
    assert kind == "ok", got
    with torch.no_grad():
        assert_same(got, _rank_scaled(x))
    # A call that needs gradients: the forward and the backward differ between ranks too.
    w = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]).requires_grad_()
    w_eager = w.detach().clone().requires_grad_()
    dtcompile.jit(_rank_scaled)(w).sum().backward()
    _rank_scaled(w_eager).sum().backward()
    assert_same(w.grad, w_eager.grad)
    return got.to_local().sum().item()


def test_rank_dependent_python_constants_run_as_in_eager(ranks2):
    sums = ranks2.run(rank_dependent_constants, timeout=TIMEOUT)
    assert sums[0] == sums[1]  # replicated after the all-gather: the same on both ranks


# --- 11. a rank that fails while compiling: the others raise at once ------------------


def _fails_on(rank):
    def fn(x):
        if dist.get_rank() == rank:
            raise ValueError(f"bad input on rank {rank}")
        return _gathered_double(x)

    return fn


def one_rank_raises(failing: int, as_module: bool):
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    fn = _fails_on(failing)
    return _timed(dtcompile.jit(_Forward(fn) if as_module else fn), x)


class _Forward(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("as_module", [False, True], ids=["function", "module"])
def test_a_rank_that_raises_while_tracing_fails_every_rank_fast(ranks2, failing, as_module):
    results = ranks2.run(one_rank_raises, failing, as_module, timeout=TIMEOUT)
    for rank, (kind, message, seconds) in enumerate(results):
        assert seconds < FAST, (rank, seconds)
        if rank == failing:
            assert (kind, message) == ("ValueError", f"bad input on rank {failing}")
        else:
            assert kind == "RankFailedError", message
            assert f"rank {failing} failed" in message and f"ValueError: bad input on rank {failing}" in message


def _fails_before_a_branch_on(rank):
    def fn(x):
        if dist.get_rank() == rank:
            raise ValueError(f"bad input on rank {rank}")
        return x * 2 if x.sum() > 0 else x - 1  # the sum's all-reduce runs while tracing

    return fn


def one_rank_raises_before_a_data_branch(failing: int):
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    return _timed(dtcompile.jit(_fails_before_a_branch_on(failing)), x)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_that_raises_before_a_branch_on_data_fails_every_rank_fast(ranks2, failing):
    """Tracing runs the all-reduce a branch on a DTensor's sum reads: the peer waited in
    it for the process group's timeout, then raised Gloo's error. The ranks meet before it."""
    results = ranks2.run(one_rank_raises_before_a_data_branch, failing, timeout=TIMEOUT)
    for rank, (kind, message, seconds) in enumerate(results):
        assert seconds < FAST, (rank, seconds)
        if rank == failing:
            assert (kind, message) == ("ValueError", f"bad input on rank {failing}")
        else:
            assert kind == "RankFailedError" and f"rank {failing} failed" in message, message


def test_a_failed_rank_is_a_rank_mismatch():
    assert issubclass(dtcompile.RankFailedError, dtcompile.RankMismatchError)


def late_rank_and_failed_rank():
    """Rank 3 fails at once, rank 2 comes 3 s late: ranks 0 and 1 see the failure while
    they still wait for rank 2, and rank 2 sees it when it comes."""
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    if dist.get_rank() == 2:
        time.sleep(3)
    return _timed(dtcompile.jit(_fails_on(3)), x)


def test_a_failure_is_seen_while_another_rank_is_late(ranks4):
    results = ranks4.run(late_rank_and_failed_rank, timeout=TIMEOUT)
    assert results[3][:2] == ("ValueError", "bad input on rank 3")
    for rank in (0, 1, 2):
        kind, message, seconds = results[rank]
        assert kind == "RankFailedError" and "rank 3 failed" in message, message
        # Ranks 0 and 1 before rank 2 comes (they see a failure within 1 s of waiting).
        assert seconds < (FAST if rank == 2 else 3.0), (rank, seconds)


# --- 12. DTensor inputs whose global metadata differs between ranks --------------------


def _scaled_sum(scale, x):
    return (x * scale).redistribute(x.device_mesh, [Replicate()]).sum(0)


def different_global_inputs(case: str):
    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    rows = 2 + rank if case == "shape" else 2  # global 4 x 3 on rank 0, 6 x 3 on rank 1
    dtype = torch.float64 if case == "dtype" and rank == 1 else torch.float32
    local = torch.ones(rows, 3, dtype=dtype)
    placements = [Replicate()] if case == "placement" and rank == 1 else [Shard(0)]
    x = DTensor.from_local(local, mesh, placements, run_check=False)
    if case == "kwargs":
        x = DTensor.from_local(torch.ones(2 + rank, 3), mesh, [Shard(0)], run_check=False)
        return _timed(dtcompile.jit(_scaled_sum), 2.0, x=x)
    if case == "parameter":  # a module's parameter of 3 x 4 on rank 0, 3 x 6 on rank 1
        linear = torch.nn.Linear(2 + rank, 3, bias=False)
        weight = DTensor.from_local(torch.ones(3, 2 + rank), mesh, [Shard(1)], run_check=False)
        linear.weight = torch.nn.Parameter(weight)
        # (rows sharded: redistributed to columns, a collective. A program with none runs as eager's.)
        x = DTensor.from_local(torch.ones(5, 2 * (2 + rank)), mesh, [Shard(0)], run_check=False)
        return _timed(dtcompile.jit(linear), x)
    return _timed(dtcompile.jit(_scaled_sum), 2.0, x)


@pytest.mark.parametrize("case", ["shape", "dtype", "placement", "kwargs", "parameter"])
def test_dtensor_inputs_that_differ_between_ranks_raise_on_every_rank(ranks2, case):
    results = ranks2.run(different_global_inputs, case, timeout=TIMEOUT)
    path = {"kwargs": "kwargs['x']", "parameter": "args[0]"}.get(case, "args[1]")
    for rank, (kind, message, seconds) in enumerate(results):
        assert seconds < FAST, (rank, seconds)
        assert kind == "RankMismatchError", message
        assert "different DTensors" in message and f"{path} is" in message, message
        assert f"rank {rank}: DTensor" in message and f"rank {1 - rank}: DTensor" in message


# --- 13. a cached call whose guards pass on one rank only ------------------------------


def guards_fail_on_one_rank():
    mesh = init_device_mesh("cpu", (2,))
    with sync_timeout(SYNC_TIMEOUT):
        jitted = dtcompile.jit(_gathered_double)
        x = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], run_check=False)
        first = _timed(jitted, x)[0]
        if dist.get_rank() == 1:  # a miss on rank 1 only: it compiles, rank 0 runs its entry
            x = DTensor.from_local(torch.ones(3, 3), mesh, [Shard(0)], run_check=False)
        return first, *_timed(jitted, x)


def test_a_cached_call_that_one_rank_misses_fails_every_rank_within_the_timeouts(ranks2_short):
    try:
        results = ranks2_short.run(guards_fail_on_one_rank, timeout=TIMEOUT)
    finally:
        ranks2_short.close()  # the ranks' collectives no longer match: fresh ranks next time
    bound = max(PG_TIMEOUT, float(SYNC_TIMEOUT)) + 2.0  # the stated bound, and slack for a loaded machine
    (first0, kind0, message0, seconds0), (first1, kind1, message1, seconds1) = results
    assert first0 == first1 == "ok"
    assert seconds0 < bound and seconds1 < bound, (seconds0, seconds1)
    # Rank 1 compiled alone and gave up after the sync timeout.
    assert kind1 == "RankMismatchError", message1
    assert "ranks [0] did not compile" in message1 and f"within {SYNC_TIMEOUT} s" in message1
    # Rank 0's collective timed out, and it says why.
    assert kind0 == "RankMismatchError", message0
    assert "rank 0 ran its cached program" in message0 and "ranks [1] compiled a new one" in message0


S = 2.0


def _scaled_by_sign(x):
    return x * S if x.sum() > 0 else x - S  # the sum's all-reduce runs while tracing


def a_global_changed_on_one_rank_before_a_data_branch(checked: bool):
    global S
    mesh = init_device_mesh("cpu", (2,))
    S = 2.0
    with sync_timeout(SYNC_TIMEOUT):
        if checked:
            with calls_checked():
                jitted = dtcompile.jit(_scaled_by_sign)
        else:
            jitted = dtcompile.jit(_scaled_by_sign)
        x = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
        first = _timed(jitted, x)[0]
        if dist.get_rank() == 0:
            S = 3.0  # a miss on rank 0 only: it traces, and its trace runs the sum's all-reduce
        return first, *_timed(jitted, x)


@pytest.mark.parametrize("checked", [False, True], ids=["default", "calls checked"])
def test_a_cached_call_one_rank_misses_in_code_branching_on_a_collective_s_value(ranks2_short, checked):
    """The rank that missed met the other's cached program in the all-reduce its tracing
    ran (on 4 ranks the ranks that hit returned as if nothing happened): Gloo's errors after
    the process group's timeout, on every rank, also with every call checked."""
    try:
        results = ranks2_short.run(a_global_changed_on_one_rank_before_a_data_branch, checked, timeout=TIMEOUT)
    finally:
        ranks2_short.close()  # the ranks' collectives no longer match: fresh ranks next time
    bound = (FAST if checked else max(PG_TIMEOUT, float(SYNC_TIMEOUT))) + 2.0
    for rank, (first, kind, message, seconds) in enumerate(results):
        assert first == "ok" and seconds < bound, (rank, first, seconds)
        assert kind in ("RankMismatchError", "RankFailedError"), (rank, kind, message)
    message0, message1 = results[0][2], results[1][2]
    if checked:
        assert "ranks [0] missed the cache" in message0 and "ranks [0] missed the cache" in message1
    else:
        assert "ranks [1] did not come to that collective" in message0, message0
        assert "rank 1 ran its cached program" in message1 and "ranks [0] compiled a new one" in message1


@contextmanager
def calls_checked():
    os.environ["DTCOMPILE_RANK_CHECK"] = "calls"
    try:
        yield
    finally:
        del os.environ["DTCOMPILE_RANK_CHECK"]


def guards_fail_on_one_rank_with_calls_checked():
    mesh = init_device_mesh("cpu", (2,))
    with calls_checked():
        jitted = dtcompile.jit(_gathered_double)
    x = DTensor.from_local(torch.ones(2, 3) * (1 + dist.get_rank()), mesh, [Shard(0)], run_check=False)
    outcomes = [_timed(jitted, x), _timed(jitted, x)]  # a miss, then a hit, on both ranks
    other = DTensor.from_local(torch.ones(3, 3), mesh, [Shard(0)], run_check=False)
    outcomes.append(_timed(jitted, other if dist.get_rank() == 1 else x))  # a miss on rank 1 only
    # No collective was left waiting: the ranks go on together.
    kind, got, seconds = _timed(jitted, x)
    assert kind == "ok", got
    with torch.no_grad():
        assert_same(got, _gathered_double(x))
    return [(kind, message if kind != "ok" else None, seconds) for kind, message, seconds in outcomes]


def test_with_calls_checked_a_cached_call_that_one_rank_misses_fails_every_rank_fast(ranks2):
    results = ranks2.run(guards_fail_on_one_rank_with_calls_checked, timeout=TIMEOUT)
    for rank, outcomes in enumerate(results):
        assert [kind for kind, _, _ in outcomes[:2]] == ["ok", "ok"], outcomes
        kind, message, seconds = outcomes[2]
        assert seconds < FAST, (rank, seconds)
        if rank == 0:
            assert kind == "RankMismatchError", message
            assert "rank 0 would run its cached program" in message and "ranks [1] missed the cache" in message
        else:
            assert kind == "RankFailedError", message
            assert "rank 0 failed" in message and "ranks [1] missed the cache" in message


def a_rank_late_past_the_sync_timeout():
    mesh = init_device_mesh("cpu", (2,))
    with sync_timeout(SYNC_TIMEOUT):
        jitted = dtcompile.jit(_gathered_double)
        x = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], run_check=False)
        if dist.get_rank() == 0:
            time.sleep(float(SYNC_TIMEOUT) + 2.0)  # work of rank 0 alone (a checkpoint saved)
        return _timed(jitted, x)


def test_a_rank_that_comes_after_its_peer_gave_up_does_not_run_alone(ranks2_short):
    """The punctual rank gives up after the sync timeout; the late one, finding its
    program posted, must not take it as agreement and wait alone in a collective."""
    try:
        (kind0, message0, seconds0), (kind1, message1, _) = ranks2_short.run(a_rank_late_past_the_sync_timeout)
    finally:
        ranks2_short.close()  # (fresh ranks next time)
    assert kind1 == "RankMismatchError" and "ranks [0] did not compile" in message1, message1
    assert kind0 == "RankFailedError" and "rank 1 failed" in message0, message0
    assert seconds0 < FAST, seconds0


# --- 14. ranks that jit or call a function a different number of times ------------------


def called_once_more_on_one_rank():
    """A function with no collective, which rank 0 calls once more, with DTensors of
    another shape (a metric): the ranks paired rank 0's extra compilation with rank 1's,
    which took other DTensors, and both raised where eager runs."""
    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()

    def fn(d):
        return d * 2 + 1

    jitted = dtcompile.jit(fn)
    results = []
    with sync_timeout(SYNC_TIMEOUT):
        for rows in [4, 6] if rank == 0 else [6]:
            d = DTensor.from_local(
                torch.arange(rows * 2.0).reshape(rows // 2, 4) + rank, mesh, [Shard(0)], run_check=False
            )
            kind, value, seconds = _timed(jitted, d)
            results.append((kind, seconds < FAST, kind == "ok" and torch.equal(value.to_local(), fn(d).to_local())))
    return results


def test_a_function_without_collectives_called_once_more_on_one_rank_runs_as_eager(ranks2):
    for results in ranks2.run(called_once_more_on_one_rank, timeout=TIMEOUT):
        assert all(result == ("ok", True, True) for result in results)
