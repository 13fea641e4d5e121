"""Collectives the program calls itself (``dist.all_reduce(y)``), compiled against eager
on Gloo ranks: every in-place c10d collective and the functional ones, synchronous and
with ``async_op=True``, in functions, hand-written tensor-parallel modules (forward and
backward) and a Hugging Face model loaded with ``tp_plan="auto"``; what cannot be
recorded is refused with a TracingError naming the call (issue 11, item 0)."""

import functools
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from checks import assert_all_same, assert_same
from torch.distributed import all_to_all_single as all_to_all_single_by_name  # (bound before any call)
from torch.distributed import distributed_c10d

import dtcompile


def _ranks():
    return dist.get_rank(), dist.get_world_size()


def all_reduce_sum(x):
    y = x * 2
    dist.all_reduce(y)
    return y + 1


def all_reduce_max_async(x):
    y = x * 2
    work = dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    return y + 1


def all_reduce_of_the_input(x):
    dist.all_reduce(x)  # the caller's tensor changes, as in eager
    return x * 3


def all_reduce_on_a_subgroup(x):
    y = x.sin()
    dist.all_reduce(y, group=dist.new_group(list(range(dist.get_world_size()))))
    return y


def all_gather_into_tensor(x):
    _, n = _ranks()
    out = torch.empty(x.shape[0] * n, *x.shape[1:])
    dist.all_gather_into_tensor(out, x + 1)
    return out


def all_gather_list(x):
    _, n = _ranks()
    outs = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(outs, x * 2)
    return torch.stack(outs) + 1


