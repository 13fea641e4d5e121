"""Walks over autograd's graph while tracing: which tensors it reaches from which outputs
(where no output that gets a cotangent reaches a tensor, eager's autograd leaves its gradient
None: a parameter that only feeds an output the loss does not use, and so must a compiled
backward), and the notes put on the nodes a torch-level call made."""

from __future__ import annotations

import weakref

import torch

from ..core import Note

# The attribute of an autograd Function's node that stands for a whole graph (a replayed
# repeated block's): a callable giving its outputs' count and, for each of its inputs, the
# mask of the outputs whose gradients reach it.
REACHED_BY = "_dtcompile_reached_by"
# Tensors whose gradient is defined only where that of one of a list of others is: an FSDP2
# bucket's sharded parameter, whose gradient is a slice of the bucket's (defined whenever any
# member's is), where eager's FSDP2 leaves None if its unsharded values (one per forward) got
# none. Held weakly: the entries go with the traced tensors.
_REACHED_THROUGH: dict[int, tuple[weakref.ref, list]] = {}  # id(tensor) -> (the tensor, the others)


def reached_through(tensor: torch.Tensor, other: torch.Tensor) -> None:
    """Let ``tensor``'s gradient be defined where ``other``'s is (see above)."""
    key = id(tensor)
    if key not in _REACHED_THROUGH:
        _REACHED_THROUGH[key] = (weakref.ref(tensor, lambda _: _REACHED_THROUGH.pop(key, None)), [])
    _REACHED_THROUGH[key][1].append(other)


def reached_by_none(wrt: list, masks: list[int]) -> list[bool]:
    """Whether each of ``wrt`` (``masks``: :func:`reaching`'s) is one whose gradient is defined
    only through others (see above) that no output reaches: its gradient is None, whatever
    slice of its bucket's the traced backward computed (a member used under ``no_grad`` only,
    or by a branch not taken)."""
    return [mask == 0 and _targets(t)[0] is not t for t, mask in zip(wrt, masks)]


def _targets(tensor: torch.Tensor) -> list:
    held, others = _REACHED_THROUGH.get(id(tensor), (None, None))
    return others if held is not None and held() is tensor else [tensor]


def reaching(outputs: list, wrt: list) -> list[int]:
    """For each of ``wrt``, the outputs (bit i: ``outputs[i]``) from which autograd's graph
    reaches it: where none of them gets a cotangent, eager's autograd leaves its gradient
    None (a parameter that only feeds an output the loss does not use)."""
    leaf_index: dict[int, int] = {}
    node_index: dict[int, int] = {}
    # The nodes met, kept so that their ids stay theirs: a node's Python object lives only as
    # long as something holds it (the next ``grad_fn`` read may make another, at another id).
    alive: list = []
    for i, tensor in enumerate(wrt):
        for t in _targets(tensor):
            node = t.grad_fn
            if node is None:
                leaf_index[id(t)] = i
            else:
                alive.append(node)
                node_index[id(node)] = node_index.get(id(node), 0) | 1 << i
    reach: dict = {}  # id(node) -> bit mask over wrt (a replayed block's: one per output)
    masks = [0] * len(wrt)
    for k, out in enumerate(outputs):
        hit = 1 << leaf_index[id(out)] if id(out) in leaf_index else 0
        if out.grad_fn is not None:
            hit |= _reach_of(out.grad_fn, out.output_nr, reach, alive, leaf_index, node_index)
        for i in range(len(wrt)):
            if hit >> i & 1:
                masks[i] |= 1 << k
    return masks


def _reach_of(root, output_nr: int, reach: dict, alive: list, leaf_index: dict, node_index: dict) -> int:
    """The mask of ``wrt`` reached from output ``output_nr`` of the autograd node ``root`` (an
    iterative post-order walk: graphs are deep). A replayed block's node stands for the first
    block's whole graph: which of its inputs each of its outputs reaches is that graph's, kept
    apart (a mask per output), so an input only unused outputs reach gets None, as in eager."""
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if key in reach and not expanded:
            continue
        nexts = [n for n, _ in node.next_functions if n is not None]
        if not expanded:
            alive.append(node)
            reach[key] = 0  # in progress (the graph is acyclic)
            stack.append((node, True))
            stack.extend((n, False) for n in nexts if id(n) not in reach)
            continue
        mask = node_index.get(key, 0)
        variable = getattr(node, "variable", None)  # an AccumulateGrad: the leaf it accumulates into
        if variable is not None and id(variable) in leaf_index:
            mask |= 1 << leaf_index[id(variable)]
        edges = [0 if n is None else _edge_reach(reach, n, nr) for n, nr in node.next_functions]
        reached_by = getattr(node, REACHED_BY, None)
        if reached_by is not None:
            outputs, reached = reached_by()  # input i -> the mask of the outputs reaching it
            reach[key] = [mask | _any_of(e for e, r in zip(edges, reached) if r >> k & 1) for k in range(outputs)]
        else:
            reach[key] = mask | _any_of(edges)
    return _edge_reach(reach, root, output_nr)


def _edge_reach(reach: dict, node, output_nr: int) -> int:
    found = reach.get(id(node), 0)
    return found[output_nr] if isinstance(found, list) else found


def _any_of(masks) -> int:
    mask = 0
    for m in masks:
        mask |= m
    return mask


def tag_backward_nodes(inputs: list, outputs: list, note: Note) -> None:
    """Put ``note`` on the autograd nodes a torch-level call made (those between its
    outputs' grad_fns and its inputs'), so the backward's symbols can say which forward
    call they differentiate."""
    stop = {id(t.grad_fn) for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    pending = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen or id(node) in stop or not hasattr(node, "metadata"):
            continue
        seen.add(id(node))
        node.metadata.setdefault("dtcompile_note", note)
        pending.extend(next_node for next_node, _ in node.next_functions)


def saves_a_tensor(outputs: list) -> bool:
    """Whether a node of the autograd graph behind ``outputs`` saved a tensor."""
    with torch._C.DisableTorchFunction():
        stack, seen = [t.grad_fn for t in outputs if t.grad_fn is not None], set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if any(name.startswith("_raw_saved_") for name in dir(node)):
                return True
            try:  # (an autograd.Function's node)
                if getattr(node, "saved_tensors", ()):
                    return True
            except RuntimeError:
                return True
            stack += [next_node for next_node, _ in node.next_functions]
    return False
