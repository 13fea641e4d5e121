"""The private parts of torch that tracing wraps for a while (see ``torch_internals.py``):
where autograd takes calls (and DTensors) that no torch function mode sees, and torch's
Python kernels set aside. Each entry says why no public API serves."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def function_applies(swap):
    """While inside, ``swap`` maps each argument of every autograd Function's ``apply``
    (those behind ``DTensor.redistribute`` and ``to_local``/``full_tensor``, a user's
    Function given a DTensor), however the code reached it (a method, a reference made
    before). ``apply`` is no torch function, and no public hook sees its arguments."""
    base = torch.autograd.Function
    original = base.__dict__["apply"]  # a classmethod the subclasses inherit
    apply_function = original.__func__

    def apply(cls, /, *args, **kwargs):
        return apply_function(cls, *map(swap, args), **{name: swap(value) for name, value in kwargs.items()})

    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = original


@contextlib.contextmanager
def function_mode_on_in_grad(mode):
    """``mode`` on while ``torch.autograd.grad`` runs the backward (torch takes a mode off
    while the mode handles a call), and the call not handed to it again: ``grad`` asks
    ``has_torch_function``, looked up in its module at each call."""
    namespace = vars(torch.autograd)
    check = namespace["has_torch_function"]
    namespace["has_torch_function"] = _no_torch_function
    torch._C._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        torch._C._pop_torch_function_stack()
        namespace["has_torch_function"] = check


def _no_torch_function(relevant_args) -> bool:
    return False
