"""Generating an epilogue: the function that rebuilds the call's result.

The computation returns a flat tuple of local tensors. The epilogue wraps each DTensor
output with the spec DTensor's propagation gave it at trace time, through DTensor's own
constructor (no dispatch, no redistribution), and rebuilds the containers around them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..capture import (
    ConstantOutput,
    DictOutput,
    DTensorOutput,
    OutputNode,
    PytreeOutput,
    SequenceOutput,
    TensorOutput,
)
from ..core.codegen import GeneratedFunction
from ..core.printing import Unprintable, python_literal


def build_epilogue(output: OutputNode) -> GeneratedFunction:
    globals_: dict[str, object] = {"DTensor": DTensor, "torch": torch}
    statements: list[str] = []

    def constant(obj: object, prefix: str) -> str:
        try:
            return python_literal(obj)
        except Unprintable:
            name = f"{prefix}{len(globals_)}"
            globals_[name] = obj
            return name

    def expr(node: OutputNode) -> str:
        if isinstance(node, DTensorOutput):
            spec = constant(node.spec, "SPEC")
            for placement, slot in node.masks:
                # What DTensor's embedding does in eager: keep this call's mask for the reduction.
                statements.append(f"    {spec}.placements[{placement}].mask_buffer.materialize_mask(outs[{slot}])")
            return f"DTensor(outs[{node.index}], {spec}, requires_grad={node.requires_grad})"
        if isinstance(node, TensorOutput):
            return f"outs[{node.index}]"
        if isinstance(node, ConstantOutput):
            return constant(node.value, "CONST")
        if isinstance(node, SequenceOutput):
            inner = ", ".join(expr(c) for c in node.children)
            if node.type is list:
                return f"[{inner}]"
            return f"({inner}{',' if len(node.children) == 1 else ''})"
        if isinstance(node, DictOutput):
            return "{" + ", ".join(f"{k!r}: {expr(c)}" for k, c in zip(node.keys, node.children)) + "}"
        if isinstance(node, PytreeOutput):
            unflatten = constant(torch.utils._pytree.SUPPORTED_NODES[node.type].unflatten_fn, "UNFLATTEN")
            children = ", ".join(expr(c) for c in node.children)
            return f"{unflatten}([{children}], {constant(node.context, 'CONTEXT')})"
        raise TypeError(f"unknown output node {node!r}")

    result = expr(output)
    lines = ["def epilogue(outs):", *statements, f"    return {result}"]
    return GeneratedFunction("epilogue", lines, globals_, "epilogue: rebuilds the result from the local outputs")
