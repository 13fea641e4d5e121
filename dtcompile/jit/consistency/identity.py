"""What names one compilation alike on every rank, and what of the call must agree.

The key of a compilation comes from the compiled code (its module, qualified name and
first line), not from the order of ``jit`` calls, and counts the compilations of that code
in this process: ranks that compile the same functions in the same order agree on it,
whatever else each rank jits or calls. It never depends on what the ranks compare (their
inputs, their programs), so ranks that differ in those still meet and see the difference.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import torch
from torch.distributed.tensor import DTensor

_compilations: Counter[str] = Counter()  # compilations checked so far, by code identity


def code_identity(fn, module: torch.nn.Module | None) -> str:
    """A short, rank-independent name of the code ``fn`` (or ``module``'s forward) runs.
    File paths are left out: ranks on different hosts may install the code elsewhere."""
    target = type(module).forward if module is not None else fn
    target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None)
    owner = type(module) if module is not None else target
    name = f"{getattr(owner, '__module__', '?')}.{getattr(owner, '__qualname__', type(owner).__qualname__)}"
    if code is not None:
        name += f":{code.co_name}:{code.co_firstlineno}"
    return name


def next_compilation_key(identity: str) -> str:
    """The store key of this process's next checked compilation of ``identity``."""
    _compilations[identity] += 1
    digest = hashlib.sha1(identity.encode()).hexdigest()[:16]
    return f"dtcompile/{digest}/{_compilations[identity]}"


def peek_compilation_key(identity: str) -> str:
    """The key the next compilation of ``identity`` would use, without taking it."""
    digest = hashlib.sha1(identity.encode()).hexdigest()[:16]
    return f"dtcompile/{digest}/{_compilations[identity] + 1}"


def _placements(dtensor: DTensor) -> str:
    return "(" + ", ".join(str(p) for p in dtensor.placements) + ")"


def _walk(value, path: str, out: list[str], seen: set[int]) -> None:
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        names = f" {list(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
        out.append(
            f"{path}: DTensor {str(value.dtype).removeprefix('torch.')} global shape {list(value.shape)} "
            f"placements {_placements(value)} on a mesh of shape {list(mesh.shape)}{names}"
        )
    elif isinstance(value, (list, tuple)) and id(value) not in seen:
        seen.add(id(value))
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", out, seen)
    elif isinstance(value, dict) and id(value) not in seen:
        seen.add(id(value))
        for key, item in value.items():
            _walk(item, f"{path}[{key!r}]", out, seen)


def input_signature(args: tuple, kwargs: dict, module: torch.nn.Module | None) -> list[str]:
    """The rank-independent metadata of the call's DTensors, one line each, with its path
    (``args[0]``): global shape, dtype, placements and mesh shape, which must be equal on
    every rank for DTensor's collectives to match. Local sizes (uneven shards) and plain
    tensors, which ranks may hold differently, are left out."""
    out: list[str] = []
    seen: set[int] = set()
    _walk(args, "args", out, seen)
    _walk(kwargs, "kwargs", out, seen)
    if module is not None:
        for kind, named in (("params", module.named_parameters()), ("buffers", module.named_buffers())):
            for name, tensor in named:
                _walk(tensor, f"{kind}[{name!r}]", out, seen)
    return out
