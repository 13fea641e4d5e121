"""A tensor that torch's own code made inside a call and restrides in place.

``torch.quantile``, ``nanquantile`` and ``stft`` run C++ code that makes a tensor and then
changes its sizes in place (``sorted.unsqueeze_(-1)``, ``out.transpose_(1, 2)``). A
proxy's metadata is fixed when it is made, which is why a traced tensor restrided in
place is refused (``fake_calls.refuse_metadata_changes``). But a tensor made inside the
torch-level call running now is held by that call's code alone, which goes on with the
same object: so the symbols recorded before keep its old self (a new proxy under the old
name), the object becomes a new symbol, the out-of-place view of the old
(``t5 = aten.unsqueeze(t4, -1)``), and its own sizes and strides are set to the new ones,
as eager's kernel sets them.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import BoundSymbol, NoProvenance, TensorProxy, aten_symbol
from ..core.symbol import backward_note, map_leaves

aten = torch.ops.aten

# Each in-place view op, and its out-of-place form.
_OUT_OF_PLACE = {
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
    aten.swapdims_.default: aten.transpose.int,
    aten.swapaxes_.default: aten.transpose.int,
}
_BACKENDS = {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA, "meta": torch._C.DispatchKey.Meta}


def restrided_in_call(recording, func, args: tuple, kwargs: dict) -> TensorProxy | None:
    """``func`` (an in-place view op) applied to a tensor the running torch-level call made,
    recorded as above; the tensor (the op's result). None where it is not such a call."""
    view = _OUT_OF_PLACE.get(func)
    proxy = args[0] if args else None
    if view is None or not _made_in_call(recording, proxy) or proxy.device.type not in _BACKENDS:
        return None
    symbols = recording.bound_symbols
    first = next(i for i in range(recording.call_start, len(symbols)) if _holds(symbols[i].output, proxy))
    with recording.fake_mode, torch._C.DisableTorchFunction():
        old = TensorProxy(
            proxy.fake.as_strided(proxy.shape, proxy.stride(), proxy.storage_offset()), proxy.label, proxy.provenance
        )
        func(proxy.fake, *args[1:], **kwargs)
        fake = proxy.fake
        sizes, strides, offset = fake.shape, fake.stride(), fake.storage_offset()
    swap = lambda x: old if x is proxy else x  # noqa: E731
    for i in range(first, len(symbols)):
        symbol = symbols[i]
        symbols[i] = dataclasses.replace(
            symbol,
            args=map_leaves(swap, symbol.args),
            kwargs=map_leaves(swap, symbol.kwargs),
            output=map_leaves(swap, symbol.output),
        )
    # The proxy's own metadata, set as eager's kernel sets a tensor's (its storage is the size of the fake's).
    backend = torch._C.DispatchKeySet(_BACKENDS[proxy.device.type])
    aten.as_strided_.default.redispatch(backend, proxy, sizes, strides, offset)
    proxy.label = recording.new_name()
    symbols.append(BoundSymbol(aten_symbol(view), (old, *args[1:]), dict(kwargs), proxy, backward_note(), op=view))
    return proxy


def _made_in_call(recording, proxy) -> bool:
    """Whether ``proxy`` was made by an op of the torch-level call running now (so that only
    that call's code holds it), and nothing else is known of it (a value, a gradient)."""
    if not isinstance(proxy, TensorProxy) or recording.current_call is None or recording.call_start is None:
        return False
    if proxy.value is not None or not isinstance(proxy.provenance, NoProvenance):
        return False
    symbols = recording.bound_symbols
    return any(_holds(symbols[i].output, proxy) for i in range(recording.call_start, len(symbols)))


def _holds(output, proxy) -> bool:
    if output is proxy:
        return True
    return isinstance(output, (tuple, list)) and any(_holds(x, proxy) for x in output)
