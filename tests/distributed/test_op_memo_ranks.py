"""Calls recorded again (``capture/op_memo.py``) with DTensors on Gloo ranks: tensor-parallel
layers that pick their cache entry by their index and update it in place (as a Hugging
Face decoder layer does) are traced one by one, their calls recorded again from the first
layer's. Every stage's program must be the one dispatching every call gives, and every
result (outputs, cache contents) eager's; embeddings whose placements hold a mask too."""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from checks import assert_same, data
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtcompile
from dtcompile.capture import op_memo


class _Layer(nn.Module):
    def __init__(self, index: int, dim: int = 8):
        super().__init__()
        self.index = index
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, cache, position):
        h = self.up(x)  # sharded on its last dim
        quarter = h.shape[-1] // 4
        h = h * 0.5 + torch.cat((-h[..., quarter:], h[..., :quarter]), dim=-1) * 0.25
        keys = cache[self.index]
        keys.index_copy_(1, position, h)
        return x + self.down(F.silu(keys[:, : position.shape[0]]))


class _Model(nn.Module):
    def __init__(self, mesh, layers: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Layer(i) for i in range(layers))
        for layer in self.layers:
            plan = {
                "up": ColwiseParallel(use_local_output=False),
                "down": RowwiseParallel(input_layouts=Shard(-1), use_local_output=False),
            }
            parallelize_module(layer, mesh, plan)

    def forward(self, x, cache, position):
        for layer in self.layers:
            x = layer(x, cache, position)
        return x


def _cache(mesh, layers: int = 4):
    return [distribute_tensor(torch.zeros(2, 8, 16), mesh, [Shard(2)]) for _ in range(layers)]


def indexed_layers(cache_option: str):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _Model(mesh)
    traces, caches = [], []
    for memo in (True, False):
        saved, op_memo.ENABLED = op_memo.ENABLED, memo
        try:
            jitted = dtcompile.jit(model, cache=cache_option)
            compiled_cache, eager_cache = _cache(mesh), _cache(mesh)
            with torch.no_grad():
                for length, start in ((3, 0), (1, 3), (2, 4)):
                    x = distribute_tensor(data(2, length, 8, seed=start), mesh, [Replicate()])
                    position = distribute_tensor(torch.arange(start, start + length), mesh, [Replicate()])
                    assert_same(jitted(x, compiled_cache, position), model(x, eager_cache, position))
        finally:
            op_memo.ENABLED = saved
        for got, expected in zip(compiled_cache, eager_cache):
            assert_same(got, expected)
        traces.append("\n".join(map(str, dtcompile.last_traces(jitted))))
        caches.append(dtcompile.cache_misses(jitted))
    assert traces[0] == traces[1]  # the last compilation's every stage
    return caches[0]


def test_indexed_layers_constant_values(ranks2):
    assert ranks2.run(indexed_layers, "constant values") == [3, 3]


def test_indexed_layers_symbolic_values(ranks2):
    assert ranks2.run(indexed_layers, "symbolic values") == [2, 2]  # one length of 1, one for the others


class _Twice(nn.Module):
    """A row-parallel embedding looked up twice in one call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(8, 4)

    def forward(self, first, second):
        return self.embedding(first) * 10 + self.embedding(second)


def embeddings_with_masks():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weight = distribute_tensor(data(8, 4, seed=1), mesh, [Shard(0)])

    def lookups(w, first, second):  # each lookup's mask, reduced before the next lookup
        a = F.embedding(first, w).redistribute(mesh, [Replicate()])
        b = F.embedding(second, w).redistribute(mesh, [Replicate()])
        return a * 10 + b

    model = _Twice()
    model.embedding = parallelize_module(model.embedding, mesh, RowwiseParallel(input_layouts=Replicate()))
    eager_model = copy.deepcopy(model)

    for cache_option in ("constant values", "symbolic values"):
        jitted, jitted_twice = dtcompile.jit(lookups, cache=cache_option), dtcompile.jit(model, cache=cache_option)
        with torch.no_grad():
            for seed in (0, 1):
                ids = torch.randint(0, 8, (2, 3), generator=torch.Generator().manual_seed(seed))
                first, second = (distribute_tensor(i, mesh, [Replicate()]) for i in (ids, 7 - ids))
                assert_same(jitted(weight, first, second), lookups(weight, first, second))
                assert_same(jitted_twice(ids, 7 - ids), eager_model(ids, 7 - ids))
    return True


def test_embeddings_whose_placements_hold_masks(ranks2):
    assert ranks2.run(embeddings_with_masks) == [True, True]
