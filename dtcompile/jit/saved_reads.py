"""What a training step's backward reads of its inputs and outputs as they are, which
``CompiledStep`` checks (or reads live) as eager's autograd would: found in its traces."""

from __future__ import annotations

import torch

from ..capture.fsdp import reaches_fsdp
from ..core import TensorProxy
from ..transforms.effects import mutates


def live_saved(backward, inputs: list, cotangents: int, checked: frozenset = frozenset()) -> frozenset:
    """``TrainingProgram.live_saved`` of the ``backward`` execution trace (but the inputs
    ``checked`` by label: ones a node of eager's graph saved, whose versions it checks)."""
    saved = backward.inputs[: len(backward.inputs) - cotangents]
    written = {p.memory for b in backward.bound_symbols if mutates(b) for p in b.input_tensors()}
    labels = {p.label for p in inputs} - checked
    return frozenset(i for i, p in enumerate(saved) if p.label in labels and p.memory in written)


def read_back(joint, inputs: list, by_memory: bool = False) -> tuple:
    """``TrainingProgram.read_back`` of the recorded ``joint`` trace (``by_memory``: its
    ``dtensors_read_back``, of every input)."""
    position = {p.label: i for i, p in enumerate(inputs)}
    backward = [p for b in joint.bound_symbols if b.in_backward for p in b.input_tensors()]
    written = {p.memory for b in joint.bound_symbols if not b.in_backward and mutates(b) for p in b.input_tensors()}
    if by_memory:
        memory = {p.memory for p in backward}
        return tuple(i for i, p in enumerate(inputs) if p.memory in memory and p.memory not in written)
    read = {p.label for p in backward} & position.keys()
    return tuple(sorted(position[label] for label in read if inputs[position[label]].memory not in written))


def saved_dtensor_outputs(backward, output_proxies: list, dtensor_slots: set, cotangents: int) -> tuple:
    """The DTensor output slots whose memory the ``backward`` execution trace reads (saved by
    the forward: ``y = x.exp()``, ``y.sin()`` of a returned ``y``). Eager's autograd saved
    the DTensor and checks its version; a write through the returned DTensor counts on its
    own counter, not its local tensor's, which autograd saved here: checked by the step."""
    saved = {p.memory for p in backward.inputs[: len(backward.inputs) - cotangents] if isinstance(p, TensorProxy)}
    return tuple(i for i in sorted(dtensor_slots) if output_proxies[i].memory in saved)


_TABLES = ("_parameters", "_buffers", "_modules", "_forward_pre_hooks", "_forward_hooks")


class ModuleRead:
    """A module's state that code of the user's in the backward (a checkpointed region's
    recompute, a tensor hook) may read, as it is at the backward: its training flag, the
    objects in its tables (parameters, buffers, submodules, forward hooks) and whether its
    parameters require grad. The
    program holds what it was when traced, where eager's backward would read the new."""

    def __init__(self, module: torch.nn.Module, path: str):
        self.module, self.where = module, f"the module {path or '(the one called)'}: its training flag or tables"
        self.state = self._now()

    def _now(self) -> list:
        state = vars(self.module)
        flags = [p is not None and p.requires_grad for p in state.get("_parameters", {}).values()]
        return [
            state.get("training"),
            *flags,
            *(x for table in _TABLES for item in state.get(table, {}).items() for x in item),
        ]

    def unchanged(self) -> bool:
        now = self._now()
        return len(now) == len(self.state) and all(
            a is b or (type(a) is str and a == b) for a, b in zip(now, self.state)
        )


def backward_reads(captured, backward, module: torch.nn.Module | None) -> tuple:
    """``TrainingProgram.backward_reads``: where the backward runs code of the user's, the
    Python values the call's code read, and the state of each module of ``module``'s tree."""
    if not backward.users_code_ran:
        return ()
    modules = []
    if module is not None and not reaches_fsdp([module]):  # (FSDP2 swaps what the tables hold)
        # The modules the backward called and theirs (a recompute's); else (a hook's) all.
        read = {id(m) for called in backward.modules_called for m in called.modules()}
        modules = [ModuleRead(m, path) for path, m in module.named_modules() if not read or id(m) in read]
    return (*captured.python_state.reads, *modules)


SAVED_INFERENCE = (  # eager's error, where autograd would save an inference tensor
    "Inference tensors cannot be saved for backward. Please do not use Tensors created in inference mode in "
    "computation tracked by autograd. To work around this, you can make a clone to get a normal tensor and use it "
    "in autograd, or use `torch.no_grad()` instead of `torch.inference_mode()`."
)
