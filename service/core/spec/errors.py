"""How spec validation errors are worded: locations under ``body`` and unknown fields with
the closest valid name (``did you mean 'nproc_per_node'?``), or the dotted path of a nested
field of that name (``did you mean 'resources.timeout_min'?``)."""

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


# Sub-models searched for a nested field's name (the spec's sections are one level deep).
_MAX_HINT_DEPTH = 3


def _nested_paths(model: type[BaseModel], prefix: str = "", depth: int = 0) -> list[str]:
    """Dotted paths of the fields inside ``model``'s sub-models (``resources.timeout_min``,
    ``training.lr``), in field order; its own top-level fields are not among them."""
    paths: list[str] = []
    if depth >= _MAX_HINT_DEPTH:
        return paths
    for name, info in model.model_fields.items():
        inner = _unwrap_model(info.annotation)
        if inner is None:
            continue
        path = f"{prefix}{name}"
        paths += [f"{path}.{field}" for field in inner.model_fields]
        paths += _nested_paths(inner, f"{path}.", depth + 1)
    return paths


def _nested_hint(model: type[BaseModel], name: str) -> list[str]:
    """Dotted paths of nested fields called ``name`` (``timeout_min`` →
    ``resources.timeout_min``), else of the one nested field closest to it."""
    paths = _nested_paths(model)
    exact = [p for p in paths if p.rsplit(".", 1)[-1] == name]
    if exact:
        return exact
    leaves = {p.rsplit(".", 1)[-1]: p for p in reversed(paths)}  # first path of each name
    close = difflib.get_close_matches(name, leaves, n=1, cutoff=0.6)
    return [leaves[close[0]]] if close else []


def _did_you_mean(paths: list[str]) -> str:
    return "did you mean " + " or ".join(repr(p) for p in paths) + "?"


def unknown_field_message(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """Pydantic's "extra inputs" message for ``loc`` plus a hint: the closest valid field
    (``did you mean 'nproc_per_node'?``); at the top level, a nested field of that very name
    comes first (``timeout_min`` → ``did you mean 'resources.timeout_min'?``), then a close
    top-level name, then a close nested one; failing all, the list of valid fields."""
    message = "Extra inputs are not permitted"
    if not loc:
        return message
    valid = _fields_at(model, loc[:-1])
    if not valid:
        return message
    name = str(loc[-1])
    nested = _nested_hint(model, name) if len(loc) == 1 else []
    exact_nested = [p for p in nested if p.rsplit(".", 1)[-1] == name]
    if exact_nested:
        return f"{message}: {_did_you_mean(exact_nested)}"
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    if close:
        return f"{message}: {_did_you_mean(close)}"
    if nested:
        return f"{message}: {_did_you_mean(nested)}"
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
