"""Code that runs in the backward of a training call over a TP model (a checkpoint's
recompute, a tensor hook) reads the module's DTensor parameters as the forward did: the
program's inputs, current at each step, never values computed while tracing. And a DTensor
parameter changed in place between the call and its backward gives autograd's error, as
eager's saved DTensor does."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

import dtcompile

CACHES = ["constant values", "symbolic values"]


class _Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.up, self.down, self.kind = nn.Linear(8, 16), nn.Linear(16, 8), kind

    def forward(self, x):
        if self.kind == "autocast":  # bf16 casts of the weights, made in the recompute too
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.down(F.gelu(self.up(x))).float()
        if self.kind == "weight op":  # an op on a DTensor weight, recomputed in the backward
            xd = DTensor.from_local(x, self.up.weight.device_mesh, [Replicate()])
            return self.down(F.gelu(F.linear(xd, self.up.weight * 0.5, self.up.bias)))
        h = self.up(x)  # "hook": a parameter read in the backward by a tensor hook
        h.register_hook(lambda g: g * self.gate)
        return self.down(F.gelu(h))


class _Net(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.block, self.kind = _Block(kind), kind

    def forward(self, x):
        if self.kind == "hook":
            return x + self.block(x)
        return x + checkpoint(self.block, x, use_reentrant=False)


def steps_of_a_model_whose_backward_reads_its_parameters(kind: str, cache: str):
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    plan = {"up": ColwiseParallel(use_local_output=kind != "hook"), "down": RowwiseParallel()}
    base = _Net(kind)
    parallelize_module(base.block, mesh, plan)
    if kind == "hook":
        base.block.gate = nn.Parameter(distribute_tensor(torch.linspace(0.5, 1.5, 16), mesh, [Shard(0)]))
    results = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        run = dtcompile.jit(model, cache=cache) if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for step in range(3):  # cached calls after optimizer steps read the new weights
            torch.manual_seed(step)
            run(torch.randn(4, 8)).pow(2).sum().backward()
            grads.append([p.grad if p.grad is None else p.grad.full_tensor().clone() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
        results.append(grads)
    return [all(_same(a, b) for a, b in zip(e, c)) for e, c in zip(*results)]


def _same(a, b) -> bool:
    return a is b if a is None or b is None else torch.equal(a, b)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", ["autocast", "weight op", "hook"])
def test_a_backward_reading_the_modules_dtensor_parameters(ranks2, kind, cache):
    for same in ranks2.run(steps_of_a_model_whose_backward_reads_its_parameters, kind, cache):
        assert same == [True, True, True]


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def a_parameter_changed_before_the_backward(cache: str):
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base = parallelize_module(_MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    outcomes = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        loss = (dtcompile.jit(model, cache=cache) if compiled else model)(torch.randn(4, 8)).pow(2).sum()
        with torch.no_grad():
            model.down.weight.mul_(2)  # an optimizer step before the backward
        try:
            loss.backward()
            outcomes.append("ran")
        except RuntimeError as error:
            outcomes.append(str(error)[:80])
    return outcomes


@pytest.mark.parametrize("cache", CACHES)
def test_a_dtensor_parameter_changed_before_the_backward_is_autograds_error(ranks2, cache):
    for eager, compiled in ranks2.run(a_parameter_changed_before_the_backward, cache):
        assert eager.startswith("one of the variables needed for gradient computation has been modified")
        assert compiled == eager


def a_plain_loss_plus_a_dtensor_term(cache: str):
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = parallelize_module(_MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def step(x, y):  # a user's error: eager's backward of mse_loss meets a DTensor gradient
        return F.mse_loss(model(x), y) + 0.01 * (model.up.weight * model.up.weight).sum()

    outcomes = []
    for run in (step, dtcompile.jit(step, cache=cache)):
        try:
            run(torch.randn(4, 8), torch.randn(4, 8)).backward()
            outcomes.append("ran")
        except RuntimeError as error:
            outcomes.append("mixed" if "got mixed torch.Tensor and DTensor" in str(error) else str(error))
    return outcomes


@pytest.mark.parametrize("cache", CACHES)
def test_a_plain_tensor_among_dtensors_in_the_backward_is_dtensors_error(ranks2, cache):
    for outcomes in ranks2.run(a_plain_loss_plus_a_dtensor_term, cache):
        assert outcomes == ["mixed", "mixed"]
