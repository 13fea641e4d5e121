"""In-place functional collectives (``torch.ops._c10d_functional.all_reduce_(x, ...)``,
``broadcast_``, the ``out=`` gathers, what Inductor's programs and ``funcol``'s in-place
helpers call) write their tensor until its ``wait_tensor``: reads of that memory, under
any name, stay after the wait and before the start, as eager ordered them. The collective
scheduler once moved a wait below a read of the input it wrote (the read saw the unreduced
values, with no error)."""

import torch
import torch.distributed as dist
from checks import assert_same

import dtcompile

c10d = torch.ops._c10d_functional


def _group() -> str:
    return dist.group.WORLD.group_name


def read_after_the_wait(x):
    c10d.all_reduce_(x, "sum", _group())
    c10d.wait_tensor(x)
    return x * 1


def read_through_an_earlier_view(x):
    row = x[0]
    c10d.all_reduce_(x, "sum", _group())
    c10d.wait_tensor(x)
    return row * 2


def read_before_the_start(x):
    before = x * 2
    c10d.all_reduce_(x, "max", _group())
    c10d.wait_tensor(x)
    return before, x + 0


def an_intermediate_and_its_view(x):
    y = x * 2
    tail = y[1:]
    c10d.all_reduce_(y, "sum", _group())
    c10d.wait_tensor(y)
    return tail + 1, y


def broadcast_from_last(x):
    y = x.sin()
    c10d.broadcast_(y, dist.get_world_size() - 1, _group())
    c10d.wait_tensor(y)
    return y * 3


def gathered_into_a_buffer(x):
    n = dist.get_world_size()
    out = torch.zeros(x.shape[0] * n, *x.shape[1:])
    head = out[:1]
    c10d.all_gather_into_tensor_out(x + 1, n, _group(), out=out)
    c10d.wait_tensor(out)
    return head * 1, out.sum(0)


def reduce_scattered_into_a_buffer(x):
    n = dist.get_world_size()
    out = torch.zeros(x.shape[0] // n, *x.shape[1:])
    c10d.reduce_scatter_tensor_out(x * 2, "sum", n, _group(), out=out)
    c10d.wait_tensor(out)
    return out + 1


def coalesced(x):
    a, b = x * 1, x * 2
    c10d.all_reduce_coalesced_([a, b], "sum", _group())
    c10d.wait_tensor(a)
    c10d.wait_tensor(b)
    return a + b


FUNCTIONS = [
    read_after_the_wait,
    read_through_an_earlier_view,
    read_before_the_start,
    an_intermediate_and_its_view,
    broadcast_from_last,
    gathered_into_a_buffer,
    reduce_scattered_into_a_buffer,
    coalesced,
]


def in_place_collectives_equal_eager(cache):
    rank, n = dist.get_rank(), dist.get_world_size()
    for fn in FUNCTIONS:
        jitted = dtcompile.jit(fn, cache=cache)
        for call in range(3):
            x = torch.arange(4.0 * n).reshape(2 * n, 2) * (rank + 1) + call
            got_x, expected_x = x.clone(), x.clone()
            assert_same(jitted(got_x), fn(expected_x), f"{fn.__name__}, call {call}")
            assert_same(got_x, expected_x, f"{fn.__name__}: the argument after call {call}")
    return True


def test_in_place_functional_collectives_equal_eager(ranks2):
    for cache in ("constant values", "symbolic values"):
        assert ranks2.run(in_place_collectives_equal_eager, cache) == [True, True]
