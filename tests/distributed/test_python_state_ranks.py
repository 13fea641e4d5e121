"""Python values a program reads (globals, closure cells, module attributes, a config a
module holds) are guarded like arguments with DTensors on Gloo ranks: a change compiles a
new entry on every rank and gives eager DTensor's result."""

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from checks import assert_same
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtcompile
from dtcompile.testing.models import parallel_block

SCALE = 2.0


def _counts(jitted):
    return dtcompile.cache_misses(jitted), dtcompile.cache_hits(jitted)


def globals_and_cells_with_dtensors():
    global SCALE
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shift = 1.0

    def fn(x):
        y = (x * SCALE + shift).sum(0)  # a Partial sum: a collective
        return y.redistribute(mesh, [Replicate()])

    jitted = dtcompile.jit(fn)
    x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    try:
        with torch.no_grad():
            for scale, shift in ((2.0, 1.0), (2.0, 1.0), (3.0, 1.0), (3.0, -1.0), (2, 1.0), (2.0, 1.0)):
                SCALE = scale
                assert_same(jitted(x), fn(x), f"SCALE={scale!r} shift={shift}")
    finally:
        SCALE = 2.0
    return _counts(jitted)


def _relu(x):
    return torch.relu(x)


def _tanh(x):
    return torch.tanh(x)


ACTIVATION = _relu
WEIGHT = None  # a DTensor, set on each rank


def uses_a_global_dtensor_and_function(x):
    return ACTIVATION(x * WEIGHT).sum(0).redistribute(WEIGHT.device_mesh, [Replicate()])


def global_dtensor_and_function_rebound():
    global ACTIVATION, WEIGHT
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    jitted = dtcompile.jit(uses_a_global_dtensor_and_function)
    x = distribute_tensor(torch.linspace(-2, 2, 16).reshape(4, 4), mesh, [Shard(0)])
    try:
        with torch.no_grad():
            for activation, weight in ((_relu, 1.0), (_relu, 1.0), (_tanh, 1.0), (_tanh, -3.0), (_tanh, -3.0)):
                if WEIGHT is None or WEIGHT.full_tensor()[0, 0].item() != weight:
                    WEIGHT = distribute_tensor(torch.full((4, 4), weight), mesh, [Shard(0)])  # rebound
                ACTIVATION = activation
                expected = uses_a_global_dtensor_and_function(x)
                assert_same(jitted(x), expected, f"{activation.__name__} {weight}")
    finally:
        ACTIVATION, WEIGHT = _relu, None
    return _counts(jitted)


def test_a_global_dtensor_and_a_global_function_rebound(ranks2):
    assert ranks2.run(global_dtensor_and_function_rebound) == [(3, 2)] * 2


def test_globals_and_closure_cells_with_dtensors(ranks2):
    # (2.0, 1.0) twice, then three new pairs of values (2 is not 2.0), then (2.0, 1.0) again.
    assert ranks2.run(globals_and_cells_with_dtensors) == [(4, 2)] * 2


@dataclass
class Settings:
    scale: float = 1.0


class Scaled(torch.nn.Module):
    """A tensor-parallel block (plain tensors in and out, DTensor weights) whose output is scaled by its own attribute and its config's."""

    def __init__(self, block, settings: Settings):
        super().__init__()
        self.block = block
        self.settings = settings
        self.scale = 1.0
        self.residual = True

    def forward(self, x):
        y = self.block(x) * self.scale * self.settings.scale
        return y + x if self.residual else y


def module_attributes_with_dtensors():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Scaled(parallel_block(mesh, dim=16, n_heads=2, hidden=32), Settings())
    reference = copy.deepcopy(model)
    jitted = dtcompile.jit(model)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))  # the same on every rank
    changes = [
        lambda m: None,
        lambda m: setattr(m, "scale", 2.0),
        lambda m: setattr(m, "residual", False),
        lambda m: setattr(m.block.attn_norm, "eps", 0.5),
        lambda m: setattr(m.settings, "scale", 0.25),
    ]
    with torch.no_grad():
        for i, change in enumerate(changes):
            change(model)
            change(reference)
            for _ in range(2):
                assert_same(jitted(x), reference(x), f"change {i}")
    return _counts(jitted)


def test_module_attributes_with_dtensors(ranks2):
    assert ranks2.run(module_attributes_with_dtensors) == [(5, 5)] * 2


PLACEMENTS = None  # an OrderedDict of placement lists, set on each rank
WEIGHTS = None  # a list subclass holding a DTensor, set on each rank


class _Weights(list):
    pass


def redistributed_by_a_global_table(x):
    y = (x * WEIGHTS[0]).sum(0)  # a Partial sum
    return y.redistribute(WEIGHTS[0].device_mesh, PLACEMENTS["out"])


def containers_with_dtensors_changed_in_place():
    """An OrderedDict of placements and a list subclass holding a DTensor, both globals,
    changed in place (the objects themselves stay): each change is a new entry on every
    rank, with eager DTensor's result."""
    global PLACEMENTS, WEIGHTS
    import collections

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    PLACEMENTS = collections.OrderedDict(out=[Replicate()])
    WEIGHTS = _Weights([distribute_tensor(torch.full((4, 4), 2.0), mesh, [Shard(0)])])
    jitted = dtcompile.jit(redistributed_by_a_global_table)
    x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    changes = [
        lambda: None,
        lambda: PLACEMENTS["out"].__setitem__(0, Shard(0)),
        lambda: WEIGHTS.__setitem__(0, distribute_tensor(torch.full((4, 4), -1.0), mesh, [Shard(0)])),
    ]
    try:
        with torch.no_grad():
            for i, change in enumerate(changes):
                change()
                for _ in range(2):
                    got, expected = jitted(x), redistributed_by_a_global_table(x)
                    assert got.placements == expected.placements, f"change {i}"
                    assert_same(got, expected, f"change {i}")
    finally:
        PLACEMENTS = WEIGHTS = None
    return _counts(jitted)


def test_containers_with_dtensors_changed_in_place(ranks2):
    assert ranks2.run(containers_with_dtensors_changed_in_place) == [(3, 3)] * 2
