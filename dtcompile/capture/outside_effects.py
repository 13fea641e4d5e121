"""What the traced code may call that acts outside tensors, refused while a call is
traced: a compiled program runs the Python code once, so such an effect would happen once,
while tracing, and what it returned would be a constant of the program.

- ``torch.utils.swap_tensors`` swaps what two tensor objects are;
- ``torch.compile`` (``torch.cond``'s, ``while_loop``'s) cannot trace inside a trace;
- a torch optimizer's ``step`` keeps its state in the optimizer;
- a c10d ``Store``'s methods (``store.add("step", 1)``, ``set``, ``get``, ``wait``, ...)
  read and write a key-value store shared by the ranks. Torch's own calls (a process group
  made inside the call: ``dist.new_group``) go on.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..core import TracingError
from ..core.code_origin import framework_code

_STORE_METHODS = (
    "set",
    "compare_set",
    "get",
    "add",
    "check",
    "delete_key",
    "num_keys",
    "wait",
    "append",
    "multi_get",
    "multi_set",
    "queue_push",
    "queue_pop",
    "queue_len",
    "list_keys",
    "barrier",
)


@contextlib.contextmanager
def outside_effects_refused():
    swap_impls, torch._C._swap_tensor_impl = torch._C._swap_tensor_impl, _swap_refused  # (torch.utils.swap_tensors)
    torch_compile, torch.compile = torch.compile, _compile_refused
    steps = register_optimizer_step_pre_hook(_optimizer_step_refused)
    store = dist.Store if dist.is_available() else None
    methods = {name: vars(store)[name] for name in _STORE_METHODS if name in vars(store)} if store else {}
    for name, method in methods.items():
        setattr(store, name, _store_method(name, method))
    try:
        yield
    finally:
        for name, method in methods.items():
            setattr(store, name, method)
        steps.remove()
        torch._C._swap_tensor_impl, torch.compile = swap_impls, torch_compile


def _store_method(name: str, method):
    def refused_from_user_code(self, *args, **kwargs):
        module = sys._getframe(1).f_globals.get("__name__", "")
        if not framework_code(module):
            raise TracingError(
                f"dtcompile.jit: the traced code calls {type(self).__name__}.{name}, a c10d store's key-value "
                "exchange: a compiled program runs the Python code once, so it would happen once, while tracing, "
                "and what it returned would be a constant of the program. Call the store outside the call"
            )
        return method(self, *args, **kwargs)

    return refused_from_user_code


def _swap_refused(*tensors):
    raise TracingError(
        "dtcompile.jit: the traced code calls torch.utils.swap_tensors, which swaps what two tensor objects are "
        "(their data, metadata and attributes): a compiled program cannot record that of the caller's objects. "
        "Copy the values instead (a.copy_(b)), or swap outside the call"
    )


def _compile_refused(*args, **kwargs):
    raise TracingError(
        "dtcompile.jit: the traced code calls torch.compile (torch.cond with a tensor predicate, torch.while_loop "
        "and flex_attention call it to run their functions in eager): torch's compiler cannot trace inside a "
        "dtcompile trace, and a failed attempt would stay in its caches. Call them outside the compiled call, or "
        "compile a torch.compile'd function outside it and call that"
    )


def _optimizer_step_refused(optimizer, args, kwargs):
    """A torch optimizer's step (before it runs: its global pre-hook)."""
    raise TracingError(
        f"dtcompile.jit: the traced code calls {type(optimizer).__name__}.step(), an optimizer step inside "
        "the call: its state (step counts, moments, buffers) lives in the optimizer, which a program traced "
        "once would hold traced tensors in, and torch.optim takes torch.compile's paths while traced, which "
        "round otherwise than eager's. Call the optimizer step outside the compiled function"
    )
