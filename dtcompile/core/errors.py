"""The errors a trace can raise while it is being recorded."""


class TracingError(RuntimeError):
    """The traced program does something dtcompile cannot record."""


def data_dependent_error(call: str | None, what: str) -> TracingError:
    """The refusal of a value that depends on tensor data: ``what`` (``a Python number
    read by aten._local_scalar_dense``), asked for by the torch-level ``call`` of the
    user's code (``Tensor.item``, ``Tensor.__getitem__``), None where it is not known."""
    return TracingError(
        f"dtcompile.jit: {call or 'the program'} depends on the values in a tensor ({what}); dtcompile "
        "traces shapes, not values: .item(), .tolist() and Python control flow on tensor data are not "
        'supported; ops whose output shape depends on the data (boolean masks, nonzero) need cache="symbolic values"'
    )
