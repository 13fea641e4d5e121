"""Whose code a function or a frame runs: the user's, or a library's.

Python state is guarded only where the user's code can read it, and some behaviours
(sizes as text, a traced tensor turned into text) differ by who asks; one definition
serves them all.
"""

from __future__ import annotations

import sys
import sysconfig

_LIBRARIES = {"torch", "transformers", "dtcompile", "numpy", "accelerate", "safetensors", "triton", "sympy"}
_LIBRARY_PATHS = tuple(
    path for path in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} if path
)


def dtcompile_code(module: str) -> bool:
    """Whether Python module ``module`` is dtcompile's own code. ``dtcompile.testing`` (the
    models the tests and scripts run) is not: it is traced as the user's code is."""
    return (module == "dtcompile" or module.startswith("dtcompile.")) and not module.startswith("dtcompile.testing")


def framework_code(module: str) -> bool:
    """Whether Python module ``module`` is torch's or dtcompile's own code: what runs a
    torch-level call for them, not for the user (whose calls are recorded and guarded)."""
    return module == "torch" or module.startswith("torch.") or dtcompile_code(module)


def library_code(module: str, filename: str) -> bool:
    """Whether code of Python module ``module``, in file ``filename``, is library code:
    torch, transformers, dtcompile itself (but for ``dtcompile.testing``), the standard
    library, anything installed in site-packages."""
    if module.startswith("dtcompile.testing"):
        return False
    root = module.partition(".")[0]
    if root in _LIBRARIES or root in sys.stdlib_module_names:
        return True
    return "site-packages" in filename or "dist-packages" in filename or filename.startswith(_LIBRARY_PATHS)


def standard_library(module: str) -> bool:
    """Whether Python module ``module`` is the standard library's (``logging``, ``warnings``)."""
    return module.partition(".")[0] in sys.stdlib_module_names
