"""A process group and a reduce op passed to the compiled function (as arguments, or held
by an object argument) are inputs guarded as what they are: another op or group at a
later call is another compilation. They were refused as unsupported inputs, where eager
runs."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from checks import assert_same

import dtcompile


def reduce_with(x, group, op):
    y = x * 2
    dist.all_reduce(y, op=op, group=group)
    return y


@dataclass
class Settings:
    group: object
    op: object
    scale: float


def reduce_as_settings_say(x, settings):
    y = x * settings.scale
    dist.all_reduce(y, op=settings.op, group=settings.group)
    return y


def group_and_op_arguments():
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    jitted, held = dtcompile.jit(reduce_with), dtcompile.jit(reduce_as_settings_say)
    calls = [
        (dist.group.WORLD, dist.ReduceOp.MAX),
        (dist.group.WORLD, dist.ReduceOp.MIN),
        (pair, dist.ReduceOp.SUM),
        (dist.group.WORLD, dist.ReduceOp.MAX),
        (pair, dist.ReduceOp.PRODUCT),
    ]
    for call, (group, op) in enumerate(calls):
        x = torch.arange(3.0) * (rank + 1) - call
        assert_same(jitted(x, group, op), reduce_with(x, group, op), f"call {call}: {op}")
        settings = Settings(group, op, 0.5 + call)
        assert_same(held(x, settings), reduce_as_settings_say(x, settings), f"call {call}, held: {op}")
    assert dtcompile.cache_misses(jitted) == 4  # (the fourth call is the first's)
    return True


def test_group_and_op_arguments_equal_eager(ranks2):
    assert ranks2.run(group_and_op_arguments) == [True, True]
