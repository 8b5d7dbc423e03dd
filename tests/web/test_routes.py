"""The dashboard's server side without a browser (the real app, real SQLite and PostgreSQL):
page shells, their security headers and asset URLs, the 404 page of a missing job, the submit
form's fields, and YAML/JSON parsing of pasted specs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.config import Settings
from service.core.spec.model import JobSpec, Training
from service.core.spec.task_configs import BUILTIN_TASK_CONFIGS
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.web import routes


@pytest.fixture
def client(settings: Settings, db: Database) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def job_id(db: Database) -> int:
    """A queued job's id."""
    with db.session() as s:
        job, _ = jobs.submit_job(s, JobSpec(name="j", task="regression"), owner="local")
        return job.id


# Aliases that expand to 25**3 = 15,625 values: over the parser's budget, yet small enough
# that a parser without one answers quickly (the real "billion laughs" is in test_spec_text).
ALIAS_BOMB = "a: &a [" + ",".join(["1"] * 25) + "]\nb: &b [" + ",".join(["*a"] * 25) + "]\n"
ALIAS_BOMB += "c: [" + ",".join(["*b"] * 25) + "]\n"


def asset_urls(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="([^"]*/static/[^"]*)"', html)


@pytest.mark.parametrize("path", ["/", "/jobs/{id}", "/submit", "/workers"])
def test_pages_are_shells_with_a_strict_policy(client: TestClient, job_id: int, path: str) -> None:
    res = client.get(path.format(id=job_id))
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("text/html")
    csp = res.headers["content-security-policy"]
    assert (
        "script-src 'self'" in csp
        and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    )
    assert "<script>" not in res.text, "inline scripts would be blocked by the policy"
    for ref in ("/static/ddpq.css", "/static/ddpq.js", "/static/favicon.svg"):
        assert f'"{ref}"' in res.text, f"{ref} should be referenced root-relative"
        assert client.get(ref).status_code == 200, f"{ref} is not served"


@pytest.mark.parametrize("path", ["/", "/jobs/{id}", "/submit", "/workers", "/jobs/999999"])
def test_assets_are_root_relative_so_pages_work_behind_a_proxy(
    client: TestClient, job_id: int, path: str
) -> None:
    """Absolute http://<Host>/static/… URLs break behind an HTTPS proxy (mixed content)."""
    html = client.get(path.format(id=job_id), headers={"host": "internal:8000"}).text
    urls = asset_urls(html)
    assert urls, "the page references no /static assets"
    assert all(u.startswith("/static/") for u in urls), urls
    assert "internal:8000" not in html


def test_job_page_carries_only_the_id(client: TestClient, job_id: int) -> None:
    res = client.get(f"/jobs/{job_id}")
    assert f'data-job-id="{job_id}"' in res.text
    assert client.get("/static/vendor/uplot/uPlot.iife.min.js").status_code == 200
    assert client.get("/jobs/not-a-number").status_code == 422


def test_missing_job_is_a_404_page_with_a_way_back(client: TestClient, job_id: int) -> None:
    res = client.get(f"/jobs/{job_id + 1000}")
    assert res.status_code == 404
    assert res.headers["content-type"].startswith("text/html")
    assert f"Job {job_id + 1000} was not found" in res.text
    assert 'href="/"' in res.text and "Back to the job list" in res.text
    assert "data-job-id" not in res.text, "no empty job panels under the banner"
    assert "job.js" not in res.text
    assert "content-security-policy" in res.headers
    for beyond in (2**63, 10**30):  # past any 64-bit id: the same page, never a 500/503
        far = client.get(f"/jobs/{beyond}")
        assert far.status_code == 404 and f"Job {beyond} was not found" in far.text


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


def test_submit_form_offers_every_training_setting_at_the_specs_default(
    client: TestClient,
) -> None:
    fields = [f for _, group in routes.spec_form_fields() for f in group]
    offered = {f.path: f for f in fields}
    training = {p.removeprefix("training.") for p in offered if p.startswith("training.")}
    missing = set(Training.model_fields) - training
    assert not missing, f"add {sorted(missing)} to routes.SPEC_FORM_GROUPS (the submit form)"
    assert {"max_restarts", "priority", "tags", "backend"} <= set(offered)
    defaults = JobSpec(name="x", task="regression").model_dump()
    for path, f in offered.items():
        value = defaults
        for part in path.split("."):
            value = value[part]
        if isinstance(value, bool):
            shown = "true" if value else "false"
        else:
            shown = "" if value in (None, []) else str(value)
        want = routes.FORM_DEFAULTS.get(path, shown)
        assert f.default == want, f"{path}: the form starts at {f.default!r}, the spec at {value!r}"
    assert offered["training.nonfinite_loss"].choices == (
        ("fail", "fail"),
        ("skip_step", "skip_step"),
    )
    assert offered["training.stall_timeout_s"].bounds == "≥ 10, ≤ 604800"
    page = client.get("/submit").text
    for path in offered:
        assert f'data-path="{path}"' in page, f"{path} is not rendered"
    assert '<option value="fail" selected>' in page and 'value="1800"' in page


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
        ({"text": "when: 2024-01-01\n"}, "when: a date (2024-01-01) is not a JSON value"),
        ({"nope": 1}, "paste a job spec"),
        ({"text": ALIAS_BOMB}, "expands to more than"),
        ({"text": "x: " + "[" * 5000 + "]" * 5000}, "nested deeper than 50"),
        ({"text": "[" * 5000}, "nested deeper than 50"),
        ({"text": "a: &a [*a]\n"}, "recursive"),
        ({"text": "x: !!set {a}\n"}, "x: a set"),
        ({"text": "x: !!binary aGk=\n"}, "x: a bytes"),
        ({"text": "resources: {mem_gb: .inf}\n"}, "resources.mem_gb: inf"),
        ({"text": '{"name": "\\ud800"}'}, "name: text must be valid Unicode"),
        ({"text": "name: \ud800\n"}, "not valid YAML/JSON"),
        ({"text": '{"x": NaN}'}, "x: nan"),
    ],
    ids=[
        "yaml syntax",
        "blank",
        "list",
        "date",
        "no text",
        "alias bomb",
        "deep yaml",
        "deep json",
        "recursive alias",
        "set",
        "binary",
        "inf",
        "surrogate",
        "raw surrogate",
        "NaN",
    ],
)
def test_parse_spec_errors_are_422_at_the_text_field(
    client: TestClient, body: dict, needle: str
) -> None:
    res = client.post(  # ASCII JSON, so lone surrogates travel as \ud800 escapes
        "/submit/parse-spec", content=json.dumps(body), headers={"content-type": "application/json"}
    )
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
