"""``check="eager"``: each compiled call is checked against eager, and a difference names
the first line of the per-rank program whose value differs.

Per call: the state the call can change (the tensors of its arguments, objects and
module, the objects' and modules' attributes, the random generator) is saved; the eager
program runs; the state is put back; the compiled program runs. Outputs and the changed
state are compared (types, DTensor placements, shapes, strides, dtypes and values, to
float tolerance: some passes add in another order). Where they differ, the per-rank
program as recorded below DTensor (what DTensor's own dispatch ran) and the compiled
program run again from the saved state, each keeping every intermediate value, and the
first compiled line whose value differs from the recorded one is named, with the
torch-level call it came from and its placements. When nothing differs there, the
difference is in what tracing saw: Python state the program does not read again.

The check runs the program three or four times per call: a debugging tool, not for speed.
On several ranks, every rank of the program must run with the check (the eager program
and the localization run collectives).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from ..capture import DataSnapshot, is_state_object
from ..core import Trace, TracingError
from ..core.block_call import with_block_symbols
from ..core.fsdp_internals import holds_composable_state
from ..core.torch_internals import default_store, resolve_process_group

functional = torch.ops._c10d_functional
_checked_calls = itertools.count()


class EagerMismatchError(AssertionError):
    """A compiled call's outputs or changed inputs differ from eager's."""


_eager_runs: list[object] = []  # the checked calls whose eager program runs now


def running_eager() -> bool:
    """Whether the eager program of a checked call runs now: jitted code it calls runs as
    written too, so that the reference is eager through and through."""
    return bool(_eager_runs)


@contextlib.contextmanager
def _eager_run():
    _eager_runs.append(None)
    try:
        yield
    finally:
        _eager_runs.pop()


def _state_tensors(module, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """``(path, local tensor)`` for every tensor the call can change, in a fixed order."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()

    def visit(value, path: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            local = value._local_tensor if isinstance(value, DTensor) else value
            if id(local) not in seen:
                seen.add(id(local))
                found.append((path, local))
        elif depth > 0 and isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{path}[{i}]", depth - 1)
        elif depth > 0 and isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{path}[{key!r}]", depth - 1)
        elif depth > 0 and is_state_object(value):
            for key, item in vars(value).items():
                visit(item, f"{path}.{key}", depth - 1)

    visit(args, "args", 5)
    visit(kwargs, "kwargs", 5)
    if module is not None:
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            visit(tensor, f"module.{name}", 0)
        for path, submodule in module.named_modules():
            for key, value in vars(submodule).items():
                if isinstance(value, (torch.Tensor, list, tuple, dict)) and not key.startswith("_"):
                    visit(value, f"module.{path + '.' if path else ''}{key}", 2)  # (a hand-made KV cache's list)
    return found


class _SavedState:
    """What a call can change, saved so that another program can start from it again."""

    def __init__(self, module, args: tuple, kwargs: dict):
        self.where = (module, args, kwargs)
        self.objects = DataSnapshot()
        for i, arg in enumerate(args):
            self.objects.add(arg, f"args[{i}]", depth=4)
        self.objects.add(kwargs, "kwargs", depth=4)
        if module is not None:
            for submodule in module.modules():
                for table in (vars(submodule), submodule._parameters, submodule._buffers):
                    self.objects.add(table, "module", depth=0)
        with torch.no_grad():
            self.tensors = [(t, t.clone(), _version(t)) for _, t in _state_tensors(*self.where)]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def restore(self) -> None:
        self.objects.put_back()
        with torch.no_grad():
            for tensor, saved, version in self.tensors:
                # Only what the call wrote (a copy counts as a write): its version counted it, or, where
                # none did (an inference tensor, a write through ``.data``, a DTensor's local), its values.
                if _version(tensor) != version or not torch.equal(tensor, saved):
                    tensor.copy_(saved)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def now(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors the call can change, as they are now (copied)."""
        with torch.no_grad():
            return [(path, t.clone()) for path, t in _state_tensors(*self.where)]


def _version(tensor: torch.Tensor):
    """A tensor's version counter (None for an inference tensor, which has none)."""
    return None if tensor.is_inference() else tensor._version


def _difference(got, expected, depth: int = 4) -> str | None:
    """Why two values differ, or None: type, placements, metadata, then values; objects
    and containers by what they hold, ``depth`` levels down."""
    if isinstance(expected, DTensor) or isinstance(got, DTensor):
        if type(got) is not type(expected):
            return f"a {type(got).__name__} where eager gives a {type(expected).__name__}"
        if got.placements != expected.placements:
            return f"placements {got.placements} where eager has {expected.placements}"
        return _difference(got._local_tensor, _waited(expected._local_tensor))
    if isinstance(expected, torch.Tensor):
        expected = _waited(expected)
        if not isinstance(got, torch.Tensor):
            return f"a {type(got).__name__} where eager gives a tensor"
        for what in ("dtype", "shape"):
            if getattr(got, what) != getattr(expected, what):
                return f"{what} {getattr(got, what)} where eager has {getattr(expected, what)}"
        if got.stride() != expected.stride():
            return f"strides {got.stride()} where eager has {expected.stride()}"
        try:
            torch.testing.assert_close(got.detach(), expected.detach(), equal_nan=True)
        except AssertionError:
            a, b = got.detach().double(), expected.detach().double()
            wrong = ~torch.isclose(a, b, equal_nan=True)
            largest = (a - b).abs().nan_to_num(float("inf")).max()
            return f"values differ at {int(wrong.sum())} of {got.numel()} elements (largest difference {largest.item():.4g})"
        return None
    if type(got) is type(expected) and got is not expected and type(got).__eq__ is object.__eq__:
        return _held_difference(got, expected, depth)  # (a new object eager makes too: a KV cache)
    if type(got) is type(expected) and type(got) in (list, tuple, dict) and depth:
        return _held_difference(got, expected, depth)
    try:
        same = type(got) is type(expected) and (got is expected or got == expected or got != got)
    except (RuntimeError, TypeError):  # objects holding tensors: compared by their tensors elsewhere
        same = type(got) is type(expected)
    return None if same else f"{got!r} where eager gives {expected!r}"


def _held_difference(got, expected, depth: int) -> str | None:
    """Why two objects of one class with no ``==`` of their own (or two containers) differ
    in what they hold, a few levels down; None where they do not (or cannot be told)."""
    if not depth:
        return None
    if isinstance(got, dict) or hasattr(got, "__dict__"):
        a, b = (got, expected) if isinstance(got, dict) else (vars(got), vars(expected))
        if list(a) != list(b):
            return f"a {type(got).__name__} holding {list(a)} where eager's holds {list(b)}"
        pairs = [(f"[{key!r}]" if isinstance(got, dict) else f".{key}", a[key], b[key]) for key in a]
    elif isinstance(got, (list, tuple)):
        if len(got) != len(expected):
            return f"a {type(got).__name__} of {len(got)} where eager's has {len(expected)}"
        pairs = [(f"[{i}]", x, y) for i, (x, y) in enumerate(zip(got, expected))]
    else:
        return None
    for where, x, y in pairs:
        why = _difference(x, y, depth - 1)
        if why is not None:
            return f"{type(got).__name__}{where}: {why}"
    return None


def _waited(t):
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _compare_results(got, expected) -> list[str]:
    got_leaves, got_spec = tree_flatten(got)
    expected_leaves, expected_spec = tree_flatten(expected)
    if got_spec != expected_spec:
        return [f"the result's structure is {got_spec} where eager's is {expected_spec}"]
    problems = []
    for i, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
        why = _difference(g, e)
        if why is not None:
            problems.append(f"output {i}: {why}")
    return problems


def _compare_state(got: list, expected: list) -> list[str]:
    if [p for p, _ in got] != [p for p, _ in expected]:
        return ["the tensors the call left in its arguments and module are not eager's"]
    problems = []
    for (path, g), (_, e) in zip(got, expected):
        why = _difference(g, e)
        if why is not None:
            problems.append(f"{path} after the call: {why}")
    return problems


def _all_values(trace: Trace, inputs: tuple) -> dict[str, object]:
    """Every value ``trace`` computes from ``inputs``, by name (collectives' started
    outputs excepted: their values exist only once waited)."""
    labels = [p.label for p in trace.inputs]
    for bsym in trace.bound_symbols:
        op = bsym.op
        if op is not None and op.namespace == "_c10d_functional" and op is not functional.wait_tensor.default:
            continue
        labels += [p.label for p in bsym.output_tensors()]
    by_label = {p.label: p for p in trace.inputs}
    for bsym in trace.bound_symbols:
        by_label.update((p.label, p) for p in bsym.output_tensors())
    probe = trace.derive("every value", list(trace.bound_symbols), tuple(by_label[label] for label in labels))
    return dict(zip(labels, probe.compile()(*inputs)))


def _first_differing_line(execution: Trace, reference: dict, compiled: dict) -> str | None:
    for bsym in execution.bound_symbols:
        for proxy in bsym.output_tensors():
            if proxy.label not in reference or proxy.label not in compiled:
                continue
            why = _difference(compiled[proxy.label], reference[proxy.label])
            if why is not None:
                note = f"  # {bsym.note}" if bsym.note is not None else ""
                return f"{' / '.join(bsym.lines())}{note}\n  {proxy.label}: {why}"
    return None


def _collective_ranks(trace: Trace) -> list[int]:
    ranks: set[int] = set()
    for bsym in with_block_symbols(trace.bound_symbols):
        if bsym.op is None or bsym.op.namespace != "_c10d_functional":
            continue
        for arg in bsym.args:
            if isinstance(arg, str):
                try:
                    group = resolve_process_group(arg)
                except (KeyError, ValueError, RuntimeError):
                    continue
                ranks.update(dist.get_process_group_ranks(group))
    return sorted(ranks)


def _any_rank_differs(differs: bool, ranks: list[int], name: str) -> bool:
    """Whether the check failed on any rank running the program's collectives: the
    localization runs them again, so either all of those ranks do it or none."""
    if len(ranks) < 2 or not dist.is_initialized() or dist.get_backend() == "fake":
        return differs
    store = default_store()
    key = f"dtcompile/check/{name}/{next(_checked_calls)}"
    store.set(f"{key}/{dist.get_rank()}", "1" if differs else "0")
    store.wait([f"{key}/{r}" for r in ranks])
    return any(store.get(f"{key}/{r}") == b"1" for r in ranks)


def checked_call(compiled, module, args: tuple, kwargs: dict, eager):
    """Run one call compiled and eager (``eager()`` runs the original code) and raise
    :class:`EagerMismatchError` where they differ (see the module docstring)."""
    if module is not None and any(holds_composable_state(m) for m in module.modules()):
        raise TracingError(
            "dtcompile.jit: check='eager' does not run modules fully_shard manages: its eager run goes through "
            "FSDP2's own hooks, which leave parameters unsharded where the compiled call does not"
        )
    saved = _SavedState(module, args, kwargs)
    with _eager_run():
        expected = eager()
    eager_state = saved.now()
    saved.restore()
    entry, inputs, got = compiled.run(module, args, kwargs)  # (an entry whose data check fails passed by)
    problems = _compare_results(got, expected) + _compare_state(saved.now(), eager_state)
    execution = entry.traces[-1]
    if not _any_rank_differs(bool(problems), _collective_ranks(execution), compiled.name):
        return got
    line = None
    if entry.reference is not None:
        computation_inputs = tuple(inputs[: len(execution.inputs)])
        saved.restore()
        reference = _all_values(entry.reference, computation_inputs)
        saved.restore()
        line = _first_differing_line(execution, reference, _all_values(execution, computation_inputs))
    where = (
        f"The first line of the compiled per-rank program whose value differs from the program recorded "
        f"below DTensor:\n  {line}"
        if line is not None
        else "Every value of the compiled per-rank program equals the program recorded below DTensor: the "
        "difference is in what tracing saw (Python state or side effects the program does not repeat), or, "
        "on another rank, in what it computed"
        if entry.reference is not None
        else "(training calls are compared by their outputs only)"
    )
    raise EagerMismatchError(
        f"dtcompile check='eager': {compiled.name} differs from eager:\n  "
        + "\n  ".join(problems or ["(on another rank)"])
        + f"\n{where}"
    )
