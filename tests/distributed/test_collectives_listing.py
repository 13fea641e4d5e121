"""``dtcompile.collectives(jm)``: the listed collectives are those the execution traces
run, and those eager sends.

Eager's collectives are recorded with a dispatch mode that sees every functional
collective (eager DTensor) and every c10d op (FSDP2's own all-gathers and
reduce-scatters), with the group each runs on and the bytes of the tensor each rank hands
it; the forward's and the backward's apart.
"""

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

import dtcompile
from dtcompile.testing.models import MLP, LlamaModel, parallel_mlp

DIM, HIDDEN = 16, 32
# c10d ops (what FSDP2 calls) by the functional collective they correspond to.
C10D = {"_allgather_base_": "all_gather_into_tensor", "_reduce_scatter_base_": "reduce_scatter_tensor"}
C10D.update({"allreduce_": "all_reduce"})


def _group_name(group) -> str:
    if isinstance(group, str):
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    return dist.ProcessGroup.unbox(group).group_name


class EagerCollectives(TorchDispatchMode):
    """Records ``(kind, group name, bytes handed in)`` for each collective eager runs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._opname
        # Not waits, nor the autograd wrapper of an async result (``_wrap_tensor_autograd``).
        if func.namespace == "_c10d_functional" and name != "wait_tensor" and not name.startswith("_"):
            source = args[0]
            self.calls.append((name, _group_name(args[-1]), source.numel() * source.element_size()))
        elif func.namespace == "c10d" and name in C10D:
            # _allgather_base_(output, input, group, ...), _reduce_scatter_base_(output, input, group, ...),
            # allreduce_([tensors], group, ...)
            if name == "allreduce_":
                source, group = args[0][0], args[1]
            else:
                source, group = args[1], args[2]
            self.calls.append((C10D[name], _group_name(group), source.numel() * source.element_size()))
        return func(*args, **kwargs)


def _listed(jitted, program: str) -> list:
    return [(c.kind, c.group, c.bytes) for c in dtcompile.collectives(jitted) if c.program == program]


def _in_trace(jitted) -> dict:
    """What the execution traces hold, read independently of the listing: each symbol
    whose op is a functional collective, with its group argument and its input's bytes."""
    found = {}
    for trace in dtcompile.last_traces(jitted):
        if trace.title.startswith("execution"):
            found[trace.fn_name] = [
                (b.op._opname, b.args[-1], b.args[0].numel() * b.args[0].element_size())
                for b in trace.bound_symbols
                if b.op is not None and b.op.namespace == "_c10d_functional" and b.op._opname != "wait_tensor"
            ]
    return found


def _eager_step(model, x) -> tuple[list, list]:
    with EagerCollectives() as forward:
        loss = model(x).pow(2).mean()
    with EagerCollectives() as backward:
        loss.backward()
    return forward.calls, backward.calls


