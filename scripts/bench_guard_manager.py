"""torch.compile's C++ guard tree checking what dtcompile's prologue checks of a module's
tensors, against the prologue's own C-level passes over the same tensors (issue 15).

Each tensor is reached through a dict of its own, as a module's parameters are; the guard
tree (``torch._C._dynamo.guards.RootGuardManager``, built by hand) checks its identity,
then its metadata (TENSOR_MATCH), then its storage offset and Python attribute count. The
prologue's passes: ``dict.get`` and ``id`` of each, one TensorGuards check of all, a pass
over storage offsets and one over attribute counts. Run: ``python
scripts/bench_guard_manager.py [--tensors 517]`` (517: the decode model's at 32 layers)."""

from __future__ import annotations

import argparse
import time

import torch
import torch._C._dynamo.guards as guards
from torch._dynamo.guards import GuardManagerType

_MANAGER = GuardManagerType.GUARD_MANAGER


def _leaf(add, *args, rest=()) -> None:
    """A leaf guard, with the ``user_stack`` argument newer torch versions take after the
    guard's code parts (``rest``: the arguments after it)."""
    try:
        add(*args, None, *rest)
    except TypeError:
        add(*args, *rest)


def guard_tree(tables: list[dict], tensors: list[torch.Tensor], checks: tuple[str, ...]):
    root = guards.RootGuardManager()
    listed = root.dict_getitem_manager("T", "T", tables, _MANAGER)
    for i, (table, t) in enumerate(zip(tables, tensors)):
        held = listed.list_getitem_manager(i, f"T[{i}]", table, _MANAGER)
        node = held.dict_getitem_manager("weight", f"T[{i}]['weight']", t, _MANAGER)
        if "identity" in checks:
            _leaf(node.add_id_match_guard, id(t), [f"id {i}"])
        if "metadata" in checks:
            keys = torch._C._dispatch_keys(t)
            _leaf(
                node.add_tensor_match_guard,
                t,
                list(t.shape),
                list(t.stride()),
                f"t{i}",
                [f"t{i}"],
                rest=(type(t), keys),
            )
        if "offset and attributes" in checks:
            offset = node.tensor_property_storage_offset_manager(0, f"t{i}.offset", t.storage_offset(), _MANAGER)
            _leaf(offset.add_equals_match_guard, t.storage_offset(), [f"offset {i}"])
            attributes = node.get_generic_dict_manager(f"t{i}.__dict__", vars(t), _MANAGER)
            _leaf(attributes.add_dict_length_check_guard, len(vars(t)), [f"attributes {i}"])
    return root


def microseconds(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=517)
    parser.add_argument("--repeat", type=int, default=3000)
    n, repeat = parser.parse_args().tensors, parser.parse_args().repeat
    tensors = [torch.nn.Parameter(torch.randn(64, 32)[:, 1:17]) if i % 2 else torch.randn(8, 4) for i in range(n)]
    tables = [{"weight": t} for t in tensors]
    frame = {"T": tables}
    print(f"{n} tensors, each in a dict of its own; microseconds per check of all")
    levels = [("identity",), ("identity", "metadata"), ("identity", "metadata", "offset and attributes")]
    for checks in levels:
        tree = guard_tree(tables, tensors, checks)
        assert tree.check(frame)
        note = ""
        if "metadata" in checks:  # (a tensor whose metadata changed fails the check)
            tensors[1].requires_grad_(False)
            note = "" if not tree.check(frame) else "  (this torch's tree let a changed tensor through)"
            tensors[1].requires_grad_(True)
        us = microseconds(lambda t=tree: t.check(frame), repeat)
        print(f"  guard tree: {' + '.join(checks):40s} {us:8.1f}{note}")
    batch = guards.TensorGuards(
        *tensors,
        dynamic_dims_sizes=[list(t.shape) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )
    keys, offset = ["weight"] * n, torch.Tensor.storage_offset
    passes = {
        "dict.get + ids": lambda: {*map(id, map(dict.get, tables, keys))},
        "TensorGuards.check": lambda: batch.check(*tensors),
        "storage offsets": lambda: list(map(offset, tensors)),
        "attribute counts": lambda: list(map(len, map(vars, tensors))),
    }
    total = 0.0
    for name, fn in passes.items():
        total += (us := microseconds(fn, repeat))
        print(f"  prologue's pass: {name:34s} {us:8.1f}")
    print(f"  prologue's passes together {'':24s} {total:8.1f}")
    print(
        f"  reading each tensor's _version {'':20s} {microseconds(lambda: [t._version for t in tensors], repeat):8.1f}"
    )


if __name__ == "__main__":
    main()
