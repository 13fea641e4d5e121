"""Linear layers as one call again.

``F.linear`` reaches DTensor already decomposed: ``t(w)``, ``view(x, [M, K])``,
``mm`` (``addmm`` with a bias) and ``view`` back. Four calls from Python where
``aten.linear`` is one, and runs the very same kernels on the very same operands
(``aten::linear`` folds a contiguous input into ``[M, K]`` and calls ``mm``, or ``addmm``
for a 2-D or 3-D contiguous input with a bias), so the values and strides are eager's.
The pieces left unused are dropped by dead-code elimination.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._pytree import tree_flatten

from ..core import BoundSymbol, NoProvenance, TensorProxy, Trace, aten_symbol, is_proxy, renamed
from ..core.op_classes import RESHAPES, is_row_major
from ..core.proxy import contiguous_strides
from ..core.symbolic import known_equal, known_shape_equal

aten = torch.ops.aten


def _operands(bsym, producers: dict):
    """``(a, w, bias)`` of ``mm(a, t(w))`` or ``addmm(bias, a, t(w))``, or None."""
    if bsym.op is aten.mm.default and not bsym.kwargs:
        bias, (a, b) = None, bsym.args
    elif bsym.op is aten.addmm.default and not bsym.kwargs and len(bsym.args) == 3:
        bias, a, b = bsym.args
        if not isinstance(bias, TensorProxy) or bias.dim() != 1:
            return None
    else:
        return None
    transpose = producers.get(getattr(b, "label", None))
    if transpose is None or transpose.op is not aten.t.default:
        return None
    w = transpose.args[0]
    if not isinstance(w, TensorProxy) or w.dim() != 2:
        return None
    return a, w, bias


def _folded_input(a: TensorProxy, producers: dict):
    """The input ``x`` that ``a`` folds to ``[M, K]``, when it is a row-major reshape of one."""
    reshape = producers.get(a.label)
    if reshape is None or reshape.op not in RESHAPES:
        return None
    x = reshape.args[0]
    # Row-major in every dim, those of size 1 too: ``aten::linear`` on a slice whose size-1 dim
    # has another stride (a sequence-parallel shard of one row) takes matmul's other path,
    # bits apart from eager's ``view`` and ``mm``.
    if not isinstance(x, TensorProxy) or x.dim() < 3 or not known_shape_equal(x.stride(), contiguous_strides(x.shape)):
        return None
    if not known_equal(x.shape[-1], a.shape[-1]):
        return None
    return x


def fuse_linears(trace: Trace) -> Trace:
    """``view(mm(view(x), t(w)))`` and ``mm(x, t(w))`` (``addmm`` with a bias) as
    ``aten.linear(x, w, bias)`` (see the module docstring)."""
    producers: dict[str, BoundSymbol] = {}
    reshaped_by: dict[str, BoundSymbol] = {}  # label -> a reshape of it
    readers: Counter[str] = Counter()
    for bsym in trace.bound_symbols:
        for proxy in bsym.input_proxies():
            readers[proxy.label] += 1
        for proxy in bsym.output_proxies():
            producers[proxy.label] = bsym
        if bsym.op in RESHAPES and isinstance(bsym.args[0], TensorProxy):
            reshaped_by[bsym.args[0].label] = bsym
    leaves, _ = tree_flatten(trace.output)
    readers.update(x.label for x in leaves if is_proxy(x))

    # The linear goes where the mm was (it must read x and w as the mm did: a write to x
    # may follow); the closing view, which only read the mm, goes.
    replaced: dict[int, BoundSymbol] = {}  # id of an mm -> the linear that replaces it
    dropped: set[int] = set()
    for bsym in trace.bound_symbols:
        operands = _operands(bsym, producers)
        if operands is None:
            continue
        a, w, bias = operands
        result = bsym.output
        x = _folded_input(a, producers)
        if x is None:
            if a.dim() != 2:
                continue
            target, x = bsym, a  # a 2-D input: the mm is the linear
        else:
            if bias is not None and x.dim() != 3:
                continue  # aten::linear adds the bias after a matmul there, not in addmm
            target = reshaped_by.get(result.label)
            if readers[result.label] != 1 or target is None:
                continue
            expected = (*x.shape[:-1], w.shape[0])
            if not known_shape_equal(target.output.shape, expected) or not is_row_major(target.output):
                continue
        args = (x, w) if bias is None else (x, w, bias)
        old = target.output  # same name and metadata, made by the linear now
        output = TensorProxy(
            old.fake, old.label, NoProvenance(str(aten.linear.default)), requires_grad=old.requires_grad
        )
        replaced[id(bsym)] = BoundSymbol(
            aten_symbol(aten.linear.default), args, {}, output, bsym.note, op=aten.linear.default
        )
        if target is not bsym:
            dropped.add(id(target))

    outputs: dict[str, TensorProxy] = {}  # label -> the linear's own proxy, for its readers
    symbols = []
    for original in trace.bound_symbols:
        if id(original) in dropped:
            continue
        bsym = replaced.get(id(original), original)
        symbols.append(bsym.with_inputs_renamed(outputs) if outputs else bsym)
        if bsym is not original:
            outputs[bsym.output.label] = bsym.output
    output = renamed(trace.output, outputs)
    return trace.derive(f"{trace.fn_name}, with linear layers as one call", symbols, output)