def fsdp_mlp_collectives():
    """The FSDP2 MLP (``fully_shard`` on each linear, then the root) on a 2-rank dp mesh."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))

    def make():
        torch.manual_seed(0)
        model = MLP(DIM, HIDDEN)
        fully_shard(model.up, mesh=mesh)
        fully_shard(model.down, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    eager, compiled = make(), make()
    jitted = dtcompile.jit(compiled)
    x = torch.randn(4, 8, DIM)
    jitted(x).pow(2).mean().backward()
    eager_forward, eager_backward = _eager_step(eager, x)
    rows = dtcompile.collectives(jitted)
    return {
        "listed": {p: _listed(jitted, p) for p in ("forward", "backward")},
        "trace": _in_trace(jitted),
        "eager": {"forward": eager_forward, "backward": eager_backward},
        "dp_group": mesh.get_group().group_name,
        "mesh_dims": {c.mesh_dim for c in rows},
        "overlaps": [(c.program, c.kind, c.overlaps) for c in rows],
        "text": "\n".join(map(str, rows)),
    }


def test_fsdp_mlp_collectives_are_the_traces_and_eagers(ranks2):
    for result in ranks2.run(fsdp_mlp_collectives):
        listed, trace, eager, dp = result["listed"], result["trace"], result["eager"], result["dp_group"]
        assert listed == trace  # what the execution traces run, in their order
        assert result["mesh_dims"] == {"dp"}
        # Per kind and group, the bytes eager FSDP2 sends; the forward all-gathers the two
        # weights ([16, 16] and [8, 32] float32 shards), the backward reduce-scatters
        # their full gradients.
        weights = [HIDDEN * DIM // 2 * 4, DIM * HIDDEN // 2 * 4]
        assert sorted(b for k, g, b in listed["forward"] if k == "all_gather_into_tensor" and g == dp) == weights
        for program in ("forward", "backward"):
            for kind in ("all_gather_into_tensor", "reduce_scatter_tensor"):
                assert [g for k, g, _ in listed[program] if k == kind] == [dp] * sum(
                    1 for k, _, _ in listed[program] if k == kind
                )
        assert _totals(listed["forward"]) == _totals(eager["forward"])
        reduce_scatters = [c for c in listed["backward"] if c[0] == "reduce_scatter_tensor"]
        assert _totals(reduce_scatters) == _totals([c for c in eager["backward"] if c[0] == "reduce_scatter_tensor"])
        assert sorted(b for _, _, b in reduce_scatters) == sorted(2 * w for w in weights)
        # The backward all-gathers again what it needs (down's weight; up's is not needed,
        # x needs no gradient): a part of what eager FSDP2 gathers again.
        regathers = Counter(c for c in listed["backward"] if c[0] == "all_gather_into_tensor")
        assert regathers == Counter({("all_gather_into_tensor", dp, weights[1]): 1})
        assert not regathers - Counter(eager["backward"])
        # The second all-gather overlaps the first linear; the first reduce-scatter the rest
        # of the backward.
        assert ("forward", "all_gather_into_tensor", True) in result["overlaps"]
        assert ("backward", "reduce_scatter_tensor", True) in result["overlaps"]
        assert "reduce_scatter_tensor avg on dp" in result["text"]


def fsdp_llama_collectives():
    """The Llama model, ``fully_shard`` on each block and the root, bf16 parameters and
    fp32 reductions, on a 2-rank dp mesh: eager FSDP2's own bucketed collectives."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def make():
        torch.manual_seed(0)
        model = LlamaModel(64, DIM, layers=2, n_heads=4, hidden=HIDDEN)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)

    eager, compiled = make(), make()
    jitted = dtcompile.jit(compiled)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    jitted(tokens).float().pow(2).mean().backward()
    eager_forward, eager_backward = _eager_step(eager, tokens)
    return {
        "listed": {p: _listed(jitted, p) for p in ("forward", "backward")},
        "trace": _in_trace(jitted),
        "eager": {"forward": eager_forward, "backward": eager_backward},
        "dtypes": {(c.kind, c.dtype) for c in dtcompile.collectives(jitted)},
        "gather_order": _gather_order(dtcompile.last_traces(jitted)),
        "backward_order": _gather_order(
            dtcompile.last_traces(jitted), "backward", ("all_gather_into_tensor", "reduce_scatter_tensor")
        ),
        "overlaps": [c.overlaps for c in dtcompile.collectives(jitted) if c.kind == "all_gather_into_tensor"],
    }


def _gather_order(traces, fn_name: str = "forward", kinds=("all_gather_into_tensor",)) -> list:
    """The starts and waits of an execution trace's collectives of ``kinds``, in program
    order: ``("start", n)`` / ``("wait", n)`` for the n-th such collective (the backward:
    ``("gather" or "scatter", n)`` for a start)."""
    program = next(t for t in traces if t.title.startswith("execution") and t.fn_name == fn_name)
    order, number = [], {}
    for bsym in program.bound_symbols:
        name = bsym.op._opname if bsym.op is not None else ""
        if name in kinds:
            number[bsym.output[1].label] = len(number)
            start = (
                "start" if len(kinds) == 1 else name.split("_")[0].replace("all", "gather").replace("reduce", "scatter")
            )
            order.append((start, number[bsym.output[1].label]))
        elif name == "wait_tensor" and bsym.args[0].label in number:
            order.append(("wait", number[bsym.args[0].label]))
    return order


