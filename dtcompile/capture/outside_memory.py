"""Tensors the traced code makes over memory outside torch: ``torch.from_numpy``,
``torch.frombuffer``, and ``torch.as_tensor``/``torch.asarray`` of a NumPy array they
share. Made by no torch op, such a tensor enters the trace as a constant, the memory of
the call traced; what eager does with it depends on whose memory it is:

- memory there before the call (a global array, a module's, an array viewing one): eager's
  tensor is that memory at every call. The program takes it as it is (``aten.alias`` of
  the constant), so its writes reach the array, its reads see the array's values now,
  and a tensor it returns is over the array;
- memory the call made (``np.zeros(2)`` inside it): new at each eager call. The program
  copies the constant at each call, as it does ``torch.tensor``'s data, so a write
  reaches no later call."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch
from torch.overrides import resolve_name
from torch.utils._python_dispatch import _disable_current_modes

_MAKERS = ("from_numpy", "frombuffer", "as_tensor", "asarray")
# torch names its functions (``resolve_name``, in refusals) from a table it builds once, at
# first use, from the ``torch`` namespace: built now, it holds torch's own, not the ones
# set in their place while tracing.
resolve_name(torch.as_tensor)


@contextlib.contextmanager
def outside_memory(existed):
    """While tracing, in the tracing thread: the makers above as the module docstring says.
    ``existed(obj)``: whether ``obj`` was there before the call (reached from what the code
    reads of Python state)."""
    thread, originals = threading.get_ident(), {name: getattr(torch, name) for name in _MAKERS}

    def maker(name):
        original = originals[name]

        def make(*args, **kwargs):
            source = args[0] if args else kwargs.get("buffer", kwargs.get("obj", kwargs.get("data")))
            outside = isinstance(source, np.ndarray) or name == "frombuffer"
            if threading.get_ident() != thread or not outside:
                return original(*args, **kwargs)
            with torch._C.DisableTorchFunction(), _disable_current_modes():
                made = original(*args, **kwargs)  # the tensor itself, over that memory
            if name in ("as_tensor", "asarray") and made.data_ptr() != source.__array_interface__["data"][0]:
                return original(*args, **kwargs)  # a copy (another dtype): eager's is new too
            if _there_before(source, existed):
                return torch.ops.aten.alias.default(made)
            return torch.ops.aten.lift_fresh_copy.default(made)

        return make

    for name in _MAKERS:
        setattr(torch, name, maker(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def _there_before(source, existed) -> bool:
    """Whether ``source`` or the object whose memory it views was there before the call."""
    while source is not None:
        if existed(source):
            return True
        source = source.base if isinstance(source, np.ndarray) else getattr(source, "obj", None)
    return False
