"""The one spec-text parser (dashboard and CLI): JSON or YAML into plain JSON data, with
bounded aliases and nesting, and every value JSON cannot carry refused by field or line."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from service.core.spec.text import (
    MAX_SPEC_DEPTH,
    MAX_YAML_NODES,
    SpecTextError,
    json_value_problems,
    parse_spec_text,
)

# Each level repeats the previous one 9 times: 9**9 ≈ 387M strings from 383 bytes.
BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


def refused(text: str, **kwargs: Any) -> SpecTextError:
    with pytest.raises(SpecTextError) as info:
        parse_spec_text(text, **kwargs)
    message = str(info.value)
    assert "\n" not in message, f"one line please: {message!r}"
    json.dumps(message, ensure_ascii=False).encode("utf-8")
    return info.value


def test_yaml_json_anchors_and_merge_keys_within_the_budget() -> None:
    assert parse_spec_text('{"name": "a", "task": "digits"}') == {"name": "a", "task": "digits"}
    text = "base: &b {lr: 0.1, epochs: 2}\ntraining:\n  <<: *b\n  epochs: 3\nother: *b\n"
    assert parse_spec_text(text) == {
        "base": {"lr": 0.1, "epochs": 2},
        "training": {"lr": 0.1, "epochs": 3},
        "other": {"lr": 0.1, "epochs": 2},
    }
    ok_depth = "x: " + "[" * (MAX_SPEC_DEPTH - 1) + "]" * (MAX_SPEC_DEPTH - 1)
    assert parse_spec_text(ok_depth)["x"] is not None


def test_billion_laughs_is_refused_at_once() -> None:
    started = time.monotonic()
    error = refused(BILLION_LAUGHS)
    assert f"more than {MAX_YAML_NODES} values" in str(error) and error.kind == "yaml_invalid"
    assert time.monotonic() - started < 10, "the budget stops expansion early"


def test_a_few_aliases_over_the_budget_are_refused() -> None:
    # 3 levels of 25 repeats: 15k values, small enough to build if the budget were missing.
    text = "a: &a [" + ",".join(["1"] * 25) + "]\nb: &b [" + ",".join(["*a"] * 25) + "]\n"
    text += "c: [" + ",".join(["*b"] * 25) + "]\n"
    assert "more than" in str(refused(text))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("x: " + "[" * 5000 + "]" * 5000, "nested deeper than 50"),
        ("x: " + "{a: " * 60 + "1" + "}" * 60, "nested deeper than 50"),
        ("[" * 100_000, "nested deeper than 50"),
        ('{"x": ' + "[" * 60 + "]" * 60 + "}", "nested deeper than 50"),
        # An alias whose anchor is 45 deep, used 10 levels down: 55 levels once expanded.
        ("a: &a " + "[" * 45 + "]" * 45 + "\nb: " + "[" * 10 + "*a" + "]" * 10, "deeper"),
        ("a: &a [*a]\n", "recursive"),
        ("a: &a {b: *a}\n", "recursive"),
    ],
    ids=["flow lists", "flow maps", "json recursion", "json deep", "deep alias", "self", "map"],
)
def test_deep_and_recursive_documents_are_refused(text: str, needle: str) -> None:
    assert needle in str(refused(text))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: 2024-01-01\ntask: regression\n", "name: a date (2024-01-01) is not a JSON value"),
        ("name: x\nwhen: 2024-01-01 10:00:00\n", "when: a date (2024-01-01T10:00:00)"),
        ("tags: !!set {a, b}\n", "tags: a set"),
        ("blob: !!binary aGVsbG8=\n", "blob: a bytes"),
        ("resources: {mem_gb: .inf}\n", "resources.mem_gb: inf is not a JSON number"),
        ("x: .nan\n", "x: nan is not a JSON number"),
        ('{"x": NaN}', "x: nan"),
        ('{"x": -Infinity}', "x: -inf"),
        ('{"x": 1e400}', "x: inf"),
        ('{"name": "\\ud800"}', "name: text must be valid Unicode"),
        ('{"name": "\\u0000"}', "name: text must not contain NUL"),
        ("1: one\n", "1: keys must be text, not int"),
        ("config: {true: 1}\n", "config.True: keys must be text, not bool"),
        ("x: !!python/object:os.system {}\n", "not valid YAML/JSON at line 1"),
        ("a: \ud800\n", "not valid YAML/JSON"),
        ("- a\n", "must hold a mapping (name: …, task: …), not a list"),
        ("# nothing\n", "not an empty document"),
        ("name: [unclosed\n", "not valid YAML/JSON at line 2, column 1"),
    ],
)
def test_values_json_cannot_carry_are_refused_naming_the_field(text: str, needle: str) -> None:
    assert needle in str(refused(text))


def test_json_only_does_not_fall_back_to_yaml() -> None:
    assert parse_spec_text('{"a": 1}', json_only=True) == {"a": 1}
    error = refused("a: 1\n", json_only=True)
    assert error.kind == "json_invalid" and "not valid JSON" in str(error)
    assert "x: nan" in str(refused('{"x": NaN}', json_only=True))


def test_json_value_problems_walks_keys_values_and_depth() -> None:
    data = {"a": [1.5, "ok", {"b\x00": 1}], "c": float("inf"), "d": {"e": {1, 2}}}
    assert json_value_problems(data, ("body",)) == [
        (("body", "a", 2, "b\\x00"), "field name: text must not contain NUL characters (\\u0000)"),
        (("body", "c"), "inf is not a JSON number: use a finite number"),
        (("body", "d", "e"), "a set is not a JSON value: write it as quoted text"),
    ]
    assert json_value_problems({"ok": [None, True, 3, "x", {"y": 2.5}]}) == []


def test_an_integer_beyond_pythons_digit_limit_is_a_parse_error() -> None:
    exc = refused("name: x\ntraining: {epochs: 1" + "0" * 5000 + "}")
    assert "not valid YAML/JSON" in str(exc) and "4300 digits" in str(exc)