def test_fsdp_llama_collectives_are_eager_fsdp2s_buckets(ranks2):
    """One all-gather per FSDP group in bf16, one reduce-scatter per group in fp32, each
    of the bytes eager FSDP2's bucket has."""
    for result in ranks2.run(fsdp_llama_collectives):
        listed, eager = result["listed"], result["eager"]
        assert listed == result["trace"]
        gathers = [c for c in listed["forward"] if c[0] == "all_gather_into_tensor"]
        assert len(gathers) == 3  # the root (embedding, norm, head) and the two blocks
        assert Counter(gathers) == Counter(c for c in eager["forward"] if c[0] == "all_gather_into_tensor")
        reduce_scatters = [c for c in listed["backward"] if c[0] == "reduce_scatter_tensor"]
        assert len(reduce_scatters) == 3
        assert Counter(reduce_scatters) == Counter(c for c in eager["backward"] if c[0] == "reduce_scatter_tensor")
        regathers = Counter(c for c in listed["backward"] if c[0] == "all_gather_into_tensor")
        assert sum(regathers.values()) == 2 and not regathers - Counter(eager["backward"])
        # One group ahead, as FSDP2 prefetches: the next group's all-gather (with its
        # copy-in) starts before the current group's is waited and its compute runs; never
        # every unsharded parameter at once.
        assert result["gather_order"] == [
            ("start", 0),
            ("start", 1),
            ("wait", 0),
            ("start", 2),
            ("wait", 1),
            ("wait", 2),
        ]
        # The backward gathers the blocks again (the last block first), the next one ahead
        # as in the forward; each group's reduce-scatter starts when its gradients are
        # done and is waited at the end, running while the groups below compute.
        assert result["backward_order"] == [
            ("gather", 0),
            ("gather", 1),
            ("wait", 0),
            ("scatter", 2),
            ("wait", 1),
            ("scatter", 3),
            ("scatter", 4),
            ("wait", 2),
            ("wait", 3),
            ("wait", 4),
        ]
        assert result["dtypes"] == {
            ("all_gather_into_tensor", torch.bfloat16),
            ("reduce_scatter_tensor", torch.float32),
        }


def _totals(calls) -> Counter:
    totals = Counter()
    for kind, group, size in calls:
        totals[kind, group] += size
    return totals


def tp_mlp_collectives():
    """A tensor-parallel MLP on 2 ranks, its input requiring grad (an all-reduce each way)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    eager, compiled = parallel_mlp(mesh, dim=DIM, hidden=HIDDEN), parallel_mlp(mesh, dim=DIM, hidden=HIDDEN)
    jitted = dtcompile.jit(compiled)
    x = torch.randn(4, 8, DIM, requires_grad=True)
    jitted(x).pow(2).mean().backward()
    eager_forward, eager_backward = _eager_step(eager, x)
    rows = dtcompile.collectives(jitted)
    symbolic = dtcompile.jit(compiled, cache="symbolic values")
    with torch.no_grad():
        symbolic(torch.randn(4, 8, DIM))
    return {
        "listed": {p: _listed(jitted, p) for p in ("forward", "backward")},
        "trace": _in_trace(jitted),
        "eager": {"forward": eager_forward, "backward": eager_backward},
        "tp_group": mesh.get_group().group_name,
        "symbolic": [(c.program, c.kind, c.bytes, c.symbolic) for c in dtcompile.collectives(symbolic)],
        "rows": [(c.program, c.kind, c.mesh_dim, c.reduce_op, c.output_bytes, c.symbolic) for c in rows],
    }


def test_tp_mlp_collectives_are_the_traces_and_eagers(ranks2):
    for result in ranks2.run(tp_mlp_collectives):
        tp, size = result["tp_group"], 4 * 8 * DIM * 4
        assert result["listed"] == result["trace"]
        assert result["listed"] == result["eager"]  # the same calls, in the same order, as eager DTensor's
        assert result["listed"]["forward"] == [("all_reduce", tp, size)]
        assert result["listed"]["backward"] == [("all_reduce", tp, size)]
        assert result["rows"] == [
            ("forward", "all_reduce", "tp", "sum", size, False),
            ("backward", "all_reduce", "tp", "sum", size, False),
        ]
        # Under symbolic values the bytes are an expression of the sizes' symbols.
        [(program, kind, size_expression, symbolic)] = result["symbolic"]
        assert (program, kind, symbolic) == ("computation", "all_reduce", True)
        assert isinstance(size_expression, str) and "s" in size_expression, size_expression
