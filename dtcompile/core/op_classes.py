"""Which class an op belongs to: the one table passes and executors ask.

Where torch's schemas carry the fact (a collective's namespace, where its group argument
sits, an in-place write), it is read from them; the view sets are ours, each named for
the question it answers.
"""

from __future__ import annotations

import torch

from .proxy import TensorProxy, contiguous_strides
from .symbol import BoundSymbol
from .symbolic import known_shape_equal

aten = torch.ops.aten
# DTensor's collectives, and their differentiable variants (``all_to_all_single_autograd``).
_FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd")
WAIT = torch.ops._c10d_functional.wait_tensor.default

# Reshapes: a view of a row-major tensor when the sizes allow, else a copy.
RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
# Views that keep a row-major tensor's elements in order.
ORDER_KEEPING_VIEWS = RESHAPES | {
    aten.alias.default,
    aten.detach.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
}
# Views that can be the identity (sizes unchanged): candidates for removal.
MAYBE_IDENTITY_VIEWS = RESHAPES | {aten.alias.default, aten.detach.default, aten.expand.default, aten.slice.Tensor}
MATMULS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default})


def makes_view(op) -> bool:
    """An op whose result only views its input (read from its schema: an output aliased to
    an input, not written), or a reshape: moving it later changes nothing but when it runs."""
    if op is None:
        return False
    if op in RESHAPES:
        return True
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def is_wait(op) -> bool:
    """``wait_tensor``: the end of a functional collective."""
    return op is WAIT


def is_collective(op) -> bool:
    """A functional collective's start (``_c10d_functional.all_reduce``), not its wait."""
    return op is not None and op.namespace in _FUNCTIONAL and op is not WAIT


def is_communication(op) -> bool:
    """A collective's start or its wait: what the collectives executor runs."""
    return op is not None and op.namespace in _FUNCTIONAL


def group_argument(op) -> int | None:
    """Where a functional collective takes its group's name, from its schema; None for an
    op with no group."""
    names = [argument.name for argument in op._schema.arguments]
    return names.index("group_name") if "group_name" in names else None


def group_name(bsym) -> object:
    """The group a functional collective's bound symbol runs on (its name), or None."""
    position = group_argument(bsym.op)
    if position is None:
        return None
    return bsym.kwargs.get("group_name", bsym.args[position] if position < len(bsym.args) else None)


def is_row_major(proxy: TensorProxy) -> bool:
    """Strides exactly row-major, size-1 dims included (what ``view`` gives such a tensor)."""
    return known_shape_equal(proxy.stride(), contiguous_strides(proxy.shape))


def valued_while_traced(op) -> bool:
    """Whether an op may run on real values while tracing (``Recording.trace_time_value``):
    not a collective (the other ranks would not run theirs), a random op (it would move the
    generator), nor a memory-less zero tensor (an op on it, run for real, reads no memory)."""
    return (
        op.namespace != "_c10d_functional"
        and torch.Tag.nondeterministic_seeded not in op.tags
        and op is not _ZERO_TENSOR
    )


_ZERO_TENSOR = torch.ops.aten._efficientzerotensor.default


def draws_random_numbers(bsym) -> bool:
    """Whether a symbol's op draws random numbers: a seeded op (its tag), but attention
    with ``dropout_p`` 0, which draws none."""
    if torch.Tag.nondeterministic_seeded not in bsym.op.tags:
        return False
    for index, argument in enumerate(bsym.op._schema.arguments):
        if argument.name == "dropout_p":
            if argument.kwarg_only or index >= len(bsym.args):
                value = bsym.kwargs.get("dropout_p", argument.default_value)
            else:
                value = bsym.args[index]
            return not (type(value) in (int, float) and value == 0)
    return True


def mutates(bsym: BoundSymbol) -> bool:
    """True for in-place and ``out=`` ops, and block calls that write an argument
    (``core/block_call.py``): they change a tensor other symbols may read."""
    if bsym.op is None:
        return bool(getattr(bsym.symbol, "writes", ()))
    return bsym.op._schema.is_mutable


def written_tensors(bsym: BoundSymbol) -> list[TensorProxy]:
    """The tensors an in-place or ``out=`` op writes (its schema's ``Tensor(a!)`` arguments),
    or a block call (the arguments its program writes)."""
    if not mutates(bsym):
        return []
    if bsym.op is None:
        return [bsym.args[i] for i in bsym.symbol.writes]
    written = []
    for position, argument in enumerate(bsym.op._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = bsym.args[position] if position < len(bsym.args) else bsym.kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written += [v for v in values if isinstance(v, TensorProxy)]
    return written
