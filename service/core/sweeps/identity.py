"""A trial's identity from the values its job spec holds, not the values as sent.

JobSpec validation normalises what an override sets (``"16"`` or ``16.0`` where an integer is
expected becomes ``16``), so two different raw values can make the same job. A trial's key
is therefore computed from the validated spec's value at each override path; two trials of
one expansion with the same key are refused (422 naming the axis and the values), and a
bool that validation turned into a number (``true`` → ``1``) is refused as a typo.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from service.core.spec.model import JobSpec
from service.core.spec.overrides import split_path

_MISSING = object()


def held_value(dumped: Mapping[str, Any], path: str) -> Any:
    """The value at dotted ``path`` of a JSON-dumped spec; ``_MISSING`` when it has none."""
    node: Any = dumped
    for part in split_path(path):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def held_overrides(job_spec: JobSpec, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` with each value replaced by the one ``job_spec`` holds at its path (a
    path the spec does not keep keeps the value as sent)."""
    dumped = job_spec.model_dump(mode="json")
    held: dict[str, Any] = {}
    for path, raw in overrides.items():
        value = held_value(dumped, path)
        held[path] = raw if value is _MISSING else value
    return held


def bool_problems(overrides: Mapping[str, Any], held: Mapping[str, Any]) -> list[str]:
    """Paths where a bool was sent and validation kept a number (``true`` read as ``1``)."""
    return [
        p for p, raw in overrides.items() if isinstance(raw, bool) and not isinstance(held[p], bool)
    ]


def repeated_axes(grids: Mapping[str, list[Any]]) -> list[str]:
    """The grid axes (``{path: values}``) that list one value twice as sent."""
    return [p for p, values in grids.items() if len({_text(v) for v in values}) < len(values)]


def _text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def duplicate_error(
    first: tuple[int, Mapping[str, Any]],
    second: tuple[int, Mapping[str, Any]],
    held: Mapping[str, Any],
    duplicated_axes: list[str],
) -> dict[str, Any]:
    """A 422 error item for trial ``second`` being trial ``first`` again once validated:
    ``loc = [body, axes, <axis>]``, naming the two values sent and the value held.

    Args:
        first: ``(index, raw overrides)`` of the earlier trial.
        second: ``(index, raw overrides)`` of the later one.
        held: the overrides as the validated spec holds them (both trials').
        duplicated_axes: grid axes listing one value twice (named when no value differs).
    """
    (i, a), (j, b) = first, second
    differing = [p for p in b if _text(a.get(p)) != _text(b[p])]
    paths = differing or [p for p in duplicated_axes if p in b] or list(b)
    path = paths[0]
    return {
        "loc": ["body", "axes", path],
        "msg": f"{path}: values {_text(a.get(path))} and {_text(b[path])} are the same value "
        f"({_text(held[path])}) once validated, so trials {i} and {j} would be the same "
        "trial: list each value once",
        "type": "duplicate_trial",
    }
