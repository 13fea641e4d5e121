"""The nvFuser backend: a fusion program as an ``nvfuser_direct`` FusionDefinition.

nvFuser is imported only when CUDA is available (it links libtorch_cuda and fails to
import with a CPU build of torch), and only when a fusion is first needed. Each
primitive of the program is the ``fd.ops`` op of the same name; inputs are defined with
the contiguity and stride order the program records (symbolic sizes, -1, except size-1
broadcast dims), and outputs are given their stride order with ``fd.ops.stride_order``.

Not yet run on a GPU from this repository (see docs/design.md, "nvFuser executor").
"""

from __future__ import annotations

import functools

import torch

from .layout import stride_order
from .program import BINARY, UNARY, FusionProgram, NumberInput, Ref

name = "nvfuser_direct"


@functools.cache
def available() -> tuple[bool, str]:
    """Whether nvFuser can run here, and why (not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False); nvFuser was not imported"
    try:
        import nvfuser_direct  # noqa: F401
    except Exception as error:  # any failure to load the extension means: not available
        return False, f"nvfuser_direct failed to import: {type(error).__name__}: {error}"
    return True, f"nvfuser_direct {getattr(nvfuser_direct, '__version__', '')}".strip()


def supports_device(device) -> bool:
    return torch.device(device).type == "cuda"


def data_type(dtype: torch.dtype):
    """nvFuser's DataType of a torch dtype."""
    from nvfuser_direct.pytorch_utils import torch_dtype_to_nvfuser_dtype

    return torch_dtype_to_nvfuser_dtype(dtype)


def define(fd, program: FusionProgram) -> dict[str, object]:
    """Define ``program`` in the FusionDefinition ``fd``; return nvFuser's value for each
    of the program's values, by name."""
    from nvfuser_direct import DataType

    env: dict[str, object] = {}
    scalar_types = {"int": DataType.Int, "float": DataType.Double, "bool": DataType.Bool}

    def arg(value):
        if isinstance(value, Ref):
            return env[value.name]
        if isinstance(value, (list, tuple)):
            return [arg(v) for v in value]
        return value

    for item in program.inputs:
        if isinstance(item, NumberInput):
            env[item.name] = fd.define_scalar(dtype=scalar_types[item.kind])
            continue
        env[item.name] = fd.define_tensor(
            shape=[1 if b else -1 for b in item.broadcast],
            contiguity=list(item.contiguity),
            dtype=data_type(item.dtype),
            stride_order=list(item.stride_order),
        )
    for op in program.ops:
        p, args = op.primitive, [arg(a) for a in op.args]
        if p in UNARY or p in BINARY or p in ("where", "matmul", "set", "permute", "squeeze"):
            env[op.out] = getattr(fd.ops, p)(*args)
        elif p == "cast":
            env[op.out] = fd.ops.cast(args[0], data_type(op.args[1]))
        elif p in ("sum", "max", "min"):
            env[op.out] = getattr(fd.ops, p)(args[0], args[1], args[2])
        elif p in ("broadcast", "reshape", "expand"):
            env[op.out] = getattr(fd.ops, p)(args[0], args[1])
        elif p == "size":
            env[op.out] = fd.ops.size(args[0], args[1])
        elif p == "full":
            env[op.out] = fd.ops.full(args[0], args[1], data_type(op.args[2]))
        else:
            raise NotImplementedError(f"nvfuser_direct backend: no primitive {p}")
    for out in program.outputs:
        value = env[out.value]
        if list(out.order) != sorted(out.order):  # not row-major: ask for the traced layout
            value = fd.ops.stride_order(value, list(stride_order(out.order)))
        fd.add_output(value)
    return env


class NvFuserFusion:
    """A FusionDefinition built once; nvFuser caches its kernels per input shape."""

    def __init__(self, program: FusionProgram):
        from nvfuser_direct import FusionDefinition

        with FusionDefinition() as fd:
            define(fd, program)
        self.fd = fd
        self.source = str(fd)

    def __call__(self, inputs):
        return self.fd.execute(list(inputs))


def compile(program: FusionProgram) -> NvFuserFusion:
    return NvFuserFusion(program)
