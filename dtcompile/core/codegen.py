"""Compiling generated Python source, with the source kept for tracebacks."""

from __future__ import annotations

import itertools
import linecache
import re
import weakref

import torch

from .printing import Unprintable, python_literal
from .symbolic import SYMBOLIC_TYPES

_ids = itertools.count()


def compile_function(source: str, fn_name: str, namespace: dict):
    """Define ``fn_name`` by running ``source`` in ``namespace``; tracebacks show the source.

    The function is taken out of its namespace so that the two do not form a reference
    cycle: a compiled program, and the meshes and process groups its constants hold, is
    then freed as soon as its last user lets go of it, not at some later garbage
    collection (or at exit, where Gloo's threads die with the interpreter)."""
    filename = f"<dtcompile {fn_name} {next(_ids)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    fn = namespace.pop(fn_name)
    weakref.finalize(fn, linecache.cache.pop, filename, None)  # the source lives as long as the function
    return fn


_LITERAL_TYPES = {
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    torch.dtype,
    torch.layout,
    torch.memory_format,
    torch.device,
}


def _literal_keeps_type(obj: object) -> bool:
    """Whether ``obj``'s literal evaluates to an object of its very type: an IntEnum, a str
    subclass or a namedtuple prints as its base type's literal; and a nan, to be the same
    object (a dict's nan key is found by identity)."""
    if type(obj) in (list, tuple, torch.Size):
        return all(map(_literal_keeps_type, obj))
    if isinstance(obj, SYMBOLIC_TYPES):  # a size made a number: eager's is an int
        return True
    return type(obj) in _LITERAL_TYPES and obj == obj


def literal_or_global(obj: object, globals: dict[str, object], prefix: str) -> str:
    """Source for ``obj`` in generated code: its literal when it has one that gives an
    object of its type, else a name under which ``globals`` gives the code the object."""
    try:
        if _literal_keeps_type(obj):
            return python_literal(obj)
    except Unprintable:
        pass
    name = f"{prefix}{len(globals)}"
    globals[name] = obj
    return name


class GeneratedFunction:
    """A generated Python function that prints as its own source.

    ``globals`` maps each name the source uses to the object it is given; objects with
    no literal (a DTensorSpec, a module list) are listed as comments when printed.
    """

    def __init__(self, fn_name: str, lines: list[str], globals: dict[str, object], title: str = ""):
        self.fn_name = fn_name
        self.source = "\n".join(lines) + "\n"
        self.globals = globals
        self.title = title
        self.fn = compile_function(self.source, fn_name, dict(globals))

    def first_refusal(self, *args) -> str | None:
        """For a function of checks (``if ...: return None``, a prologue's guards): the
        condition of the first check that refuses ``args``, the names it binds written as
        what they were bound to (``args[1].__dict__['count'] != 0``); None where none does."""
        lines = self.source.splitlines()
        marked = [
            line[: -len(_REFUSAL)] + f": return {i}" if line.endswith(_REFUSAL) else line
            for i, line in enumerate(lines)
        ]
        refused = compile_function("\n".join(marked) + "\n", self.fn_name, dict(self.globals))(*args)
        if type(refused) is not int:
            return None
        bound = dict(re.findall(r"^\s+(\w+) = (.+)$", self.source, re.MULTILINE))
        bound = {name: value if re.fullmatch(r"[\w.\[\]']+", value) else f"({value})" for name, value in bound.items()}
        condition = lines[refused].strip().removeprefix("if ").removesuffix(_REFUSAL)
        for _ in range(8):  # (a name bound from names bound before)
            condition = re.sub(r"\b\w+\b", lambda m: bound.get(m[0], m[0]), condition)
        return condition

    def __str__(self) -> str:
        header = [f"# {self.title}"] if self.title else []
        header += [f"# {name}: {_short_repr(obj)}" for name, obj in self.globals.items()]
        return "\n".join(header) + "\n" + self.source


_REFUSAL = ": return None"


def _short_repr(obj: object) -> str:
    text = repr(obj).replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."
