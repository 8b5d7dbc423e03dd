"""Property tests of spec validation: whatever JSON a client sends to POST /jobs becomes a
stored job whose GET echoes its spec, or a 422 whose detail names fields and that stores
nothing; never a 500. The same for the spec text parser (service/core/spec/text.py) and for
/submit/parse-spec. Real HTTP to a served app, on SQLite and PostgreSQL.

Runs are derandomized (a failure reproduces); ``DDPQ_FUZZ_EXAMPLES`` scales the examples.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from service.core.spec.model import validate_spec
from service.core.spec.text import SpecTextError, json_value_problems, parse_spec_text
from service.store.models import Job

EXAMPLES = int(os.environ.get("DDPQ_FUZZ_EXAMPLES", "30"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    # One served app for all examples of a test is the point (state carries over).
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# ---- strategies ------------------------------------------------------------------------

# Characters JSON can carry plus the ones that break storage or terminals: NUL, lone
# surrogates (sent as \ud800 escapes), line/paragraph separators, BOM, the last code point.
_CHARS = st.one_of(
    st.characters(),
    st.sampled_from(["\x00", "\ud800", "\udfff", "\u2028", "\ufeff", "\U0010ffff", "\x85"]),
)
TEXT = st.text(_CHARS, max_size=20)
_NUMBERS = st.one_of(
    st.integers(),
    st.sampled_from([2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**40, -(10**40)]),
    st.floats(),  # NaN and ±inf included: json.dumps writes them as NaN/Infinity tokens
    st.sampled_from([1e308, -1e308, 5e-324, 0.1, -0.0]),
)
# Numbers at and past every bound a field could have (int64, float range, NaN/inf).
EXTREME_NUMBER_VALUES: list[Any] = [
    *(0, -1, 1, 0.5, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**40, 1e308, -1e308, 5e-324),
    *(math.nan, math.inf, -math.inf, True),
]
EXTREME_NUMBERS = st.sampled_from(EXTREME_NUMBER_VALUES)
JSON_LEAVES = st.one_of(st.none(), st.booleans(), _NUMBERS, TEXT)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=4),
    max_leaves=15,
)

# Text a valid spec may hold: no NUL, no lone surrogates.
_SAFE_CHARS = st.characters(exclude_characters="\x00", exclude_categories=("Cs",))
SAFE_TEXT = st.text(_SAFE_CHARS, max_size=20)
_SAFE_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        SAFE_TEXT,
    ),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(SAFE_TEXT, children, max_size=3)
    ),
    max_leaves=10,
)
TASK_CONFIGS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "regression": st.fixed_dictionaries(
        {}, optional={"hidden": st.integers(1, 100_000), "num_samples": st.integers(1, 5000)}
    ),
    "digits": st.fixed_dictionaries(
        {},
        optional={
            "model": st.sampled_from(["cnn", "mlp"]),
            "test_fraction": st.floats(0.05, 0.5),
        },
    ),
    "charlm": st.fixed_dictionaries({}, optional={"n_layers": st.integers(1, 48)}),
    # An entrypoint on the test settings' allow-list ("examples.*:*"): config is free-form.
    "examples.fuzz:main": st.dictionaries(SAFE_TEXT, _SAFE_JSON, max_size=4),
}


@st.composite
def valid_specs(draw: st.DrawFn) -> dict[str, Any]:
    """A spec the test deployment must accept: every field type-exact and in range."""
    task = draw(st.sampled_from(sorted(TASK_CONFIGS)))
    spec: dict[str, Any] = {
        "name": draw(st.text(_SAFE_CHARS, min_size=1, max_size=200)),
        "task": task,
    }
    optional: dict[str, st.SearchStrategy[Any]] = {
        "config": TASK_CONFIGS[task],
        "launcher": st.just("local"),
        "backend": st.sampled_from(["auto", "gloo"]),
        "resources": st.fixed_dictionaries(
            {},
            optional={
                "nnodes": st.just(1),
                "nproc_per_node": st.integers(1, 64),
                "cpus_per_task": st.integers(1, 256),
                "mem_gb": st.floats(0.001, 4096) | st.none(),
                "timeout_min": st.integers(1, 7 * 24 * 60),
            },
        ),
        "training": st.fixed_dictionaries(
            {},
            optional={
                "epochs": st.integers(1, 1_000_000),
                "max_steps": st.integers(1, 2**70) | st.none(),
                "batch_size": st.integers(1, 1_000_000),
                "lr": st.floats(1e-12, 100),
                "optimizer": st.sampled_from(["sgd", "adam", "adamw"]),
                "seed": st.integers(0, 2**32 - 1),
                "log_every_steps": st.integers(1, 10**12),
                "checkpoint_every_steps": st.integers(1, 10**12),
                "keep_checkpoints": st.integers(1, 1000),
                "amp": st.booleans(),
            },
        ),
        "max_restarts": st.integers(0, 100),
        "priority": st.integers(-1000, 1000),
        "tags": st.lists(st.text(_SAFE_CHARS, min_size=1, max_size=100), max_size=5),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            spec[key] = draw(strategy)
    return spec


@st.composite
def near_valid_specs(draw: st.DrawFn) -> dict[str, Any]:
    """A valid spec with one thing changed: a field (top level or inside a section) set to
    any JSON value, a required field dropped, or an unknown field added."""
    spec = draw(valid_specs())
    sections = [k for k in ("resources", "training", "config") if isinstance(spec.get(k), dict)]
    target: dict[str, Any] = spec
    if sections and draw(st.booleans()):
        target = spec[draw(st.sampled_from(sections))]
    how = draw(st.sampled_from(["set", "extreme", "drop", "add"]))
    if how == "drop" and target is spec:
        del spec[draw(st.sampled_from(["name", "task"]))]
    elif how == "set" and target:
        target[draw(st.sampled_from(sorted(target)))] = draw(JSON_VALUES)
    elif how == "extreme" and target:
        target[draw(st.sampled_from(sorted(target)))] = draw(EXTREME_NUMBERS)
    else:
        target[draw(TEXT)] = draw(JSON_VALUES)
    return spec


def _body(value: Any) -> bytes:
    # allow_nan: NaN/Infinity tokens are what a careless client sends; the server must cope.
    return json.dumps(value, allow_nan=True).encode()


# ---- oracle ------------------------------------------------------------------------------


def _job_count(served: Any) -> int:
    with served.db.session(write=False) as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


def _check_422(response: httpx.Response) -> None:
    detail = response.json()["detail"]
    assert isinstance(detail, list) and detail, f"422 without field errors: {response.text}"
    for error in detail:
        assert set(error) == {"loc", "msg", "type"}, error
        assert error["loc"] and error["loc"][0] in ("body", "header"), error
        assert isinstance(error["msg"], str) and error["msg"], error
        assert isinstance(error["type"], str) and error["type"], error


def submit_and_check(served: Any, client: httpx.Client, body: bytes) -> httpx.Response:
    """POST ``body`` to /jobs and check the contract: 201 and a GET that echoes the stored
    spec (one more job), or 422 naming fields (no job stored); nothing else."""
    before = _job_count(served)
    r = client.post("/jobs", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code in (201, 422), f"{r.status_code} for {body[:300]!r}: {r.text[:500]}"
    if r.status_code == 422:
        _check_422(r)
        assert _job_count(served) == before, f"a refused spec stored a job: {body[:300]!r}"
        return r
    assert _job_count(served) == before + 1
    job = r.json()
    got = client.get(f"/jobs/{job['id']}")
    assert got.status_code == 200, got.text
    assert got.json()["spec"] == job["spec"], "GET does not echo the stored spec"
    expected = validate_spec(json.loads(body), served.settings).model_dump(mode="json")
    assert job["spec"] == expected, "the stored spec is not the validated one"
    return r


def _assert_echoes(submitted: dict[str, Any], stored: dict[str, Any]) -> None:
    """Every field the client set comes back unchanged (sections and config key by key;
    the rest are defaults)."""
    for key, value in submitted.items():
        if isinstance(value, dict):
            for inner, inner_value in value.items():
                assert stored[key][inner] == inner_value, (key, inner, stored[key])
        else:
            assert stored[key] == value, (key, value, stored[key])


# ---- POST /jobs ------------------------------------------------------------------------


@FUZZ
@given(value=JSON_VALUES)
def test_any_json_is_a_job_or_a_422_naming_fields(served: Any, value: Any) -> None:
    with served.client() as client:
        submit_and_check(served, client, _body(value))


@FUZZ
@given(spec=valid_specs())
def test_a_valid_spec_is_stored_and_echoed(served: Any, spec: dict[str, Any]) -> None:
    with served.client() as client:
        r = submit_and_check(served, client, _body(spec))
        assert r.status_code == 201, f"valid spec refused: {r.text[:500]}\n{spec!r}"
        _assert_echoes(spec, r.json()["spec"])


@FUZZ
@given(spec=near_valid_specs())
def test_a_near_valid_spec_is_a_job_or_a_422_naming_fields(
    served: Any, spec: dict[str, Any]
) -> None:
    with served.client() as client:
        submit_and_check(served, client, _body(spec))


@FUZZ
@given(raw=st.binary(max_size=200) | TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_bytes_are_a_job_or_a_422(served: Any, raw: bytes) -> None:
    with served.client() as client:
        submit_and_check(served, client, raw)


# ---- spec text ---------------------------------------------------------------------------

YAML_SNIPPETS = st.sampled_from(
    [
        "a: &x [1, 2]\nb: *x\n",
        "a: &x {b: *x}\n",
        "date: 2024-01-01\n",
        "? [1, 2]\n: v\n",
        "x: !!binary aGVsbG8=\n",
        "x: !!set {a, b}\n",
        "x: .nan\ny: .inf\n",
        "name: n\ntask: regression\n",
        "a: " + "[" * 55 + "1" + "]" * 55 + "\n",  # deeper than MAX_SPEC_DEPTH
        "- 1\n- 2\n",
        "",
        "%YAML 1.1\n---\na: 1\n...\n---\nb: 2\n",
        "a: !!python/object:os.system ls\n",
        'a: "\\0"\n',
    ]
)
SPEC_TEXTS = st.one_of(
    TEXT,
    JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True)),
    JSON_VALUES.map(lambda v: yaml.safe_dump(v, allow_unicode=True)),
    YAML_SNIPPETS,
    st.lists(YAML_SNIPPETS | TEXT, max_size=4).map("\n".join),
)


def _roundtrip_expected(value: Any) -> bool:
    """Whether ``parse_spec_text`` must give ``value`` back from its JSON or YAML text."""
    return isinstance(value, dict) and not json_value_problems(value)


@settings(max_examples=max(50, EXAMPLES * 2), derandomize=True, database=None, deadline=None)
@given(text=SPEC_TEXTS)
def test_spec_text_is_a_json_mapping_or_a_spec_text_error(text: str) -> None:
    try:
        spec = parse_spec_text(text)
    except SpecTextError as exc:
        assert str(exc), "an empty error message"
        assert exc.kind in {"yaml_invalid", "json_invalid", "dict_type", "value_error"}
        return
    assert isinstance(spec, dict)
    assert json_value_problems(spec) == []
    json.dumps(spec, allow_nan=False).encode("utf-8")  # storable and servable as is


@settings(max_examples=max(50, EXAMPLES * 2), derandomize=True, database=None, deadline=None)
@given(value=JSON_VALUES, as_yaml=st.booleans())
def test_spec_text_gives_back_any_storable_mapping(value: Any, as_yaml: bool) -> None:
    text = yaml.safe_dump(value, allow_unicode=True) if as_yaml else json.dumps(value)
    if not _roundtrip_expected(value):
        with pytest.raises(SpecTextError):
            parse_spec_text(text)
        return
    parsed = parse_spec_text(text)
    assert parsed == value, (text, parsed)


# ---- /submit/parse-spec ------------------------------------------------------------------


@FUZZ
@given(payload=st.one_of(JSON_VALUES, SPEC_TEXTS.map(lambda t: {"text": t})))
def test_parse_spec_route_gives_a_spec_or_a_422_and_the_spec_submits(
    served: Any, payload: Any
) -> None:
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=30) as web:
        r = web.post("/submit/parse-spec", content=_body(payload))
    assert r.status_code in (200, 422), f"{r.status_code} for {payload!r}: {r.text[:500]}"
    if r.status_code == 422:
        _check_422(r)
        assert r.json()["detail"][0]["loc"] == ["body", "text"]
        return
    spec = r.json()["spec"]
    assert isinstance(spec, dict)
    with served.client() as client:
        submit_and_check(served, client, _body(spec))
