"""The dashboard's server side without a browser: page shells, their security headers, the
submit form's fields, and YAML/JSON parsing of pasted specs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from fastapi.testclient import TestClient

from service.task_configs import BUILTIN_TASK_CONFIGS
from service.web import routes


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = FastAPI()
    app.include_router(routes.router)
    app.mount("/static", StaticFiles(directory=routes.STATIC_DIR), name="static")
    with TestClient(app) as c:
        yield c


@pytest.mark.parametrize("path", ["/", "/jobs/7", "/submit", "/workers"])
def test_pages_are_shells_with_a_strict_policy(client: TestClient, path: str) -> None:
    res = client.get(path)
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("text/html")
    csp = res.headers["content-security-policy"]
    assert (
        "script-src 'self'" in csp
        and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    )
    assert "<script>" not in res.text, "inline scripts would be blocked by the policy"
    for ref in ("/static/ddpq.css", "/static/ddpq.js", "/static/favicon.svg"):
        assert ref in res.text
        assert client.get(ref).status_code == 200, f"{ref} is not served"


def test_job_page_carries_only_the_id(client: TestClient) -> None:
    res = client.get("/jobs/42")
    assert 'data-job-id="42"' in res.text
    assert client.get("/static/vendor/uplot/uPlot.iife.min.js").status_code == 200
    assert client.get("/jobs/not-a-number").status_code == 422


def test_submit_form_offers_every_builtin_task_and_its_fields(client: TestClient) -> None:
    fields = routes.task_form_fields()
    assert set(fields) == set(BUILTIN_TASK_CONFIGS)
    for task, schema in BUILTIN_TASK_CONFIGS.items():
        assert [f.name for f in fields[task]] == list(schema.model_fields)
    hidden = next(f for f in fields["regression"] if f.name == "hidden")
    assert (hidden.kind, hidden.default, hidden.minimum) == ("int", "32", "1")
    fail_rank = next(f for f in fields["regression"] if f.name == "fail_rank")
    assert (fail_rank.kind, fail_rank.optional, fail_rank.default) == ("int", True, "")
    page = client.get("/submit").text
    for task in BUILTIN_TASK_CONFIGS:
        assert f'data-task="{task}"' in page


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        (
            "name: a\ntask: regression\nresources:\n  nproc_per_node: 2\n",
            {"name": "a", "task": "regression", "resources": {"nproc_per_node": 2}},
        ),
        ('{"name": "b", "task": "digits"}', {"name": "b", "task": "digits"}),
        ("name: '<img src=x>'\ntask: charlm\n", {"name": "<img src=x>", "task": "charlm"}),
    ],
)
def test_parse_spec_accepts_yaml_and_json(client: TestClient, text: str, spec: dict) -> None:
    res = client.post("/submit/parse-spec", json={"text": text})
    assert res.status_code == 200, res.text
    assert res.json() == {"spec": spec}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text": "name: [oops\n"}, "at line"),
        ({"text": "   "}, "paste a job spec"),
        ({"text": "- a\n- b\n"}, "mapping"),
        ({"text": "when: 2024-01-01\n"}, "JSON cannot represent"),
        ({"nope": 1}, "paste a job spec"),
    ],
)
def test_parse_spec_errors_are_422_at_the_text_field(
    client: TestClient, body: dict, needle: str
) -> None:
    res = client.post("/submit/parse-spec", json=body)
    assert res.status_code == 422, res.text
    [err] = res.json()["detail"]
    assert err["loc"] == ["body", "text"]
    assert needle in err["msg"]


def test_parse_spec_rejects_non_json_and_huge_bodies(client: TestClient) -> None:
    res = client.post(
        "/submit/parse-spec", content=b"name: x", headers={"content-type": "text/plain"}
    )
    assert res.status_code == 422
    big = "x: " + "y" * (routes.MAX_SPEC_TEXT_BYTES + 1)
    res = client.post("/submit/parse-spec", json={"text": big})
    assert res.status_code == 422
    assert "larger than" in res.json()["detail"][0]["msg"]
