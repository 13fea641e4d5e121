"""A DTensor's local tensor returned from a compiled call, as eager returns it, on 2 ranks.

- ``w.to_local()`` of a DTensor parameter is a Tensor torch marks as a parameter
  (``isinstance(t, nn.Parameter)``), whose grad_fn reaches ``w``: it came back as a new
  ``nn.Parameter`` leaf, and its gradient never reached ``w``.
- ``x._local_tensor`` returned from a call with gradients came back as ``x`` itself."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import dtcompile

RETURNS = {
    "weight": lambda m, y: (y, m.up.weight.to_local()),
    "in a list": lambda m, y: [y, m.up.weight.to_local()],
    "in a dict": lambda m, y: {"y": y, "local": m.up.weight.to_local()},
    "bias": lambda m, y: (y, m.up.bias.to_local()),
    "with grad_placements": lambda m, y: (y, m.up.weight.to_local(grad_placements=[Shard(0)])),
}


class Up(nn.Module):
    def __init__(self, returns):
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.returns = returns

    def forward(self, x):
        return self.returns(self, self.up(x))


def _leaves(out):
    return list(out.values()) if isinstance(out, dict) else list(out)


def local_of_parameter(name, cache, grad):
    mesh = init_device_mesh("cpu", (2,))
    seen = []
    for compiled in (False, True):
        torch.manual_seed(0)
        module = parallelize_module(Up(RETURNS[name]), mesh, {"up": ColwiseParallel()})
        call = dtcompile.jit(module, cache=cache) if compiled else module
        for rows in (2, 3):
            x = torch.randn(rows, 4)
            with torch.set_grad_enabled(grad):
                y, local = _leaves(call(x))
            kind = (type(local).__name__, isinstance(local, nn.Parameter), local.grad_fn is None, local.requires_grad)
            if grad:
                (y.sum() + (local * local).sum()).backward()
            seen.append((kind, local.detach().clone(), y.detach().clone()))
        if grad:
            seen.append(tuple(p.grad.full_tensor() for p in module.parameters()))
    half = len(seen) // 2
    for eager, ours in zip(seen[:half], seen[half:]):
        for a, b in zip(eager, ours):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(b, a)
            else:
                assert b == a, (a, b)
    return seen[0][0]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
@pytest.mark.parametrize("name", list(RETURNS))
def test_to_local_of_a_dtensor_parameter(name, cache, grad, ranks2):
    kinds = ranks2.run(local_of_parameter, name, cache, grad)
    assert kinds[0] == kinds[1] and kinds[0][:2] == ("Tensor", True)  # eager's: a Tensor, taken for a Parameter


def local_tensor_attribute(cache):
    mesh = init_device_mesh("cpu", (2,))
    jitted = dtcompile.jit(lambda x: (x * 2, x._local_tensor), cache=cache)
    for rows in (4, 6):
        x = distribute_tensor(torch.randn(rows, 3), mesh, [Shard(0)]).requires_grad_()
        y, local = jitted(x)
        assert local is x._local_tensor, (type(local), local.shape)
        y.sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), torch.full((rows, 3), 2.0))
    return dist.get_rank()


@pytest.mark.parametrize("cache", ["constant values", "symbolic values"])
def test_a_dtensors_local_tensor_returned_with_gradients(cache, ranks2):
    assert ranks2.run(local_tensor_attribute, cache) == [0, 1]