def reduce_scatter_tensor_async(x):
    _, n = _ranks()
    out = torch.empty(x.shape[0] // n, *x.shape[1:])
    dist.reduce_scatter_tensor(out, x * 2, async_op=True).wait()
    return out


def reduce_scatter_list(x):
    _, n = _ranks()
    out = torch.empty(x.shape[0] // n, *x.shape[1:])
    dist.reduce_scatter(out, list((x * 2).chunk(n)))
    return out


def broadcast_from_last(x):
    _, n = _ranks()
    y = x + 1
    dist.broadcast(y, src=n - 1)
    return y * 2


def all_to_all_single(x):
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x * 2)
    return out


def all_to_all_list(x):
    _, n = _ranks()
    inputs = list((x * 2).chunk(n))
    outputs = [torch.empty_like(t) for t in inputs]
    dist.all_to_all(outputs, inputs)
    return torch.cat(outputs)


def functional_all_reduce(x):
    return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1


def two_buffers_filled_by_collectives(x):
    a, b = torch.zeros_like(x), torch.zeros_like(x)  # equal computations, filled apart
    a.copy_(x)
    dist.all_reduce(a)
    dist.broadcast(b, src=0)
    return a + b


def scatter_from_last(x):
    rank, n = _ranks()
    out = torch.empty_like(x.chunk(n)[0])
    dist.scatter(out, list((x * 2).chunk(n)) if rank == n - 1 else None, src=n - 1)
    return out + 1


def all_to_all_rank_dependent_splits(x):
    """Split sizes that differ between ranks, constants of each rank's program."""
    rank, n = _ranks()

    def sent(source):  # rows rank ``source`` sends to each rank, of its 2 * n
        rows = [2] * n
        if source % 2:
            rows[0], rows[1] = 3, 1
        return rows

    received = [sent(source)[rank] for source in range(n)]
    out = torch.empty(sum(received), *x.shape[1:])
    dist.all_to_all_single(out, x * 2, received, sent(rank))
    return out


def reduce_to_last(x):
    """What the other ranks' tensor holds after it is the backend's: not returned."""
    rank, n = _ranks()
    y = x * 2
    dist.reduce(y, dst=n - 1)
    return y + 1 if rank == n - 1 else x + 1


def a_constant_on_one_rank(x):
    """Each rank's collective has a value while tracing on one rank only: none is run then."""
    rank, _ = _ranks()
    y = torch.ones_like(x) if rank == 0 else x * 2
    dist.all_reduce(y)
    return y


def all_reduce_future_and_result(x):
    y = x * 2
    work = dist.all_reduce(y, async_op=True)
    doubled = work.get_future().then(lambda future: future.value()[0] * 2).wait()
    work.wait()  # (eager's result() needs it)
    return work.get_future().wait()[0] + work.result()[0] + doubled


FUNCTIONS = [
    all_reduce_future_and_result,
    scatter_from_last,
    reduce_to_last,
    all_to_all_rank_dependent_splits,
    a_constant_on_one_rank,
    all_reduce_sum,
    all_reduce_max_async,
    all_reduce_of_the_input,
    all_reduce_on_a_subgroup,
    all_gather_into_tensor,
    all_gather_list,
    reduce_scatter_tensor_async,
    reduce_scatter_list,
    broadcast_from_last,
    all_to_all_single,
    all_to_all_list,
    functional_all_reduce,
    two_buffers_filled_by_collectives,
]


def functions_equal_eager():
    rank, n = _ranks()
    for fn in FUNCTIONS:
        jitted = dtcompile.jit(fn)
        for call in range(2):  # the compiling call, then a cached one
            x = torch.arange(4.0 * n).reshape(2 * n, 2) * (rank + 1) + call
            got_x, expected_x = x.clone(), x.clone()
            assert_same(jitted(got_x), fn(expected_x), f"{fn.__name__}, call {call}")
            assert_same(got_x, expected_x, f"{fn.__name__}: the argument after call {call}")
        assert dtcompile.cache_misses(jitted) == 1, fn.__name__
    return True


def test_direct_collectives_equal_eager(ranks2):
    assert ranks2.run(functions_equal_eager) == [True, True]


def test_direct_collectives_on_four_ranks(ranks4):
    assert ranks4.run(functions_equal_eager) == [True] * 4


class _AllReduceForward(torch.autograd.Function):
    """Megatron's "reduce from the tensor-parallel region": all_reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _AllReduceBackward(torch.autograd.Function):
    """Megatron's "copy to the tensor-parallel region": identity forward, all_reduce backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class HandWrittenParallelMLP(torch.nn.Module):
    """A column-parallel then row-parallel MLP on plain local shards, as Megatron writes it."""

    def __init__(self, dim=8, hidden=16):
        super().__init__()
        rank, n = _ranks()
        torch.manual_seed(0)
        up, down = torch.randn(hidden, dim), torch.randn(dim, hidden)
        self.up = torch.nn.Parameter(up.chunk(n, dim=0)[rank].clone())
        self.down = torch.nn.Parameter(down.chunk(n, dim=1)[rank].clone())

    def forward(self, x):
        x = _AllReduceBackward.apply(x)
        h = torch.nn.functional.gelu(x @ self.up.t())
        return _AllReduceForward.apply(h @ self.down.t())


def hand_written_tensor_parallel():
    torch.manual_seed(1)
    model = HandWrittenParallelMLP()
    reference = HandWrittenParallelMLP()
    jitted = dtcompile.jit(model)
    for step in range(2):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            assert_same(jitted(x), reference(x), f"inference {step}")
        got_x, expected_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, expected = jitted(got_x), reference(expected_x)
        assert_same(got, expected, f"training {step}")
        got.square().sum().backward()
        expected.square().sum().backward()
        assert_all_same(
            [got_x.grad, model.up.grad, model.down.grad], [expected_x.grad, reference.up.grad, reference.down.grad]
        )
    return True


def test_hand_written_tensor_parallelism_forward_and_backward(ranks2):
    assert ranks2.run(hand_written_tensor_parallel) == [True, True]


def autograd_collectives():
    """``torch.distributed.nn.functional``'s differentiable collectives (which refuse under
    torch.compile), forward and backward; on Gloo their backward scatters and reduces."""
    import torch.distributed.nn.functional as dnf

    rank, n = _ranks()
    functions = {
        "all_reduce": lambda x: dnf.all_reduce(x * 2) * x,
        "all_gather": lambda x: torch.cat(dnf.all_gather(x * 2)) * 3,
        "all_to_all": lambda x: torch.cat(dnf.all_to_all([torch.empty(2, 2) for _ in range(n)], list(x.chunk(n)))),
        "all_to_all_single": lambda x: dnf.all_to_all_single(torch.empty(2 * n, 2), x.square()),
        "broadcast": lambda x: dnf.broadcast(x + 1, src=0) * x,
        "reduce_scatter": lambda x: dnf.reduce_scatter(torch.empty(2, 2), list(x.chunk(n))),
    }
    for name, fn in functions.items():
        jitted = dtcompile.jit(fn)
        for call in range(2):
            x = torch.arange(4.0 * n).reshape(2 * n, 2) * (rank + 1) + call
            got_x, expected_x = x.clone().requires_grad_(), x.clone().requires_grad_()
            got, expected = jitted(got_x), fn(expected_x)
            assert_same(got, expected, f"{name}, call {call}")
            got.square().sum().backward()
            expected.square().sum().backward()
            assert_same(got_x.grad, expected_x.grad, f"{name}: the gradient, call {call}")
    return True


def test_autograd_collectives_forward_and_backward(ranks2):
    assert ranks2.run(autograd_collectives) == [True, True]


def _save_small_llama(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if dist.get_rank() == 0:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()


def hf_tp_plan_auto(path: str):
    from transformers import AutoModelForCausalLM, DynamicCache

    _save_small_llama(path)
    rank, n = _ranks()  # what torchrun sets, and Hugging Face reads; put back after loading
    launcher = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
    saved = {k: os.environ.get(k) for k in launcher}
    os.environ.update(launcher)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    jitted = dtcompile.jit(model)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same(jitted(input_ids=prompt).logits, model(input_ids=prompt).logits, "prefill")
    printed = "\n".join(map(str, dtcompile.last_traces(jitted)))  # (the layers' own in their program)
    assert "dist.all_reduce" in printed, "the model calls dist.all_reduce itself"
    # Left padding: Hugging Face's check of the mask, a branch on data after the vocab-parallel
    # embedding's in-place write (of memory the check does not read).
    batch = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    with torch.no_grad():
        got = jitted(input_ids=batch, attention_mask=mask).logits
        assert_same(got, model(input_ids=batch, attention_mask=mask).logits, "padded prefill")

    def generate(forward):
        cache, inputs, tokens = DynamicCache(config=model.config), prompt, []
        with torch.no_grad():
            for _ in range(4):
                out = forward(input_ids=inputs, past_key_values=cache, use_cache=True)
                inputs = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(inputs)
        return torch.cat(tokens, dim=1), out.logits

    got_tokens, got_logits = generate(jitted)
    expected_tokens, expected_logits = generate(model)
    assert torch.equal(got_tokens, expected_tokens)
    assert_same(got_logits, expected_logits, "last decode step")
    return True


def test_hugging_face_tp_plan_auto_prefill_and_decode(ranks2, tmp_path):
    assert ranks2.run(hf_tp_plan_auto, os.fspath(tmp_path), timeout=300) == [True, True]


def _send_recv(x):
    rank, _ = _ranks()
    if rank == 0:
        dist.send(x, dst=1)
    else:
        dist.recv(x, src=0)
    return x


def _gather_object(x):
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, {"rank": dist.get_rank()})
    return x * len(objects)


def _broadcast_object_from_1(x):
    objects = [x.shape[0] * 10 + dist.get_rank()]
    dist.broadcast_object_list(objects, src=1)
    return x * objects[0]


def _scatter_object_from_0(x):
    out = [None]
    dist.scatter_object_list(out, [1, 2] if dist.get_rank() == 0 else None, src=0)
    return x * out[0]


def _from_local_checked(x):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return DTensor.from_local(x * 2, mesh, [Shard(0)], run_check=True)


def _barrier(x):
    dist.barrier()
    return x + 1


def _gather(x):
    outputs = [torch.empty_like(x) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(x, outputs, dst=0)
    return x


REFUSED = {
    _send_recv: ("dist.send", "dist.recv"),
    _gather_object: ("dist.all_gather_object",),
    # Rooted: the ranks' tracing differs (the root pickles first); neither may wait for the
    # other (eager's error was looked for by running the failing broadcast for real).
    _broadcast_object_from_1: ("dist.broadcast_object_list",),
    _scatter_object_from_0: ("dist.scatter_object_list",),
    # torch's check of the local tensors' metadata, named as the call the user made
    _from_local_checked: ("DTensor.from_local(..., run_check=True)",),
    _barrier: ("dist.barrier",),
    _gather: ("dist.gather",),
}


def refused_collectives():
    messages = []
    for fn, calls in REFUSED.items():
        start = time.perf_counter()
        with pytest.raises(dtcompile.TracingError) as error:
            dtcompile.jit(fn)(torch.ones(2))
        assert time.perf_counter() - start < 10, fn.__name__  # no rank waits for another
        assert any(call + " " in str(error.value) for call in calls), str(error.value)
        messages.append(str(error.value))
    dist.barrier()  # the process group still works
    return messages


def test_what_cannot_be_recorded_is_refused_naming_the_call(ranks2):
    for messages in ranks2.run(refused_collectives):
        assert "point-to-point" in messages[0] and "pickled Python objects" in messages[1]
        assert "pass run_check=False" in messages[4]


def _all_reduce_of_a_column(x):
    y = torch.arange(6.0).view(2, 3) * (dist.get_rank() + 1)
    dist.all_reduce(y[:, 1])
    return y


def _all_gather_into_a_wide_output(x):
    out = torch.empty(x.shape[0], x.shape[1] * dist.get_world_size())
    dist.all_gather_into_tensor(out, x)
    return out


def _all_gather_into_empty_tensors(x):
    outs = [torch.empty(0) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, x)
    return outs


def _reduce_scatter_into_float64(x):
    out = torch.empty(x.shape[0] // dist.get_world_size(), *x.shape[1:], dtype=torch.float64)
    dist.reduce_scatter_tensor(out, x)
    return out


def buffers_eager_refuses():
    """Each raises in eager (Gloo checks the buffers); compiled, it returned values."""
    x = torch.ones(4, 3)
    for fn in (_all_gather_into_a_wide_output, _all_gather_into_empty_tensors, _reduce_scatter_into_float64):
        with pytest.raises(RuntimeError):
            fn(x.clone())
        with pytest.raises(RuntimeError, match="where the collective takes"):
            dtcompile.jit(fn)(x.clone())
    with pytest.raises(dtcompile.TracingError, match="a view with gaps between its elements"):
        dtcompile.jit(_all_reduce_of_a_column)(x)  # eager writes memory the view does not hold
    return True


def test_buffers_eager_refuses_are_refused(ranks2):
    assert all(ranks2.run(buffers_eager_refuses))


def _exchanged_splits(x, splits):
    """MoE's size exchange: the split sizes of the second all_to_all come from the first's."""
    recv = torch.empty_like(splits)
    dist.all_to_all_single(recv, splits)
    outs = recv.tolist()
    out = x.new_full((sum(outs), x.shape[1]), -1.0)
    dist.all_to_all_single(out, x, output_split_sizes=outs, input_split_sizes=splits.tolist())
    return out


def _exchanged_splits_async(x, splits):
    recv = torch.empty_like(splits)
    dist.all_to_all_single(recv, splits, async_op=True).wait()
    outs = recv.tolist()
    out = x.new_full((sum(outs), x.shape[1]), -1.0)
    work = all_to_all_single_by_name(out, x * 2, outs, splits.tolist(), async_op=True)
    doubled = x * 3  # (other work before the wait)
    work.wait()
    return out, doubled


def _exchanged_splits_from_c10d(x, splits):
    recv = torch.empty_like(splits)
    distributed_c10d.all_to_all_single(recv, splits)
    outs = recv.tolist()
    out = x.new_full((sum(outs), x.shape[1]), -1.0)
    all_to_all_single_by_name(out, x, outs, splits.tolist(), group=dist.group.WORLD)
    return out


def splits_a_collective_exchanged():
    rank = dist.get_rank()
    results = []
    for fn in (_exchanged_splits, _exchanged_splits_async, _exchanged_splits_from_c10d):
        jitted = dtcompile.jit(fn)
        for first in (1, 3, 0):  # one compilation serves each exchange of sizes
            x = torch.arange(12.0).reshape(4, 3) + 10 * rank
            splits = torch.tensor([first, 4 - first]) if rank == 0 else torch.tensor([2, 2])
            expected = fn(x.clone(), splits.clone())
            got = jitted(x.clone(), splits.clone())
            assert_same(got, expected)
            results.append(torch.as_tensor(got[0] if isinstance(got, tuple) else got).shape[0])
        assert dtcompile.cache_misses(jitted) == 1
    return results


def _reduce_scatter_tensor_of(y):
    out = torch.empty(y.shape[0] // dist.get_world_size(), *y.shape[1:])
    dist.reduce_scatter_tensor(out, y)
    return out


def _reduce_scatter_list_of(y):
    out = torch.empty(y.shape[0] // dist.get_world_size(), *y.shape[1:])
    dist.reduce_scatter(out, list(y.chunk(dist.get_world_size())))
    return out


def _all_gather_into_tensor_of(y):
    out = torch.empty(y.shape[0] * dist.get_world_size(), *y.shape[1:])
    dist.all_gather_into_tensor(out, y)
    return out


def _all_reduce_avg_of(y):
    y = y * 1.0
    dist.all_reduce(y, op=dist.ReduceOp.AVG)
    return y


def _of_a_product(collective, weight, x):
    return collective(x @ weight)


def collectives_whose_eager_gradient_is_the_backends():
    """A reduce-scatter or all-gather into another tensor, of one that requires grad: Gloo's
    kernel writes the output with copies autograd records (a gradient through the rank's
    own rows), NCCL's writes it with none; an all-reduce by AVG: Gloo's divides where
    autograd sees it (a gradient of 1/world size), NCCL's does not (of 1). Refused under
    grad mode, compiled without."""
    weight = torch.nn.Parameter(torch.ones(3, 3))
    x = torch.ones(4, 3) * (dist.get_rank() + 1)
    collectives = (_reduce_scatter_tensor_of, _reduce_scatter_list_of, _all_gather_into_tensor_of, _all_reduce_avg_of)
    for collective in collectives:
        program = functools.partial(_of_a_product, collective, weight)
        with pytest.raises(dtcompile.TracingError, match="requires grad: eager's gradient through it"):
            dtcompile.jit(program)(x)
        with torch.no_grad():
            assert_same(dtcompile.jit(program)(x), program(x))
    return True


def test_collectives_whose_eager_gradient_is_the_backends_are_refused_with_gradients(ranks2):
    assert all(ranks2.run(collectives_whose_eager_gradient_is_the_backends))


def _reduced_after_saved(x, w):
    y = x @ w  # autograd saves w
    dist.all_reduce(w)
    return y.sum()


def _broadcast_after_saved(x, w):
    y = (x @ w).tanh()
    dist.broadcast(w, src=1)
    return y.sum()


def collectives_writing_a_saved_leaf():
    """c10d's kernels count no write: eager's backward reads the written values, silently;
    the program's would read those saved. Refused, saying so (it said eager raises)."""
    for fn in (_reduced_after_saved, _broadcast_after_saved):
        x, w = torch.ones(2, 3, requires_grad=True), (torch.arange(6.0).view(3, 2) + dist.get_rank()).requires_grad_()
        with pytest.raises(dtcompile.TracingError, match="c10d's kernels count no write"):
            dtcompile.jit(fn)(x, w)
    return True


def test_a_collective_writing_a_leaf_autograd_saved_is_refused_clearly(ranks2):
    assert all(ranks2.run(collectives_writing_a_saved_leaf))


def _reduced_in_place(x):
    dist.all_reduce(x)
    return x * 2


def collectives_writing_an_inference_tensor():
    """An inference tensor passed outside inference mode: c10d's kernel writes it, the
    program's copy raised torch's raw in-place error at each call. Refused clearly, also
    where a normal tensor compiled the entry first; under inference mode, eager's."""
    jitted = dtcompile.jit(_reduced_in_place)
    with torch.inference_mode():
        x = torch.ones(3) * (dist.get_rank() + 1)
    assert torch.equal(jitted(torch.ones(3)), _reduced_in_place(torch.ones(3)))
    with pytest.raises(dtcompile.TracingError, match="writes an inference tensor outside inference mode"):
        jitted(x)
    with torch.inference_mode():
        expected, got = _reduced_in_place(x.clone()), jitted(x.clone())
    assert torch.equal(got, expected)
    return True


def test_a_collective_writing_an_inference_tensor_outside_inference_mode_is_refused(ranks2):
    assert all(ranks2.run(collectives_writing_an_inference_tensor))


def _group_all_reduce_of_two(a, b):
    dist.group.WORLD.allreduce([a, b]).wait()
    return a, b


def _group_broadcast_of_two(a, b):
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 1, 1
    dist.group.WORLD.broadcast([a, b], options).wait()
    return a, b


def collectives_of_several_tensors_per_rank():
    """A ProcessGroup method given several tensors per rank reduces (or broadcasts) across
    them all, as devices of the rank: each was reduced on its own, silently. Refused."""
    for fn in (_group_all_reduce_of_two, _group_broadcast_of_two):
        with pytest.raises(dtcompile.TracingError, match="2 tensors per rank"):
            dtcompile.jit(fn)(torch.ones(2), torch.ones(2) * 10)
    one = dtcompile.jit(lambda a: dist.group.WORLD.allreduce([a]).wait() and a)  # one, as dist.all_reduce's
    assert torch.equal(one(torch.ones(2) * (dist.get_rank() + 1)), torch.full((2,), 3.0))
    return True


def test_collectives_of_several_tensors_per_rank_are_refused(ranks2):
    assert all(ranks2.run(collectives_of_several_tensors_per_rank))


def test_all_to_all_with_split_sizes_a_collective_exchanged(ranks2):
    # c10d's all_to_all_single takes only ints: a raw TypeError before.
    assert ranks2.run(splits_a_collective_exchanged)[1] == [5, 3, 6] * 3


def _coalesced(pieces):
    def fn(x):
        y = x * 1
        dist.all_reduce_coalesced(pieces(y))
        return y

    return fn


def _two_coalesced(a, b):
    dist.all_reduce_coalesced([a, b])
    return a + 0, b + 0


def coalesced_all_reduces():
    # Gloo reduces a flat copy of them all: an element two tensors share is reduced once.
    x = torch.arange(4.0) + dist.get_rank()
    for pieces in (
        lambda y: [y[0:2], y[2:4]],  # pieces of one buffer, as buckets are
        lambda y: [y, y],
        lambda y: [y[0:3], y[1:4]],
        lambda y: [y, y.view(2, 2).view(4)],
    ):
        fn = _coalesced(pieces)
        assert torch.equal(dtcompile.jit(fn)(x.clone()), fn(x.clone()))
    # Sharing memory only at a cached call (its inputs' metadata as the first call's): they
    # were reduced one after the other, the shared elements twice.
    jitted = dtcompile.jit(_two_coalesced)
    for share in (False, True, False, True):

        def inputs(share=share):
            base, other = torch.arange(6.0) + 10 * dist.get_rank(), torch.arange(6.0) - dist.get_rank()
            return base, base if share else other

        eager_base, eager_second = inputs()
        expected = _two_coalesced(eager_base[0:4], eager_second[2:6])
        base, second = inputs()
        got = jitted(base[0:4], second[2:6])
        assert all(map(torch.equal, got, expected))
        assert torch.equal(base, eager_base) and torch.equal(second, eager_second)
    return True


def test_coalesced_all_reduces_of_tensors_that_share_memory_reduce_each_element_once(ranks2):
    assert all(ranks2.run(coalesced_all_reduces))


def _rows_then_columns(x):
    """Hand-written 2-D parallelism on 4 ranks: a sum over each row's group, then each column's."""
    rank = dist.get_rank()
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    y = x * (rank + 1)
    dist.all_reduce(y, group=rows[rank // 2])
    dist.all_reduce(y, group=columns[rank % 2])
    return y


def crossing_subgroups():
    x = torch.arange(3.0)
    expected = _rows_then_columns(x)
    return torch.equal(dtcompile.jit(_rows_then_columns)(x), expected)


def test_crossing_subgroups_agree_on_four_ranks(ranks4):
    # Each rank's row (and column) group has its own name: the ranks were told apart by it,
    # and every rank raised RankMismatchError.
    assert all(ranks4.run(crossing_subgroups))


def _sizes_exchanged(x):
    sent = [int((x[:, 0] > 0).sum().item()), x.shape[0] - int((x[:, 0] > 0).sum().item())]
    counts, received = torch.tensor(sent), torch.empty(2, dtype=torch.long)
    dist.all_to_all_single(received, counts)
    return sent, received.tolist()


def _exchanged_with_gradients(x, w):
    sent, received = _sizes_exchanged(x)
    out = x.new_empty(sum(received), x.shape[1])
    dist.all_to_all_single(out, x * w, received, sent)  # (c10d: no autograd, as in eager)
    return out.sum() + (x * w).sum(), out.requires_grad


def _exchanged_into_its_own_rows(x):
    """Each rank receives as many rows as it sends: the output's rows are fixed."""
    counts = torch.stack([(x[:, 0] > 0).sum(), (x[:, 0] <= 0).sum()])
    most = counts.clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    first = most[0].clamp(max=x.shape[0]).reshape(1)
    sent = torch.cat([first, x.shape[0] - first]) if dist.get_rank() == 0 else torch.cat([x.shape[0] - first, first])
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x * 2, received.tolist(), sent.tolist())
    return out


def _differentiable_exchange(x):
    import torch.distributed.nn.functional as differentiable

    sent, received = _sizes_exchanged(x.detach())
    out = x.new_empty(sum(received), x.shape[1])
    return differentiable.all_to_all_single(out, x * 2, received, sent) * 3


def _exchanged_into_rows_with_gaps(x):
    sent, received = _sizes_exchanged(x)
    wide = torch.zeros(sum(received), 2 * x.shape[1])
    dist.all_to_all_single(wide[:, ::2], x * 2, received, sent)
    return wide


def _exchanged_into_an_argument(x, out):
    dist.all_to_all_single(out, x * 1)  # (an argument and a tensor made in the call)
    dist.all_reduce_coalesced([out, x * 2])
    return out.sum()


def _all_reduce_of_a_leaf(x):
    dist.all_reduce(x)  # (eager: c10d ops have no autograd kernel, so a leaf is written as a plain tensor)
    return x * 2


def collectives_as_eager_runs_them():
    rank = dist.get_rank()
    for cache in ("constant values", "symbolic values"):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
        results = {}
        for name, fn in (
            ("eager", _exchanged_with_gradients),
            ("compiled", dtcompile.jit(_exchanged_with_gradients, cache=cache)),
        ):
            w = torch.tensor(2.0, requires_grad=True)
            loss, out_requires_grad = fn(x, w)
            loss.backward()
            results[name] = (loss.item(), out_requires_grad, w.grad.item())
        assert results["eager"] == results["compiled"], results
        assert_same(dtcompile.jit(_exchanged_into_its_own_rows, cache=cache)(x), _exchanged_into_its_own_rows(x))
        grads = []
        for fn in (_differentiable_exchange, dtcompile.jit(_differentiable_exchange, cache=cache)):
            leaf = x.clone().requires_grad_()
            out = fn(leaf)
            (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
            grads.append((out.detach(), leaf.grad))
        assert_same(grads[1], grads[0])
        with pytest.raises(dtcompile.TracingError, match="a view with gaps"):
            dtcompile.jit(_exchanged_into_rows_with_gaps, cache=cache)(x)
        outs = [torch.zeros(4, 3), torch.zeros(4, 3)]
        got = dtcompile.jit(_exchanged_into_an_argument, cache=cache)(x.clone(), outs[0])
        assert_same(got, _exchanged_into_an_argument(x.clone(), outs[1]))
        assert_same(outs[0], outs[1])
        leaves = [(torch.arange(4.0) + rank).requires_grad_() for _ in range(2)]
        for leaf, fn in zip(leaves, (_all_reduce_of_a_leaf, dtcompile.jit(_all_reduce_of_a_leaf, cache=cache))):
            fn(leaf).sum().backward()
        assert_same(leaves[0].detach(), leaves[1].detach())
        assert_same(leaves[0].grad, leaves[1].grad)
    return True


def test_collectives_as_eager_runs_them(ranks2):
    """Split sizes read from data with gradients on (no autograd through c10d's op, as in
    eager), into an output with gaps (refused), into an argument beside a tensor made in
    the call, and an all_reduce of a leaf that requires grad (eager writes it)."""
    assert all(ranks2.run(collectives_as_eager_runs_them))


class _KeepsTheFuture(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        work = dist.all_reduce(y, async_op=True)
        self.future = work.get_future()
        work.wait()
        return y


def _returns_the_future(x):
    return dist.all_reduce(x * 2, async_op=True).get_future()


def _waits_for_the_future(x):
    return dist.all_reduce(x * 2, async_op=True).get_future().wait()[0] + 1


def futures_of_collectives():
    model = _KeepsTheFuture()
    for cache in ("constant values", "symbolic values"):
        with pytest.raises(dtcompile.TracingError, match="the Future of a collective"):
            dtcompile.jit(_returns_the_future, cache=cache)(torch.ones(3))
        with pytest.raises(dtcompile.TracingError, match="the Future of a collective"):
            dtcompile.jit(model, cache=cache)(torch.ones(3))
        assert "future" not in vars(model)  # (no traced tensor kept)
        for x in (torch.ones(3), torch.arange(3.0)):
            assert_same(dtcompile.jit(_waits_for_the_future, cache=cache)(x), _waits_for_the_future(x))
    return True


def test_a_collectives_future_held_past_the_call_is_refused(ranks2):
    assert all(ranks2.run(futures_of_collectives))


def _summed_on_rank_0(x):
    a = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    b = funcol.all_reduce(x * 3, "sum", dist.group.WORLD)
    return a + b if dist.get_rank() == 0 else a * 1


def sums_of_all_reduces_on_one_rank():
    """Rank 0 sums two all-reduces, which its program reduces once where the combination is
    asked for (``all_reduce_sums.ENABLED``); rank 1 keeps both. Their forwards differ, also
    where forward and backward together run as many collectives on each rank: a clear error
    on every rank, not a hang. By default each is reduced as in eager: eager's results."""
    from dtcompile.transforms import all_reduce_sums

    for grad in (False, True):
        x = torch.ones(3, requires_grad=grad)
        if grad:  # (the backward's collectives differ, as eager's would: rank 1 differentiates one)
            with pytest.raises(dtcompile.RankMismatchError, match="different collectives"):
                dtcompile.jit(_summed_on_rank_0)(x)
        else:
            assert torch.equal(dtcompile.jit(_summed_on_rank_0)(x), _summed_on_rank_0(x))
        all_reduce_sums.ENABLED = True
        try:
            with pytest.raises(dtcompile.RankMismatchError, match="different collectives"):
                dtcompile.jit(_summed_on_rank_0)(x)
        finally:
            all_reduce_sums.ENABLED = False
    return True


def test_all_reduces_summed_on_one_rank_are_a_clear_error(ranks2):
    assert all(ranks2.run(sums_of_all_reduces_on_one_rank))


class _HoldsADataParallelBody(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))

    def forward(self, x):
        return self.body(x) * 2


def data_parallel_wrappers():
    """A DDP (or composable ``replicate``) module compiled: its forward's reducer set-up ran
    once, while tracing, so from the second call each rank kept its own gradients, silently.
    Refused; the module it wraps, compiled, under DDP, reduces them at every step as eager."""
    from torch.distributed._composable.replicate import replicate

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    targets = [
        (torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2)), "the module is wrapped"),
        (_HoldsADataParallelBody(), "the module \\(its 'body'\\)"),
        (replicate(torch.nn.Linear(3, 2)), "wrapped by replicate"),
        (lambda x: ddp(x).sum(), "a module the function calls"),
    ]
    for target, words in targets:
        with pytest.raises(dtcompile.TracingError, match=words):
            dtcompile.jit(target)(torch.ones(1, 3))
    torch.manual_seed(0)
    eager = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    torch.manual_seed(0)
    inner = torch.nn.Linear(3, 2)
    compiled = torch.nn.parallel.DistributedDataParallel(dtcompile.jit(inner))
    for step in range(3):
        x = torch.full((1, 3), float(dist.get_rank() + 1 + step))  # each rank its own data
        eager(x).sum().backward()
        compiled(x).sum().backward()
        assert_same(inner.weight.grad, eager.module.weight.grad)
        eager.zero_grad()
        compiled.zero_grad()
    return True


def test_data_parallel_wrappers_are_refused_and_the_wrapped_compiled_module_reduces(ranks2):
    assert all(ranks2.run(data_parallel_wrappers))


def _counts_its_calls_in_the_store(x):
    step = distributed_c10d._get_default_store().add("dtc_calls", 1)
    return x * step


def _makes_a_group_inside(x):
    y = x * 2
    dist.all_reduce(y, group=dist.new_group(list(range(dist.get_world_size()))))  # (torch's own store calls)
    return y


def store_calls():
    """A store's key-value calls ran once, while tracing: the counter stopped, and the
    program returned the first call's value at every call. Refused; torch's own go on."""
    store = distributed_c10d._get_default_store()
    with pytest.raises(dtcompile.TracingError, match="store's key-value exchange"):
        dtcompile.jit(_counts_its_calls_in_the_store)(torch.ones(2))
    assert store.add("dtc_calls", 0) == 0  # refused before it ran
    jitted = dtcompile.jit(_makes_a_group_inside)
    for _ in range(2):
        assert_same(jitted(torch.ones(2)), _makes_a_group_inside(torch.ones(2)))
    return True


def test_a_stores_calls_are_refused_and_torchs_own_go_on(ranks2):
    assert all(ranks2.run(store_calls))


def _scatter_of_column_major_pieces(x):
    out = torch.empty(2, 3)
    pieces = [c.t().contiguous().t() for c in x.chunk(dist.get_world_size())]  # gap-free, column-major
    dist.scatter(out, pieces if dist.get_rank() == 0 else None, src=0)
    return out


def _reduce_scatter_into_a_column_major_output(x):
    out = torch.empty(3, 2).t()
    dist.reduce_scatter(out, [c.contiguous() for c in x.chunk(dist.get_world_size())])
    return out


def layouts_gloo_takes_by_memory():
    """Gloo reads a scatter list's pieces and writes a list-form reduce_scatter's output in
    the order of their memory; the program took them in the order of their elements, so a
    column-major piece gave other values, silently. Refused, as the other list forms' are."""
    x = torch.arange(12.0).reshape(4, 3)
    for fn in (_scatter_of_column_major_pieces, _reduce_scatter_into_a_column_major_output):
        with pytest.raises((dtcompile.TracingError, dtcompile.RankFailedError), match="non-contiguous"):
            dtcompile.jit(fn)(x)
    dist.barrier()
    return True


def test_layouts_gloo_takes_by_memory_are_refused(ranks2):
    assert all(ranks2.run(layouts_gloo_takes_by_memory))
