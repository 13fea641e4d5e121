"""A reference interpreter of traces: each symbol run as its own aten op (or prim) on real
values, one after another, with no code generation and no executor.

It answers "what does this trace compute?" independently of how the executors lower it,
so the tests compare the compiled program's results with it (``tests/test_passes.py``).
"""

from __future__ import annotations

import sympy
from torch.utils._pytree import tree_flatten, tree_map

from .block_call import BlockCall
from .prims import SHAPE, STORAGE_OFFSET, STRIDE, SizeExpression
from .printing import NamedConstant
from .proxy import is_proxy

_QUERIES = {
    SHAPE.name: lambda t, dim: t.shape[dim],
    STRIDE.name: lambda t, dim: t.stride(dim),
    STORAGE_OFFSET.name: lambda t: t.storage_offset(),
}


def interpret(trace, *inputs):
    """The trace's output for ``inputs`` (its inputs' values, in order)."""
    env = {proxy.label: value for proxy, value in zip(trace.inputs, inputs, strict=True)}

    def value(x):
        if is_proxy(x):
            return env[x.label]
        return x.value if isinstance(x, NamedConstant) else x

    for bsym in trace.bound_symbols:
        args, kwargs = tree_map(value, (bsym.args, bsym.kwargs))
        if bsym.op is not None:
            out = bsym.op(*args, **kwargs)
        elif bsym.symbol.name in _QUERIES:
            out = _QUERIES[bsym.symbol.name](*args)
        elif isinstance(bsym.symbol, BlockCall):
            out = interpret(bsym.symbol.block.trace, *args)
        elif isinstance(bsym.symbol, SizeExpression):
            result = bsym.symbol.expr.subs(dict(zip(bsym.symbol.symbols, args)))
            out = int(result) if result.is_integer else float(result) if isinstance(result, sympy.Expr) else result
        else:
            raise NotImplementedError(f"the interpreter cannot run {bsym.symbol.name}")
        for proxy, real in zip(tree_flatten(bsym.output)[0], tree_flatten(out)[0]):
            if is_proxy(proxy):
                env[proxy.label] = real
    return tree_map(value, trace.output)
