"""From aten ops of a per-rank trace to the primitives of a fusion program: which ops a
fusion covers (``translatable``) and a region's program (``translate``).

``program_builder.py`` holds how one program is built (the ``Translator``) and the
registry of translations; the ``ops_*`` modules register a translation for each aten op,
with an optional check of its arguments: an op whose arguments the translation does not
cover is left to the next executor, which makes it a region boundary.
"""

from __future__ import annotations

from ...core import BoundSymbol, TensorProxy
from . import ops_pointwise, ops_reductions  # noqa: F401  (they register their translations)
from .ops_shapes import MATMUL_OPS, VIEWS
from .program import FusionProgram
from .program_builder import HANDLERS, SUPPORTED_DTYPES, Translator

__all__ = ["MATMUL_OPS", "VIEWS", "translatable", "translate"]


def translatable(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` is an op the translation covers, with arguments it covers."""
    entry = HANDLERS.get(bsym.op)
    if entry is None:
        return False
    tensors = bsym.input_tensors() + bsym.output_tensors()
    if not bsym.output_tensors() or any(t.dtype not in SUPPORTED_DTYPES for t in tensors):
        return False
    _, check = entry
    return check is None or check(bsym)


def translate(region: list[BoundSymbol], outputs: list[TensorProxy]) -> tuple[FusionProgram, list[str]]:
    """The fusion program of ``region`` returning ``outputs``, and the labels of the trace
    values it takes as inputs, in order."""
    t = Translator()
    for bsym in region:
        fn, _ = HANDLERS[bsym.op]
        results = fn(t, bsym)
        proxies = bsym.output if isinstance(bsym.output, (tuple, list)) else (bsym.output,)
        results = results if isinstance(results, (tuple, list)) else (results,)
        for proxy, ref in zip(proxies, results):
            if isinstance(proxy, TensorProxy) and ref is not None:
                t.bind(proxy, ref)
    for proxy in outputs:
        t.output(proxy)
    return t.program, t.input_labels
