"""Dotted-path overrides of a job spec (``training.lr=0.01``): the one place that reads a
path, applies it to a spec dict, and parses a ``--set`` value. Sweep axes and
``ddpq submit --set`` share it, so a path means the same thing in both."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import yaml

from service.core.errors import DdpqError

# One path segment: a field name (letters, digits, _ and -), or a list index (``command.1``).
_SEGMENT_RE = re.compile(r"^[A-Za-z_][\w-]*$")
_INDEX_RE = re.compile(r"^(0|[1-9]\d{0,5})$")
MAX_PATH_CHARS = 200
MAX_PATH_DEPTH = 8


class OverridePathError(DdpqError):
    """A dotted path that cannot address a field of the spec (HTTP 422)."""

    status_code = 422
    code = "invalid_override_path"

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path!r}: {message}")


def split_path(path: str) -> list[str]:
    """``"training.lr"`` → ``["training", "lr"]``; ``"command.1"`` → ``["command", "1"]``
    (an index: only a list's items have one, which ``apply_overrides`` checks).

    Raises:
        OverridePathError: empty, too long or too deep, or a segment that is neither a field
            name nor an index after one (``training..lr``, ``1.lr``).
    """
    if not path or len(path) > MAX_PATH_CHARS:
        raise OverridePathError(path, f"a path is 1–{MAX_PATH_CHARS} characters, e.g. training.lr")
    parts = path.split(".")
    if len(parts) > MAX_PATH_DEPTH:
        raise OverridePathError(path, f"at most {MAX_PATH_DEPTH} levels deep")
    for i, part in enumerate(parts):
        if not _SEGMENT_RE.match(part) and not (i and _INDEX_RE.match(part)):
            raise OverridePathError(
                path,
                f"segment {part!r} is not a field name; write fields joined by dots, "
                "e.g. training.lr or config.hidden",
            )
    return parts


def apply_overrides(spec: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``spec`` with each ``{dotted.path: value}`` set; missing sections
    (``slurm``, ``config``) are created. Whether the field exists is the spec validation's
    call (it names unknown fields with the closest valid one).

    Raises:
        OverridePathError: a bad path, or one that runs through a value that is not an
            object (``name.x`` where ``name`` is text).
    """
    result: dict[str, Any] = copy.deepcopy(dict(spec))
    for path, value in overrides.items():
        parts = split_path(path)
        node: dict[str, Any] | list[Any] = result
        for i, part in enumerate(parts[:-1]):
            child = _child(node, part, path, ".".join(parts[:i]))
            if child is None and isinstance(node, dict):
                child = node[part] = {}
            elif not isinstance(child, dict | list):
                where = ".".join(parts[: i + 1])
                raise OverridePathError(
                    path, f"{where} is {type(child).__name__}, not an object: it has no fields"
                )
            node = child
        _child(node, parts[-1], path, ".".join(parts[:-1]))  # an index must exist already
        if isinstance(node, list):
            node[int(parts[-1])] = copy.deepcopy(value)
        else:
            node[parts[-1]] = copy.deepcopy(value)
    return result


def _child(node: dict[str, Any] | list[Any], part: str, path: str, where: str) -> Any:
    """``node[part]`` (None when a field is absent).

    Raises:
        OverridePathError: an index into an object, a field of a list, or an index past the
            list's end (a list keeps its length: ``command.2`` replaces the third item).
    """
    is_index = part.isdigit()
    if isinstance(node, list):
        if not is_index:
            raise OverridePathError(path, f"{where} is a list: address an item by its index")
        if int(part) >= len(node):
            raise OverridePathError(
                path, f"{where} has {len(node)} item(s), 0–{len(node) - 1}; index {part} is past it"
            )
        return node[int(part)]
    if is_index:
        raise OverridePathError(
            path, f"segment {part!r} is not a field name; write fields joined by dots, "
            "e.g. training.lr or config.hidden (an index addresses a list's item: command.1)",
        )  # fmt: skip
    return node.get(part)


def parse_assignment(text: str) -> tuple[str, Any]:
    """``"training.lr=0.01"`` → ``("training.lr", 0.01)``: the value is read as one YAML
    scalar or flow value (``64`` int, ``1e-3`` float, ``true``, ``null``, ``[a, b]``,
    ``adamw`` text).

    Raises:
        OverridePathError: no ``=``, a bad path, or a value YAML cannot read.
    """
    path, sep, raw = text.partition("=")
    path = path.strip()
    if not sep:
        raise OverridePathError(text, "write PATH=VALUE, e.g. --set training.lr=0.01")
    split_path(path)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise OverridePathError(path, f"value {raw!r} is not YAML/JSON: {exc}") from None
    if isinstance(value, str) and _looks_like_float(value):
        value = float(value)  # YAML 1.1 reads 1e-3 as text; people mean the number
    return path, value


_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _looks_like_float(text: str) -> bool:
    return bool(_FLOAT_RE.match(text.strip()))
