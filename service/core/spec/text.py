"""Spec text and spec values: YAML/JSON text parsed into plain JSON data with bounded aliases
and nesting, and the check that any spec data can be stored and served as JSON."""

from __future__ import annotations

import datetime
import json
import math
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.nodes import Node

# Deepest nesting of objects/arrays a spec may have (the spec mapping itself is level 1).
MAX_SPEC_DEPTH = 50
# Most value problems (bad text, non-finite numbers...) ``json_value_problems`` reports.
MAX_VALUE_PROBLEMS = 20
# Most nodes one YAML document may expand to, each alias counted at the full size of the
# node it repeats ("billion laughs" documents stop here, after a few milliseconds).
MAX_YAML_NODES = 10_000

Loc = tuple[int | str, ...]


class SpecTextError(ValueError):
    """Spec text that is not a usable spec document. ``kind`` is the error ``type`` the API
    reports (``yaml_invalid``, ``json_invalid``, ``dict_type``, ``value_error``)."""

    def __init__(self, message: str, kind: str = "value_error") -> None:
        super().__init__(message)
        self.kind = kind


# ---- values ------------------------------------------------------------------------------


def display_text(text: str) -> str:
    """``text`` safe to echo in JSON and on a terminal's UTF-8: lone surrogates become
    ``\\udXXX`` and NUL becomes ``\\x00`` (for field names and messages quoting input)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "text must not contain NUL characters (\\u0000)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = display_text(text[exc.start : exc.start + 1])
        return (
            f"text must be valid Unicode: it holds a lone surrogate {bad} at character {exc.start}"
        )
    return None


def json_value_problems(data: Any, prefix: Loc = ()) -> list[tuple[Loc, str]]:
    """What keeps ``data`` (a parsed spec, or part of one) from being stored and served as
    JSON, as ``(loc, message)`` pairs in document order: text that is not UTF-8-encodable
    (lone surrogates) or holds NUL, in values and keys alike; NaN and ±Infinity; keys that
    are not strings; values that are not JSON (dates, bytes, sets); objects and arrays nested
    deeper than ``MAX_SPEC_DEPTH`` levels.

    Keys in ``loc`` pass through ``display_text``; at most ``MAX_VALUE_PROBLEMS`` problems
    are reported. Walks iteratively, so any depth is safe to check.
    """
    problems: list[tuple[Loc, str]] = []
    stack: list[tuple[Any, Loc, int]] = [(data, prefix, 0)]
    while stack and len(problems) < MAX_VALUE_PROBLEMS:
        value, loc, depth = stack.pop()
        message: str | None = None
        if isinstance(value, str):
            message = _text_problem(value)
        elif isinstance(value, float):
            if not math.isfinite(value):
                message = f"{value} is not a JSON number: use a finite number"
        elif isinstance(value, dict | list | tuple):
            if depth >= MAX_SPEC_DEPTH:
                message = f"nested deeper than {MAX_SPEC_DEPTH} levels of objects and arrays"
            else:
                stack.extend(reversed(_children(value, loc, depth + 1, problems)))
        elif isinstance(value, datetime.date):  # YAML reads 2024-01-01 as a date
            message = f"a date ({value.isoformat()}) is not a JSON value: quote it to keep text"
        elif not (isinstance(value, int) or value is None):  # int includes bool
            message = f"a {type(value).__name__} is not a JSON value: write it as quoted text"
        if message is not None:
            problems.append((loc, message))
    return problems[:MAX_VALUE_PROBLEMS]


def _children(
    value: dict[Any, Any] | list[Any] | tuple[Any, ...],
    loc: Loc,
    depth: int,
    problems: list[tuple[Loc, str]],
) -> list[tuple[Any, Loc, int]]:
    """The items of a container to walk next; bad keys go straight into ``problems``."""
    if not isinstance(value, dict):
        return [(item, (*loc, i), depth) for i, item in enumerate(value)]
    children: list[tuple[Any, Loc, int]] = []
    for key, item in value.items():
        if not isinstance(key, str):
            problems.append(
                ((*loc, display_text(str(key))),
                 f"keys must be text, not {type(key).__name__}: quote the key")
            )  # fmt: skip
        elif (problem := _text_problem(key)) is not None:
            problems.append(((*loc, display_text(key)), f"field name: {problem}"))
        else:
            children.append((item, (*loc, key), depth))
    return children


# ---- text --------------------------------------------------------------------------------


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader composing at most ``MAX_YAML_NODES`` nodes (aliases counted at
    their expanded size) nested at most ``MAX_SPEC_DEPTH`` deep, and refusing recursive
    aliases; checked while composing, before anything is built."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0  # collections open around the node being composed
        self._deepest = 0  # deepest level reached inside the node being composed
        self._nodes = 0  # nodes composed so far, aliases at their expanded size
        self._expanded: dict[int, tuple[int, int]] = {}  # id(anchored node): (nodes, height)

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            node = super().compose_node(parent, index)
            size = self._expanded.get(id(node))
            if size is None:
                raise _composer_error(
                    f"alias *{event.anchor} repeats a node that contains it (a recursive "
                    "structure, which JSON cannot hold)",
                    event.start_mark,
                )
            self._count(size[0], event.start_mark)
            self._reach(self._depth + size[1], event.start_mark)
            return node
        is_collection = isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent)
        base, outer_deepest, first = self._depth, self._deepest, self._nodes
        self._deepest = base
        self._count(1, event.start_mark)
        if is_collection:
            self._depth += 1
            self._reach(self._depth, event.start_mark)
        node = super().compose_node(parent, index)
        self._depth = base
        if getattr(event, "anchor", None) is not None:
            self._expanded[id(node)] = (self._nodes - first, self._deepest - base)
        self._deepest = max(outer_deepest, self._deepest)
        return node

    def _count(self, nodes: int, mark: Any) -> None:
        self._nodes += nodes
        if self._nodes > MAX_YAML_NODES:
            raise _composer_error(
                f"the document expands to more than {MAX_YAML_NODES} values (YAML aliases "
                "repeat what they name): write the values out, or use fewer aliases",
                mark,
            )

    def _reach(self, level: int, mark: Any) -> None:
        if level > MAX_SPEC_DEPTH:
            raise _composer_error(
                f"nested deeper than {MAX_SPEC_DEPTH} levels of mappings and lists", mark
            )
        self._deepest = max(self._deepest, level)


def _composer_error(problem: str, mark: Any) -> ComposerError:
    return ComposerError(None, None, problem, mark)


def _kind_of(value: Any) -> str:
    if value is None:
        return "an empty document"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "text"
    return f"a {type(value).__name__}"


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise SpecTextError(
            f"nested deeper than {MAX_SPEC_DEPTH} levels of objects and arrays", "json_invalid"
        ) from None


def _load_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader subclass
    except RecursionError:
        raise SpecTextError(
            f"nested deeper than {MAX_SPEC_DEPTH} levels of mappings and lists", "yaml_invalid"
        ) from None
    except ValueError as exc:  # a constructor's, e.g. an integer of more than 4,300 digits
        raise SpecTextError(f"not valid YAML/JSON: {exc}", "yaml_invalid") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise SpecTextError(f"not valid YAML/JSON{where}: {problem}", "yaml_invalid") from None


def parse_spec_text(text: str, *, json_only: bool = False) -> dict[str, Any]:
    """Parse a job spec written as JSON or YAML (YAML 1.1, safe tags only) into JSON data.

    JSON is tried first (it is also YAML); text that is not JSON is read as YAML, whose
    aliases may expand to at most ``MAX_YAML_NODES`` values and whose nesting may reach
    ``MAX_SPEC_DEPTH`` levels. The result must be a mapping of JSON values only: dates,
    binary data, sets, NaN/Infinity, non-text keys, NUL or lone surrogates are refused,
    naming the field. This parses only; ``service.core.spec.model.validate_spec`` validates.

    Args:
        text: the document.
        json_only: read it as JSON alone (a ``.json`` file); YAML is not tried.
    Returns:
        The spec mapping, ready for ``json.dumps`` and ``validate_spec``.
    Raises:
        SpecTextError: not JSON/YAML (the message names line and column), too big or deep,
            not a mapping, or holding values JSON cannot carry (the message names the field).
    """
    try:
        data = _load_json(text)
    except SpecTextError:
        raise
    except ValueError as exc:  # JSONDecodeError
        if json_only:
            raise SpecTextError(f"not valid JSON: {exc}", "json_invalid") from None
        data = _load_yaml(text)
    if not isinstance(data, dict):
        raise SpecTextError(
            f"a job spec must hold a mapping (name: …, task: …), not {_kind_of(data)}",
            "dict_type",
        )
    problems = json_value_problems(data)
    if problems:
        loc, message = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        field = ".".join(str(part) for part in loc) or "the spec"
        raise SpecTextError(f"{field}: {message}{more}")
    return data
