"""How spec validation errors are worded: locations under ``body`` and unknown fields with
the closest valid name (``did you mean 'nproc_per_node'?``)."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from service.core.spec.text import display_text


def error_loc(parts: tuple[int | str, ...]) -> list[int | str]:
    """An error's ``loc`` as the API reports it: under ``body``, strings made printable."""
    return ["body", *(display_text(p) if isinstance(p, str) else p for p in parts)]


def _unwrap_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``annotation`` (``Resources``, ``SlurmOptions | None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _unwrap_model(arg)
        if found is not None:
            return found
    return None


def _fields_at(model: type[BaseModel], path: tuple[int | str, ...]) -> list[str]:
    """Field names of the model that holds ``path`` (``("resources",)`` → Resources')."""
    for part in path:
        info = model.model_fields.get(str(part))
        inner = _unwrap_model(info.annotation) if info is not None else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def unknown_field_message(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """Pydantic's "extra inputs" message for ``loc`` plus a hint: the closest valid field
    (``did you mean 'nproc_per_node'?``) or, failing that, the list of valid fields."""
    message = "Extra inputs are not permitted"
    if not loc:
        return message
    valid = _fields_at(model, loc[:-1])
    if not valid:
        return message
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
    if close:
        return f"{message}: did you mean {close[0]!r}?"
    return f"{message}; valid fields: {', '.join(valid)}"


def pydantic_errors(
    exc: ValidationError, model: type[BaseModel], prefix: tuple[int | str, ...] = ()
) -> list[dict[str, Any]]:
    """``exc`` as ``{loc, msg, type}`` entries under ``prefix``, unknown fields with a hint."""
    errors = []
    for e in exc.errors(include_url=False, include_context=False, include_input=False):
        loc = tuple(e["loc"])
        msg = unknown_field_message(model, loc) if e["type"] == "extra_forbidden" else e["msg"]
        errors.append({"loc": error_loc((*prefix, *loc)), "msg": msg, "type": e["type"]})
    return errors
