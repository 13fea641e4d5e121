"""Which code is the user's, and what a code object names.

Python state is guarded only where user code can read it (``python_state.py``): library
code (torch, transformers, the standard library, site-packages) is not followed, and what a
user function reads is found from its bytecode.
"""

from __future__ import annotations

import dis
import gc
import sys
import types

from ..core.code_origin import library_code


def is_library(obj: object) -> bool:
    """Whether a function, class or Python module is library code, whose reads are not
    guarded."""
    if isinstance(obj, types.ModuleType):
        module = obj.__name__
    else:
        module = getattr(obj, "__module__", None) or ""
    code = getattr(obj, "__code__", None)
    if isinstance(code, types.CodeType):  # (the class of functions has a descriptor there)
        filename = code.co_filename
    else:
        filename = getattr(sys.modules.get(module), "__file__", None) or ""
    return library_code(module, filename)


def class_namespace(cls: type) -> dict:
    """The dict behind ``cls.__dict__`` (a read-only view): the prologue reads names from
    it with ``dict.get`` like an instance's, and ``setattr(cls, ...)`` changes it in place.
    The view's only referent is that dict."""
    (names,) = gc.get_referents(vars(cls))
    return names


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})


def code_names(code: types.CodeType) -> tuple[set[str], set[str], set[str], set[str]]:
    """The global names a code object and the functions nested in it load, the Python
    modules they import (``import cfg`` inside a function), the other names they use
    (attributes: ``cfg.SCALE``), and the attribute names they may read (loaded, or a
    string constant: ``getattr(self, "pos")``). Told apart by the bytecode, so that an
    attribute (``out.sum``) does not guard a global of that name (a loop's ``out``)."""
    global_names, imported, other = set(), set(), set(code.co_names)
    loaded = {const for const in code.co_consts if isinstance(const, str)}
    for instruction in dis.get_instructions(code):
        if instruction.opname in _GLOBAL_LOADS:
            global_names.add(instruction.argval)
        elif instruction.opname == "IMPORT_NAME":
            imported.add(instruction.argval)
        elif instruction.opname in _ATTRIBUTE_LOADS:
            loaded.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner = code_names(const)
            for names, more in zip((global_names, imported, other, loaded), inner):
                names |= more
    return global_names, imported, other - global_names, loaded
