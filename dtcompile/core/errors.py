"""The errors a trace can raise while it is being recorded."""


class TracingError(RuntimeError):
    """The traced program does something dtcompile cannot record.

    While a call is traced, each one made is kept in ``made``: the user's code may catch
    it (``except Exception``, a ``logging`` handler) and go on another way, which the
    compiled call would then take at every call, so the tracer raises the first kept once
    the traced code returns (``capture/method_checks.effects_refused``)."""

    made: list | None = None  # a list while a call is traced

    def __init__(self, *args):
        super().__init__(*args)
        if TracingError.made is not None:
            TracingError.made.append(self)


class SymbolsRefused(RuntimeError):
    """DTensor could not run an op with symbolic sizes (a tensor operator it gave
    NotImplemented, which Python would answer with its fallback): the call is traced again
    with its sizes as they are (``tracer.capture_call``)."""


class DataCheckFailed(Exception):
    """A compiled program's check of a branch it traced on tensor data failed: the call
    takes another branch, so it goes to another cache entry, or is traced again (raised
    before the program has done anything)."""


def data_dependent_error(call: str | None, what: str) -> TracingError:
    """The refusal of Python code that needs a value from tensor data while tracing:
    ``what`` (``Python control flow on u0``), asked for by the torch-level ``call`` of the
    user's code (``Tensor.__bool__``, ``Tensor.numpy``), None where it is not known."""
    return TracingError(
        f"dtcompile.jit: {call or 'the program'} depends on the values in a tensor ({what}); dtcompile "
        "traces shapes, not values: numbers read with .item() or .tolist() and ops whose sizes come from the "
        "data (boolean masks, nonzero, split sizes) are computed at run time, and Python control flow on "
        "them (if, bool(), int(), while) is traced as taken and checked at run time where tracing can "
        "compute the value, not here (nor data leaving torch, NumPy); use torch.where, or compile the code "
        "before and after the branch separately"
    )
