"""Repeated blocks recorded once: a submodule call that repeats an earlier one is replayed.

Real models stack 32 to 128 identical layers, and tracing one (DTensor's dispatch and
sharding propagation, the user's Python, fake tensors) is most of a compile. While a
module is traced, :class:`RepeatedBlocks` sees every submodule call (``nn.Module.__call__``
is swapped for the length of the trace). The first call of a block is run and recorded as
it always is, and the symbols it added become a :class:`BlockTemplate`. A later call of
an *equivalent* block, with *equivalent* arguments, is not run: the template's symbols are
recorded again, each through the recording (so each op's output metadata comes from its
fake tensors again, and names are given in the same order), with the later block's
tensors in place of the first one's, and the outputs are rebuilt around the new proxies
with the first call's DTensor specs. The trace is the one the Python would have recorded
(the tests compare the printed programs). Which blocks and arguments are equivalent is
``equivalence.py``'s to say. A block traced as it is has its stretch of the recording
noted (``outlining.py`` makes alike stretches calls of one program once the call is traced).

What a template may hold (else the block is only ever traced, ``BlockTemplate.refused``):
tensors from the block's own parameters, buffers and attributes and from its arguments
(anything else the block reads, an object's tensors (a KV cache), a global tensor, cannot
be mapped to a later block); no random ops (DTensor's take their offsets from Python
state), collectives called directly, numbers read from data, changes to Python state the
block reads (a later block would read the new value), nor to an argument's placements.
With gradients, a later block goes through an autograd Function whose backward records
the first block's backward again (``block_training.py``); the first block's inputs that
need gradients must not depend on each other (``block_checks.inputs_depend``).
"""

from __future__ import annotations

import collections
import copy

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core import TensorProxy
from ..core.torch_internals import make_dtensor, saved_tensors_hooks
from .around_ops import GLOBAL_HOOKS
from .block_calls import block_program, call_again, first_call, training_programs
from .block_checks import Held, arguments_changed, inputs_depend, python_state, recording_counts, unreplayable
from .block_identity import identity_read
from .block_template import NOT_REPLAYED, BlockTemplate
from .block_training import BlockReplayFailed, GradReplay, backward_template
from .equivalence import (
    SCALARS,
    arguments_key,
    block_state,
    holds_data,
    holds_size,
    local_proxy,
    named_tensors,
    same_blocks,
    tensors_key,
)
from .outlining import Stretches
from .replay import ReplayDiverged, aliases_of, record_again
from .tensor_attributes import user_attributes
from .tensor_versions import count_writes, made_again, versions, writes

TEMPLATES_PER_KEY = 8  # each is compared with every later block of its class and arguments


