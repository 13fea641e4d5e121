"""Records a call returns whose items and attributes are two states: a Hugging Face
``ModelOutput`` (an ``OrderedDict`` and a dataclass). It is made anew from its items by its
constructor (transformers' pytree node), which sets each field's attribute to its item:
one whose items and attributes the code made to differ cannot be made so."""

from __future__ import annotations

import collections
import dataclasses

from ..core import TracingError


def refuse_unrebuildable_record(value: object, where: str) -> None:
    """Refuse a record holding a key that is no field (``out["custom"] = y``: the constructor
    takes no such argument) or a field whose attribute is not its item (``out.logits =
    None`` after it was set: the key stays, its attribute is None)."""
    if not (isinstance(value, collections.OrderedDict) and dataclasses.is_dataclass(value)):
        return
    fields = {f.name for f in dataclasses.fields(value)}
    odd = next((key for key in value if key not in fields), None)
    odd = odd or next((f for f in fields if getattr(value, f, None) is not value.get(f)), None)
    if odd is not None:
        raise TracingError(
            f"dtcompile.jit: {where} is a {type(value).__name__} whose item {odd!r} is no field or not its attribute "
            "(a key added that is no field, a field's attribute set apart from its item): made anew by its "
            "constructor, it would not be eager's. Return a dict, or set fields through the constructor"
        )
