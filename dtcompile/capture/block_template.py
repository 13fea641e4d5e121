"""What the first call of a block recorded, for later equivalent blocks (``blocks.py``)."""

from __future__ import annotations

import torch

from ..core import TensorProxy
from .block_checks import Held
from .equivalence import local_proxy

NOT_REPLAYED = object()  # what a replay that did not happen returns (the block is traced instead)


class BlockTemplate:
    """The symbols the first call of a block recorded, and how to record them again for an
    equivalent block (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, key: tuple, state: list, tensors: tuple):
        self.module = module
        self.key = key
        self.tensors = tensors  # ``equivalence.tensors_key`` of the block as it was recorded
        self.state = state  # the block as it was recorded (``equivalence.block_state``)
        self.python_state: Held | None = None  # the containers the block could read, as recorded
        self.symbols: list = []
        self.sources: dict[str, list[tuple[str, object]]] = {}  # free proxy label -> where each block has it
        self.output = None  # (treespec, leaves described)
        self.aliases: list = []  # per symbol: what ``replay.output_aliases`` found
        # With gradients (``block_training.py``): which output leaves require grad, the first
        # block's values that do (and where each block has them), its backward templates.
        self.grad_outputs: list[int] = []
        self.grad_output_values: list = []
        self.grad_input_sources: list = []
        self.grad_input_values: list = []
        self.inputs_reached: list[int] | None = None  # (``GradReplay.reached_by``, found once)
        self.backwards: dict = {}
        self.saved_sources: list = []  # where each block has the inputs its backward reads
        self.saved_outputs: list[int] = []  # the output leaves its backward reads
        self.refused: str | None = None  # why the block is only traced
        self.free: dict[str, TensorProxy] = {}  # the tensors it reads from outside, by label
        self.replayed = False
        self.writes: tuple = ([], [])  # ``tensor_versions.writes`` to its arguments, and to the outputs it made
        self.program = None  # without gradients, the program each equivalent block calls (``block_calls.py``)
        # With gradients, the forward program later blocks call, and the backward programs
        # by incoming gradients' key (``block_calls.training_programs``); None: recorded again.
        self.forward_program = None
        self.backward_programs: dict = {}

    def sources_in(self, held: dict, flat_args: list) -> dict[str, TensorProxy] | None:
        """The later block's proxy for each free proxy of the template; None where one has
        none, or two sources disagree. ``held``: the block's ``named_tensors``."""
        found: dict[str, TensorProxy] = {}
        for label, sources in self.sources.items():
            for kind, where in sources:
                proxy = local_proxy(held.get(where) if kind == "module" else flat_args[where])
                if proxy is None or found.setdefault(label, proxy) is not proxy:
                    return None
        return found

    def grad_inputs_in(self, held: dict, flat_args: list) -> list | None:
        """The later block's values that require grad, as the first block's; None where
        one does not. ``held``: the block's ``named_tensors``."""
        found = [held.get(where) if kind == "module" else flat_args[where] for kind, where in self.grad_input_sources]
        if not all(isinstance(v, torch.Tensor) and v.requires_grad for v in found):
            return None
        return found
