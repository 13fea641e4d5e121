"""The private parts of torch that tracing wraps for a while (see ``torch_internals.py``):
where DTensor and autograd take calls that no torch function mode sees. Each entry says
why no public API serves."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def dtensor_entry_points(swap):
    """While inside, ``swap(dtensor)`` is applied to the DTensor the autograd Functions of
    ``DTensor.redistribute`` and ``to_local``/``full_tensor`` get, however the code
    reached them (a method, ``functools.partial(DTensor.redistribute, w)`` made before).
    They are no torch functions, and no public hook sees their DTensor."""
    from torch.distributed.tensor._api import _ToTorchTensor
    from torch.distributed.tensor._redistribute import Redistribute

    patched = {}
    for function in (Redistribute, _ToTorchTensor):
        patched[function] = function.__dict__.get("apply")  # (inherited from Function: absent)

        def apply(cls, dtensor, *args, _apply=function.apply.__func__, **kwargs):
            return _apply(cls, swap(dtensor), *args, **kwargs)

        function.apply = classmethod(apply)
    try:
        yield
    finally:
        for function, original in patched.items():
            if original is None:
                del function.apply
            else:
                function.apply = original


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
