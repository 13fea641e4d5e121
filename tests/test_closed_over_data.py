"""Numbers the traced code reads from the data of a tensor it closes over (a global, a
closure's, one an object or container it reaches holds): that tensor may be refilled
between calls, so each is read at every call (or guarded, as an argument's are), never the
value it had while tracing. A literal's (``torch.tensor([2., 5.])``) values are the code's,
known while tracing."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from support import forget_dtensor_caches
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtcompile

CACHES = ["constant values", "symbolic values"]

READS = {
    "item": lambda x, t: x * t[0].item(),
    "float": lambda x, t: x * float(t[0]),
    "int": lambda x, t: x * int(t[0]),
    "branch": lambda x, t: x + 1 if t[1] > 1.5 else x - 1,
    "bool": lambda x, t: x + 1 if bool((t > 2.5).any()) else x - 1,
    "tolist": lambda x, t: x * t.tolist()[0],
    "computed": lambda x, t: x * (t * 2).sum().item(),
    "length": lambda x, t: x[: int(t.max())],
    "whole": lambda x, t: x * t.sum().item(),
}


class Holder:
    def __init__(self, tensor):
        self.tensor = tensor


GLOBAL = torch.zeros(2)
AS_LIST = [torch.zeros(2)]
AS_DICT = {"t": torch.zeros(2)}
HOLDER = Holder(torch.zeros(2))


def _held(where: str):
    """A function of x reading the tensor held ``where``, and that tensor."""
    if where == "global":
        return (lambda read: lambda x: read(x, GLOBAL)), GLOBAL
    if where == "list":
        return (lambda read: lambda x: read(x, AS_LIST[0])), AS_LIST[0]
    if where == "dict":
        return (lambda read: lambda x: read(x, AS_DICT["t"])), AS_DICT["t"]
    if where == "object":
        return (lambda read: lambda x: read(x, HOLDER.tensor)), HOLDER.tensor
    cell = torch.zeros(2)
    return (lambda read: lambda x: read(x, cell)), cell


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("where", ["global", "closure", "list", "dict", "object"])
@pytest.mark.parametrize("read", sorted(READS))
def test_a_number_read_from_a_closed_over_tensor_follows_its_changes(read, where, cache):
    make, tensor = _held(where)
    fn = make(READS[read])
    compiled = dtcompile.jit(fn, cache=cache)
    x = torch.arange(4.0)
    for values in ([2.0, 1.0], [3.0, 2.0], [2.0, 1.0], [1.0, 3.0]):
        tensor.copy_(torch.tensor(values))
        expected = fn(x)
        got = compiled(x)
        assert got.shape == expected.shape and torch.equal(got, expected), (values, got, expected)


def test_module_holding_an_object_with_a_tensor():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Holder(torch.tensor([2.0]))

        def forward(self, x):
            return x * self.config.tensor.item()

    model = Scaled()
    compiled = dtcompile.jit(model)
    x = torch.ones(3)
    assert torch.equal(compiled(x), x * 2)
    model.config.tensor.fill_(5.0)
    assert torch.equal(compiled(x), model(x))
    assert dtcompile.cache_misses(compiled) == 1  # (read at run time)


def test_grad_scaler_scale_read_inside():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # (makes its scale tensor)

    def scaled(x):
        return x * scaler.get_scale()

    compiled = dtcompile.jit(scaled)
    x = torch.ones(2)
    assert torch.equal(compiled(x), scaled(x))
    scaler.update(8.0)
    assert torch.equal(compiled(x), scaled(x))
    assert compiled(x)[0].item() == 8.0


@pytest.mark.parametrize("reader", ["numpy", "asarray"])
def test_numpy_of_a_closed_over_tensor_is_refused(reader):
    # Under tracing's dispatch mode it read the memory of a stand-in: a wrong value at the
    # first call. As for an argument, it is refused.
    held = torch.tensor([2.0, 1.0])

    def fn(x):
        data = held.numpy() if reader == "numpy" else np.asarray(held)
        return x * float(data[0])

    with pytest.raises(dtcompile.TracingError, match="numpy|__array__"):
        dtcompile.jit(fn)(torch.ones(2))


@pytest.mark.parametrize("cache", CACHES)
def test_literals_are_read_while_tracing(cache):
    def fn():
        n = torch.tensor(3).item()
        return torch.ones(n) * torch.tensor([2.0, 5.0]).tolist()[1]

    compiled = dtcompile.jit(fn, cache=cache)
    for _ in range(2):
        assert torch.equal(compiled(), fn())
    assert dtcompile.cache_misses(compiled) == 1


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()
        forget_dtensor_caches()  # (a later fake world's equal mesh would get this one's groups)


DTENSOR_READS = {
    "local item": lambda x, w: x * w.to_local()[0].item(),
    "item": lambda x, w: x * w[0].item(),
    "local tolist": lambda x, w: x * w.to_local().tolist()[0],
    "float": lambda x, w: x * float(w.to_local()[0]),
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("placement", ["replicate", "shard"])
@pytest.mark.parametrize("read", sorted(DTENSOR_READS))
def test_a_number_read_from_a_closed_over_dtensor(mesh, read, placement, cache):
    held = distribute_tensor(torch.arange(4.0) + 1, mesh, [Replicate() if placement == "replicate" else Shard(0)])

    def fn(x):
        return DTENSOR_READS[read](x, held)

    compiled = dtcompile.jit(fn, cache=cache)
    x = torch.arange(3.0)
    for value in (2.0, 3.0, 2.0):
        held.to_local().fill_(value)
        assert torch.equal(compiled(x), fn(x))


class _CountingBuffer(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.register_buffer("seen", distribute_tensor(torch.zeros(4), mesh, [Replicate()]))

    def forward(self, x):
        self.seen.add_(1)
        self.seen.mul_(1)
        return x * 2


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("how", ["argument", "closed over", "module buffer"])
def test_a_dtensor_written_in_place_counts_the_writes_as_eager(mesh, how, cache):
    # Its version stayed where it was (the program writes the local tensor): an eager graph
    # that had saved it ran its backward with the new values, where eager's raises.
    def make():
        return distribute_tensor(torch.arange(4.0) + 1, mesh, [Replicate()])

    if how == "module buffer":
        eager, compiled = _CountingBuffer(mesh), _CountingBuffer(mesh)
        eager(torch.ones(2))
        dtcompile.jit(compiled, cache=cache)(torch.ones(2))
        assert compiled.seen._version == eager.seen._version
        return
    versions = []
    for jitted in (False, True):
        a = make()
        held = torch.nn.Parameter(make())

        def update(x, held=held):
            (held if how == "closed over" else x).mul_(2)

        w = torch.nn.Parameter(make())
        target = held if how == "closed over" else a
        loss = (target * w).to_local().sum()  # saves target for its backward
        with torch.no_grad():
            (dtcompile.jit(update, cache=cache) if jitted else update)(a)
        versions.append(target._version)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    assert versions[0] == versions[1]
