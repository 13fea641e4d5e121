"""Collectives on buffers laid out otherwise than row-major, on 2 Gloo ranks, against eager.

Gloo reads and writes a dense buffer in the order of its memory, whatever its strides, and
the strides may differ between ranks. The program must run the same collectives on every
rank (an all_reduce of a transposed tensor on one rank only was lowered as another
collective there: both ranks hung until the process group's timeout), and give what eager
gives (a scatter into a transposed output was filled in logical order)."""

import pytest
import torch
import torch.distributed as dist
from checks import assert_same
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

import dtcompile


def _column_major_on_rank_0(x):
    return x.t().contiguous().t() if dist.get_rank() == 0 else x


def _partial_to_replicate(x):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    d = DTensor.from_local(x * 2, mesh, [Partial()])
    return d.redistribute(mesh, [Replicate()]).to_local() + 1


def _all_reduce_in_place(x):
    y = x * 2
    dist.all_reduce(y)
    return y


def _all_reduce_of_a_transpose(x):
    y = (x * 2).t()
    dist.all_reduce(y)
    return y + 1


def _broadcast_from_1(x):
    y = x + 0
    dist.broadcast(y, src=1)
    return y


def _scatter_into_a_transpose(x):
    out = torch.zeros(2, 2).t()
    dist.scatter(out, [x[:2] + 1, x[2:4] + 1] if dist.get_rank() == 0 else None, src=0)
    return out


def _all_gather_of_a_transpose(x):
    out = torch.empty(4, 2)
    dist.all_gather_into_tensor(out, (x[:2] * 3).t().contiguous().t())
    return out


CASES = {
    "a Partial DTensor redistributed": (_partial_to_replicate, _column_major_on_rank_0),
    "all_reduce in place": (_all_reduce_in_place, _column_major_on_rank_0),
    "all_reduce of a transpose on every rank": (_all_reduce_of_a_transpose, lambda x: x),
    "broadcast": (_broadcast_from_1, _column_major_on_rank_0),
    "scatter into a transpose": (_scatter_into_a_transpose, lambda x: x),
    "all_gather of a transpose": (_all_gather_of_a_transpose, lambda x: x),
}


def layouts_equal_eager(case: str, cache: str):
    fn, layout = CASES[case]
    jitted = dtcompile.jit(fn, cache=cache)
    for call in range(3):
        x = layout(torch.arange(8.0).reshape(4, 2) * (dist.get_rank() + 1) + call)
        got_x, expected_x = x.clone(memory_format=torch.preserve_format), x.clone(memory_format=torch.preserve_format)
        with torch.no_grad():
            assert_same(jitted(got_x), fn(expected_x), f"{case}, call {call}")
    return True


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("case", list(CASES))
def test_buffers_laid_out_otherwise_equal_eager(ranks2, case, cache):
    assert ranks2.run(layouts_equal_eager, case, cache, timeout=120) == [True, True]


def _reduce_scatter_with_a_transposed_piece(x):
    out = torch.empty(2, 2)
    dist.reduce_scatter(out, [(x[:2] * 1).t().contiguous().t(), x[2:] * 1])
    return out


def _reduce_scatter_of_pieces_of_other_shapes(x):
    out = torch.empty(2, 2)
    dist.reduce_scatter(out, [x[:1] * 1, x[1:] * 1])
    return out


def _all_to_all_single_into_other_rows(x):
    out = torch.empty(2, 4)
    dist.all_to_all_single(out, x * 1)
    return out


def _all_to_all_of_other_shapes(x):
    outs = [torch.empty(4), torch.empty(4)]
    dist.all_to_all(outs, [x[:2] * 1, x[2:] * 1])
    return torch.cat(outs)


REFUSED = {
    # Gloo's own copy of a transposed piece into its buffer: a layout of its own.
    "a transposed piece of reduce_scatter's list": (_reduce_scatter_with_a_transposed_piece, dtcompile.TracingError),
    # Eager's Gloo refuses these buffers (a failed check), the program the same way.
    "reduce_scatter's pieces of other shapes": (_reduce_scatter_of_pieces_of_other_shapes, RuntimeError),
    "all_to_all's tensors of other shapes": (_all_to_all_of_other_shapes, RuntimeError),
    # Eager exchanges the flat memory: not recorded, and said so.
    "all_to_all_single into rows of another shape": (_all_to_all_single_into_other_rows, dtcompile.TracingError),
}


def refused(case: str):
    fn, error = REFUSED[case]
    try:
        with torch.no_grad():
            dtcompile.jit(fn)(torch.arange(8.0).reshape(4, 2))
    except error as raised:
        return type(raised).__name__, "dist." in str(raised)
    return "ran", False


@pytest.mark.parametrize("case", list(REFUSED))
def test_buffers_the_program_cannot_fill_as_gloo_are_refused_naming_the_call(ranks2, case):
    """(These ran, and returned values where eager's Gloo raised or filled another layout.)"""
    kind = REFUSED[case][1].__name__
    assert ranks2.run(refused, case, timeout=120) == [(kind, True), (kind, True)]