class RepeatedBlocks:
    """While a module is traced: submodule calls recorded once and replayed (see the
    module docstring)."""

    def __init__(self, recording, module_state):
        self.recording = recording
        self.paths = module_state.paths  # id of each module of the traced tree -> its path
        self.modules = module_state.modules
        self.tensors = frozenset(module_state.proxies)  # ids of the tensors the tree holds (not their proxies)
        self.root = module_state.modules[0] if module_state.modules else None
        self.templates: dict[type, list[BlockTemplate]] = {}
        self.recording_depth = 0
        self.replayed: dict[str, list[str]] = {}  # path of a recorded block -> the blocks replayed from it
        self.program_names: set[str] = set()
        self.stretches = Stretches(recording, self)  # the blocks traced as they are (``outlining.py``)
        self._original = None
        self._counts = collections.Counter(map(type, self.modules))  # how many modules of each class
        self._wrapping: set[int] = set()  # ids of the modules :meth:`_wraps_repeats` was asked about

    def __enter__(self) -> RepeatedBlocks:
        self._original = torch.nn.Module.__call__
        original, blocks = self._original, self

        def call(module, /, *args, **kwargs):
            return blocks.call(original, module, args, kwargs)

        torch.nn.Module.__call__ = call
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.Module.__call__ = self._original
        self.stretches.layers.blocks = None  # (read only while tracing: a cycle would keep the recording)

    def call(self, original, module, args: tuple, kwargs: dict):
        if (
            self.recording_depth
            or module is self.root
            or id(module) not in self.paths
            or self.recording.dtensor_calls
            or any(getattr(torch.nn.modules.module, table) for table in GLOBAL_HOOKS)
            # (a replayed block's backward reads what it saved itself, never what the hooks
            # give back: activation checkpointing's recomputed values)
            or (saved_tensors_hooks() is not None and torch.is_grad_enabled())
        ):
            return original(module, *args, **kwargs)
        key = arguments_key(args, kwargs)
        if key is None:  # (a Hugging Face decoder layer: it takes the KV cache object)
            return self.stretches.traced(module, self.paths[id(module)], lambda: original(module, *args, **kwargs))
        templates = self.templates.get(type(module), ())
        with torch._C.DisableTorchFunction():  # metadata reads only: not the annotator's to see
            template = next((t for t in templates if t.key == key and same_blocks(t.state, module)), None)
        if template is not None:
            replayed = NOT_REPLAYED if template.refused is not None else self._replay(template, module, args, kwargs)
            if replayed is not NOT_REPLAYED:
                self.replayed.setdefault(self.paths[id(template.module)], []).append(self.paths[id(module)])
                return replayed
            return self.stretches.traced(module, self.paths[id(module)], lambda: original(module, *args, **kwargs))
        if not templates and self._wraps_repeats(module, args, kwargs):  # (a model's body, under its head)
            return self.stretches.traced(module, self.paths[id(module)], lambda: original(module, *args, **kwargs))
        alike = [t for t in templates if t.key == key]
        tensors = tensors_key(module) if alike else None
        if alike and (len(alike) >= TEMPLATES_PER_KEY or any(t.tensors == tensors for t in alike)):
            # Another block of this class and arguments and tensors, that differs (a layer's
            # index): traced as it is, so that its submodules can be replayed. One of other
            # tensors (a layer's k_proj beside its q_proj) becomes a template of its own.
            return self.stretches.traced(module, self.paths[id(module)], lambda: original(module, *args, **kwargs))
        template = BlockTemplate(module, key, block_state(module), tensors if alike else tensors_key(module))
        self.templates.setdefault(type(module), []).append(template)
        out = self._record(template, original, module, args, kwargs)
        if template.refused is not None:
            self.stretches.recorded(module, self.paths[id(module)], template.symbols)
        return out

    def _wraps_repeats(self, module, args: tuple, kwargs: dict) -> bool:
        """Whether ``module`` is traced as it is, so that its blocks are replayed: the one of
        its class in the tree, at its first call (a later one is recorded), holding several
        blocks of one class. Not with gradients: a replayed block's input gradient adds what
        reaches it from outside the block in another order than eager's (last bits)."""
        if self._counts[type(module)] > 1 or id(module) in self._wrapping:
            return False
        self._wrapping.add(id(module))
        leaves = [*module.parameters(), *tree_flatten((args, kwargs))[0]]
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
            return False
        return max(collections.Counter(type(m) for m in module.modules() if m is not module).values(), default=0) > 1

    def notes(self) -> list[str]:
        """The trace's header lines on what was replayed."""
        lines = []
        for first, later in self.replayed.items():
            shown = ", ".join(later[:3]) + (", ..." if len(later) > 3 else "")
            lines.append(f"{first} recorded once, replayed for {len(later)} more ({shown})")
        for template in (t for templates in self.templates.values() for t in templates if t.replayed):
            if template.program is not None:
                program = template.program
                lines.append(f"{program.name}: one program for {program.source} and the blocks replayed from it")
            if template.forward_program is not None:
                program = template.forward_program
                lines.append(f"{program.name}: one forward program for the blocks replayed from {program.source}")
                backwards = [b for b in template.backward_programs.values() if b is not None]
                lines += [f"{backward.name}: their backward, one program" for backward in backwards]
        return lines

    def _record(self, template: BlockTemplate, original, module, args: tuple, kwargs: dict):
        recording = self.recording
        start = len(recording.bound_symbols)
        counts = recording_counts(recording)
        template.python_state = held = Held(python_state(module), module)
        flat_args, treespec = tree_flatten((args, kwargs))
        specs = [(leaf, leaf._spec) for leaf in flat_args if isinstance(leaf, DTensor)]
        before = versions(flat_args)
        self.recording_depth += 1
        try:
            out = original(module, *args, **kwargs)
        finally:
            self.recording_depth -= 1
        template.writes = writes(before, versions(flat_args)), _writes_to_made(flat_args, tree_flatten(out)[0])
        template.symbols = recording.bound_symbols[start:]
        template.refused = (
            "it changed the recording's other state"
            if recording_counts(recording) != counts
            else "it changed Python state it can read"
            if held.changed()
            else "it changed an argument's placements"
            if any(leaf._spec is not spec for leaf, spec in specs)
            else "it changed a container it received"
            if arguments_changed(args, kwargs, flat_args, treespec)
            else identity_read(module, held.containers, self.modules, self.tensors) or unreplayable(template.symbols)
        )
        if template.refused is None:
            template.refused = self._describe(template, module, flat_args, out)
        if template.refused is None:
            path = self.paths[id(module)]
            template.program = block_program(template, template.free, path, self.program_names)
            if template.grad_outputs:
                programs = training_programs(template, path, self.program_names)
                if programs is not None:
                    template.forward_program = programs[0]
                    template.backward_programs[next(iter(template.backwards))] = programs[1]
        return out

    def _describe(self, template: BlockTemplate, module, flat_args: list, out) -> str | None:
        """The template's free proxies' sources and its output's description; or why it
        cannot be replayed. ``flat_args``: the arguments' leaves as the call received them."""
        defined: set[str] = set()
        free: dict[str, TensorProxy] = {}
        for bsym in template.symbols:
            for proxy in bsym.input_proxies():
                if proxy.label not in defined:
                    if not isinstance(proxy, TensorProxy):
                        return f"it reads {proxy.label}, a number from outside it"
                    free.setdefault(proxy.label, proxy)
            defined.update(p.label for p in bsym.output_proxies())
        sources: dict[str, list] = {}
        for name, value in named_tensors(module):
            proxy = local_proxy(value)
            if proxy is not None:
                sources.setdefault(proxy.label, []).append(("module", name))
        for index, leaf in enumerate(flat_args):
            proxy = local_proxy(leaf)
            if proxy is not None:
                sources.setdefault(proxy.label, []).append(("arg", index))
        template.sources = {}
        for label, proxy in free.items():
            if label not in sources:
                return f"it reads {label}, a tensor neither its own nor an argument"
            if proxy.value is not None:
                return f"it reads {label}, whose value tracing knows"
            template.sources[label] = sources[label]
        template.free = free
        flat_out, spec = tree_flatten(out)
        if holds_size(spec):
            return "it returns a torch.Size (torch's pytree rebuilds a tuple)"
        described = []
        arg_ids = {id(leaf): index for index, leaf in enumerate(flat_args)}
        training = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in flat_out)
        for leaf in flat_out:
            if isinstance(leaf, torch.Tensor):
                local = local_proxy(leaf)
                if local is None:
                    return "it returns a tensor that is not traced"
                if user_attributes(leaf):
                    return "it returns a tensor with attributes of its own"
                if leaf.requires_grad and not torch.is_grad_enabled():  # (made again, no view autograd knows)
                    return "it returns a view that requires grad without gradients (bias.expand_as(x))"
                if id(leaf) in arg_ids:
                    if training:
                        return "it returns an argument, in a call that needs gradients"
                    described.append(("arg", arg_ids[id(leaf)]))
                elif local.label not in defined and local.label not in template.sources:
                    return "it returns a tensor from outside it"
                elif isinstance(leaf, DTensor):
                    if holds_data(leaf._spec):
                        return "it returns a DTensor whose placement holds the call's data (an embedding's mask)"
                    described.append(("dtensor", local, leaf._spec))
                else:
                    described.append(("tensor", local))
            elif type(leaf) in SCALARS or isinstance(leaf, torch.SymInt):
                described.append(("value", leaf))
            else:
                return f"it returns a {type(leaf).__name__}"
        template.output = (spec, described)
        template.aliases = aliases_of(template.symbols)
        if training:
            return self._with_gradients(template, module, flat_args, flat_out, free)
        return None

    def _with_gradients(self, template: BlockTemplate, module, flat_args: list, flat_out: list, free: dict):
        """A template for calls that need gradients: which outputs and which of the block's
        values require grad, and the backward for cotangents like the outputs; or why not."""
        free_labels = set(free)
        for bsym in template.symbols:
            if bsym.op._schema.is_mutable and any(p.label in free_labels for p in bsym.input_proxies()):
                return "it changes a tensor in place, in a call that needs gradients"
        template.grad_outputs = [i for i, x in enumerate(flat_out) if isinstance(x, torch.Tensor) and x.requires_grad]
        template.grad_output_values = [flat_out[i] for i in template.grad_outputs]
        # Outputs that share memory with each other or with the block's inputs: an in-place
        # change of one after the block reaches the others' gradients in eager, through
        # views autograd tracks; the Function's outputs are not such views.
        storages = [local_proxy(x).memory for x in flat_out if isinstance(x, torch.Tensor)]
        inputs = {p.memory for p in free.values()}
        if len(set(storages)) != len(storages) or inputs & set(storages):
            return "its outputs share memory with each other or its inputs, in a call that needs gradients"
        seen: set[int] = set()
        candidates = [(("module", n), v) for n, v in named_tensors(module)]
        candidates += [(("arg", i), v) for i, v in enumerate(flat_args)]
        for source, value in candidates:
            if isinstance(value, torch.Tensor) and value.requires_grad and id(value) not in seen:
                seen.add(id(value))
                template.grad_input_sources.append(source)
                template.grad_input_values.append(value)
        if inputs_depend(template.grad_input_values):
            return "its inputs that need gradients depend on each other (a backward takes them as independent)"
        try:
            backward = backward_template(self.recording, template.grad_output_values, template.grad_input_values, None)
        except BlockReplayFailed as error:
            return f"its backward: {error}"
        template.backwards[backward.key] = backward
        # The block's inputs and outputs its backward reads: a later block's are checked to
        # be unchanged when its backward runs, as autograd checks the tensors it saved.
        # (By storage: autograd saves an output as a detached alias of it.)
        read = {p.memory for bsym in backward.symbols for p in bsym.input_tensors()}
        template.saved_sources = [s for label, s in template.sources.items() if free[label].memory in read]
        template.saved_outputs = [
            i for i, x in enumerate(flat_out) if isinstance(x, torch.Tensor) and local_proxy(x).memory in read
        ]
        return None

    def _replay(self, template: BlockTemplate, module, args: tuple, kwargs: dict):
        recording = self.recording
        with torch._C.DisableTorchFunction():  # metadata reads and a call symbol: nothing for the annotator
            if template.python_state.changed():
                return NOT_REPLAYED  # the code changed Python state the first block read, since
            flat_args, _ = tree_flatten((args, kwargs))
            held = dict(named_tensors(module))
            mapping = template.sources_in(held, flat_args)
            if mapping is None:
                return NOT_REPLAYED
            if template.program is not None and not template.replayed and not first_call(recording, template.program):
                template.program = None  # the first block becomes a call too, now that it repeats; else none does
            if template.program is not None:
                template.replayed = True
                call_again(recording, template.program, mapping)
                return _written(recording, template, flat_args, self._outputs(template, mapping, flat_args))
        base, names = len(recording.bound_symbols), recording.names_given()

        def forward():
            if template.forward_program is not None:
                template.replayed = True
                call_again(recording, template.forward_program, mapping)
            else:
                with torch._C.DisableTorchFunction():  # no torch-level call runs: nothing for the annotator
                    record_again(recording, template.symbols, template.aliases, mapping)
            return mapping, self._outputs(template, mapping, flat_args)

        try:
            if not template.grad_outputs:
                return _written(recording, template, flat_args, forward()[1])
            inputs = template.grad_inputs_in(held, flat_args)
            if inputs is None:
                return NOT_REPLAYED
            saved = [
                held[where] if kind == "module" else flat_args[where]
                for sources in template.saved_sources
                for kind, where in sources[:1]
            ]
            return _written(
                recording,
                template,
                flat_args,
                GradReplay(recording, template, forward, inputs, saved, self.program_names).apply(),
            )
        except (ReplayDiverged, ValueError):
            del recording.bound_symbols[base:]
            recording.forget_names_since(names)
            return NOT_REPLAYED

    @staticmethod
    def _outputs(template: BlockTemplate, mapping: dict, flat_args: list) -> list:
        """The later block's output leaves, described by the template."""
        result = []
        for entry in template.output[1]:
            kind = entry[0]
            if kind == "arg":
                result.append(flat_args[entry[1]])
            elif kind == "dtensor":
                result.append(make_dtensor(mapping[entry[1].label], copy.copy(entry[2]), requires_grad=False))
            elif kind == "tensor":
                result.append(mapping[entry[1].label])
            else:
                result.append(entry[1])
        return result


def _writes_to_made(flat_args: list, flat_out: list) -> list:
    """:func:`writes` to the output tensors a block made (``h = f(x); h += x``), since made."""
    received = {id(leaf) for leaf in flat_args}
    after = versions(flat_out)
    made = [None if v is None or id(leaf) in received else (0, v[1] and 0) for leaf, v in zip(flat_out, after)]
    return writes(made, after)


def _written(recording, template: BlockTemplate, flat_args: list, flat_out: list):
    """A replayed block's output, its first call's writes counted on its tensors (``_version``),
    those it made noted as made again."""
    to_args, to_made = template.writes
    count_writes(flat_args, to_args)
    count_writes(flat_out, to_made)
    received = {id(leaf) for leaf in flat_args}
    made_again(recording, [leaf for leaf in flat_out if id(leaf) not in received])
    return tree_unflatten(flat_out, template.output[0])
