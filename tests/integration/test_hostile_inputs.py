"""Hostile and careless inputs against metric ingest (one JSON parameter in autocommit on
PostgreSQL), the poll body (serialised without validation), the one RequestContext dependency,
the UTC connect hook, the job page and the submit form, on real SQLite, PostgreSQL and headless
Chromium. A breaker found each case; each docstring says what went wrong then and what a user
relies on now (``service.core.metrics.points.checked_point`` holds the point rules)."""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert, text

from service.api.metrics.schemas import MetricsOut
from service.app import create_app
from service.core.artifacts import rank_log_path
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store import migrate
from service.store.auth.tokens import create_token, list_tokens, revoke_token
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.metrics import points as metrics
from service.store.metrics.points import MetricPoint
from service.store.models import Metric
from service.store.workers import registry as workers
from tests.live import serve_app
from tests.rank_api import attempt_client, live_api
from worker.runtime.metrics.sink import ApiSink

API = API_PREFIX
# A path's {digest} (a workspace): the route matches only a sha256.
DIGEST = "0" * 64


def concrete_path(path: str) -> str:
    """An OpenAPI path with its parameters filled in (ids 1, a digest of zeros)."""
    return (
        path.replace("{job_id}", "1")
        .replace("{step}", "1")
        .replace("{upload_id}", "1")  # a workspace upload's route matches numbers only
        .replace("{digest}", DIGEST)
    )


AT = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)  # a fixed time: bodies compare as bytes
ODD_AT = datetime(2026, 1, 1, tzinfo=timezone(timedelta(microseconds=1)))  # a valid tzinfo
CHROMIUM = Path("/usr/bin/chromium")


def running_job(db: Database) -> int:
    """A regression job claimed by worker w1 and running (attempt 1)."""
    with db.session() as s:
        job, _ = jobs.submit_job(s, JobSpec(name="j", task="regression"), owner="local")
        workers.register_worker(s, worker_id="w1", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=3600
        )
        assert claimed is not None and claimed.id == job.id
        jobs.apply_transition(s, jobs.Transition(job.id, JobState.STARTING, JobState.RUNNING))
    return job.id


def record(db: Database, job_id: int, points: list[MetricPoint]) -> int:
    """``record_metrics`` in the scope the rank-0 sink uses (autocommit on PostgreSQL)."""
    with db.session(one_statement=True) as s:
        return metrics.record_metrics(s, job_id, 1, points)


def stored(db: Database, job_id: int) -> list[tuple[str, int]]:
    with db.session(write=False) as s:
        return [
            (n, p.step)
            for n in metrics.metric_names(s, job_id)
            for p in metrics.downsample_points(s, job_id, n, max_points=10_000)
        ]


# ---- ingest: a point one database cannot hold --------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"name": "x" * 101}, id="name-101-chars"),
        pytest.param({"epoch": np.int64(0)}, id="numpy-epoch"),
    ],
)
def test_one_unwritable_point_does_not_stop_the_loss_curve(
    db: Database, settings: Settings, tmp_path: Path, bad: dict[str, Any]
) -> None:
    """A training loop reports one eval metric with a long name (``ctx.report(step,
    **{long_name: acc})``) or an epoch from numpy. On SQLite the loss curve goes on; on
    PostgreSQL the writer retries that batch forever as if the database were down ("database
    error: value too long for type character varying(100)", or "Object of type int64 is not
    JSON serializable": the old array parameters took numpy ints), so no later point of the
    attempt is ever written; with the numpy epoch, close() (after CLOSE_TIMEOUT_S, 120 s in a
    job) then raises TypeError from the spill file's encoder, so rank 0 fails after training
    finished. Expected: the bad point is refused or stored, the rest written, close() quiet."""
    job_id = running_job(db)
    with live_api(settings) as served:
        sink = ApiSink(
            None, attempt_client(db, served.url, job_id, 1),
            spill_path=tmp_path / "spill.jsonl", close_timeout_s=1.0,
        )  # fmt: skip
        point: dict[str, Any] = {"name": "eval_acc", "epoch": 0} | bad
        sink.report_values(1, point["epoch"], {str(point["name"]): 0.5})
        sink.flush(average=False)
        for step in (2, 3, 4):
            sink.report_values(step, 0, {"loss": 1.0 / step})
            sink.flush(average=False)
        try:
            sink.close()
            closed: Exception | None = None
        except Exception as exc:  # e.g. the held-back points cannot even be spilled
            closed = exc
    loss = [s for n, s in stored(db, job_id) if n == "loss"]
    assert loss == [2, 3, 4] and closed is None, (
        f"after one bad point ({bad!r}): loss steps written {loss}, {sink.held_back} points "
        f"held back, close() raised {closed!r}"
    )


@pytest.mark.parametrize(
    "point",
    [
        pytest.param(MetricPoint("x" * 101, 1, 1.0), id="name-101-chars"),
        pytest.param(MetricPoint("a\x00b", 1, 1.0), id="name-with-NUL"),
        pytest.param(MetricPoint("a\ud800", 1, 1.0), id="name-lone-surrogate"),
        pytest.param(MetricPoint("loss", 2**63, 1.0), id="step-2^63"),
        pytest.param(MetricPoint("loss", 2**53, 1.0), id="step-past-2^53"),
        pytest.param(MetricPoint("loss", 1, 1.0, 2**31), id="epoch-2^31"),
        pytest.param(MetricPoint("", 1, 1.0), id="name-empty"),
        pytest.param(MetricPoint("loss", 0, 1.0), id="step-0"),
    ],
)
def test_a_point_either_database_cannot_hold_is_refused_alike(
    db: Database, point: MetricPoint
) -> None:
    """``record_metrics`` checks a naive time "before any row is written ... so both databases
    raise the same ValueError"; other points a database cannot hold are not checked: SQLite
    stores a 101-char name, a NUL and epoch 2**31 (PostgreSQL refuses them), and the errors
    differ by database: DatabaseUnavailableError ("database error", which the sink takes for an
    outage) on PostgreSQL, OverflowError / UnicodeEncodeError on SQLite. Expected: ValueError
    on both, nothing stored."""
    job_id = running_job(db)
    with pytest.raises(ValueError):
        record(db, job_id, [MetricPoint("loss", 7, 0.5), point])
    assert stored(db, job_id) == [], "a refused batch stores nothing"


def test_a_time_with_any_offset_is_stored_as_its_utc_instant(api: TestClient, db: Database) -> None:
    """A tz-aware time whose offset has microseconds (valid in Python) was stored by SQLite and
    refused by PostgreSQL; it is the same instant in UTC on both now."""
    job_id = running_job(db)
    record(db, job_id, [MetricPoint("loss", 1, 1.0, None, ODD_AT)])
    body = MetricsOut.model_validate_json(
        api.get(f"{API}/jobs/{job_id}/metrics", params={"name": "loss"}).content
    )
    assert [p.time for p in body.points] == [ODD_AT]


def test_a_numpy_epoch_is_stored_and_polled_as_an_integer(api: TestClient, db: Database) -> None:
    """``ctx.report(step, epoch=np.int64(2), ...)``: the step is int()-converted, the epoch is
    not. SQLite stores it as an 8-byte BLOB, and the poll (no longer validated) serves it as the
    string "\\u0002\\u0000..." against the documented ``epoch: int | null``; PostgreSQL raises
    TypeError (not JSON serializable). Expected: epoch 2 on both, a body MetricsOut accepts."""
    job_id = running_job(db)
    step, epoch = np.int64(3), np.int64(2)  # what numpy arithmetic hands a training loop
    record(db, job_id, [MetricPoint("loss", cast(int, step), 0.5, cast(int, epoch), AT)])
    r = api.get(f"{API}/jobs/{job_id}/metrics", params={"name": "loss"})
    assert r.status_code == 200, r.text
    body = MetricsOut.model_validate_json(r.content)
    assert [(p.step, p.epoch) for p in body.points] == [(3, 2)], r.text


# ---- ingest accepted it, the API cannot show it ------------------------------------------


def test_every_metric_name_ingest_accepts_can_be_polled(api: TestClient, db: Database) -> None:
    """A metric named "" is stored on both databases and listed by /metrics/names, but
    GET /metrics?name= answers 422 (min_length=1), so neither the CLI nor the dashboard can
    read it (the dashboard's poll loop then stops: see the Chromium test below). Expected:
    ingest refuses the name with ValueError, or the poll serves it."""
    job_id = running_job(db)
    try:
        record(db, job_id, [MetricPoint("", 1, 0.25, 0, AT)])
    except ValueError:
        return  # refused at ingest: fine
    names = api.get(f"{API}/jobs/{job_id}/metrics/names").json()["names"]
    for name in names:
        r = api.get(f"{API}/jobs/{job_id}/metrics", params={"name": name})
        assert r.status_code == 200, f"name {name!r} is listed but cannot be polled: {r.text}"
        assert [p["value"] for p in r.json()["points"]] == [0.25]


@pytest.mark.parametrize("step", [0, -1])
def test_every_step_ingest_accepts_shows_in_the_poll_from_the_start(
    api: TestClient, db: Database, step: int
) -> None:
    """Steps are 1-based (DESIGN.md) but ingest stores step 0 and negative steps; polling from
    the start (after_step=0, what ``ddpq metrics`` does) never returns them, while the
    downsampled history (max_points, the dashboard's first load) does. Expected: ingest refuses
    them with ValueError, or the poll from the start returns them."""
    job_id = running_job(db)
    try:
        record(db, job_id, [MetricPoint("loss", step, 9.0, 0, AT), MetricPoint("loss", 1, 1.0)])
    except ValueError:
        return
    polled = api.get(f"{API}/jobs/{job_id}/metrics", params={"name": "loss"}).json()
    history = api.get(f"{API}/jobs/{job_id}/metrics", params={"name": "loss", "max_points": 10})
    assert [p["step"] for p in polled["points"]] == [p["step"] for p in history.json()["points"]]


@pytest.mark.parametrize("one_batch", [True, False], ids=["same-batch", "replayed-batch"])
def test_latest_metrics_agree_with_the_stored_point_of_a_repeated_step(
    api: TestClient, db: Database, one_batch: bool
) -> None:
    """Step 3 reported twice with different values (twice in one flush, or re-reported after a
    resume from an older checkpoint): the metrics table keeps the first (duplicates ignored),
    but ``latest_metrics`` (GET /jobs/{id}, ``ddpq ls``' loss) takes the second, so the list
    and the curve disagree. Expected: both show the stored point."""
    job_id = running_job(db)
    first, second = MetricPoint("loss", 3, 1.0), MetricPoint("loss", 3, 2.0)
    if one_batch:
        record(db, job_id, [first, second])
    else:
        record(db, job_id, [first])
        record(db, job_id, [second])
    curve = api.get(f"{API}/jobs/{job_id}/metrics", params={"name": "loss"}).json()["points"]
    latest = api.get(f"{API}/jobs/{job_id}").json()["latest_metrics"]["loss"]
    assert [p["value"] for p in curve] == [1.0] and latest == 1.0, (curve, latest)


# ---- the same batch on both databases ----------------------------------------------------

EDGE_BATCH = [
    MetricPoint("v", 1, -0.0, None, AT),
    MetricPoint("v", 2, 1e308, 2**31 - 1, AT),
    MetricPoint("v", 3, 5e-324, 0, AT),
    MetricPoint("v", 4, math.inf, 0, AT),
    MetricPoint("v", 5, math.nan, 0, AT),
    MetricPoint("v", 2**53 - 1, -1e-308, 1, AT),  # the largest step the dashboard pages exactly
    MetricPoint("q'\"\\ü😀", 1, 0.1, 0, AT),
]


def _served(url: str, tmp: Path) -> tuple[list[bytes], bytes]:
    """Poll bodies of every name in EDGE_BATCH, and the job's latest_metrics as JSON text."""
    db = Database.from_url(url)
    try:
        migrate.upgrade(db.engine)
        job_id = running_job(db)
        record(db, job_id, EDGE_BATCH)
        settings = Settings(home=tmp / ".ddpq", database_url=url, artifact_dir=tmp / "a")
        with TestClient(create_app(settings)) as api:
            names = sorted({p.name for p in EDGE_BATCH})
            polls = [
                api.get(f"{API}/jobs/{job_id}/metrics", params={"name": n}).content for n in names
            ]
            job = api.get(f"{API}/jobs/{job_id}").text
        return polls, job[job.index('"latest_metrics"') :].split("}", 1)[0].encode()
    finally:
        db.dispose()


def test_the_same_batch_is_served_alike_by_sqlite_and_postgresql(
    tmp_path: Path, pg_schema_url: str
) -> None:
    """Quotes, backslashes, astral unicode, 1e308, subnormals, ±inf, NaN and the largest step
    come back byte-identical; so does -0.0, stored as 0.0 on both (SQLite could not keep the
    sign, and PostgreSQL's jsonb merge dropped it from latest_metrics)."""
    lite = _served(f"sqlite:///{tmp_path / 'lite.db'}", tmp_path / "lite")
    pg = _served(pg_schema_url, tmp_path / "pg")
    assert lite[0] == pg[0], f"poll bodies differ:\nsqlite {lite[0]!r}\npg     {pg[0]!r}"
    assert lite[1] == pg[1], f"latest_metrics differ:\nsqlite {lite[1]!r}\npg     {pg[1]!r}"


# ---- what held (guards) ------------------------------------------------------------------


def test_options_in_the_url_keep_their_search_path_and_times_stay_utc(pg_schema_url: str) -> None:
    """The UTC connect hook beside ``?options=-csearch_path=...`` and a server-side timezone
    option: every session scope (read, write, one statement) keeps the schema and reads the
    exact instant back as UTC."""
    schema = pg_schema_url.rsplit("search_path%3D", 1)[1]
    url = pg_schema_url + quote(" -ctimezone=America/New_York")
    db = Database.from_url(url)
    try:
        migrate.upgrade(db.engine)
        job_id = running_job(db)
        est = timezone(timedelta(hours=-5))
        record(db, job_id, [MetricPoint("loss", 1, 1.0, 0, AT.astimezone(est))])
        for scope in ({"write": False}, {"write": True}, {"one_statement": True}):
            with db.session(**scope) as s:
                assert s.execute(text("SHOW search_path")).scalar() == schema, scope
                (point,), _ = metrics.query_points(s, job_id, "loss")
                assert point.time == AT and point.time.utcoffset() == timedelta(0), scope
    finally:
        db.dispose()


def test_odd_and_revoked_credentials_are_401_on_every_route(
    settings: Settings, db: Database
) -> None:
    """Empty bearer, scheme alone, a tab for the space, a valid token next to an empty header,
    a revoked token: 401 with a Bearer challenge on every guarded route, nothing stored."""
    with db.session() as s:
        good = create_token(s, owner="alice")[1]
        revoked = create_token(s, owner="rev")[1]
    with db.session() as s:
        revoke_token(s, next(t.id for t in list_tokens(s) if t.owner == "rev"))
    with TestClient(create_app(settings.model_copy(update={"auth": "on"}))) as api:
        routes = [("POST", "/submit/parse-spec")] + [
            (m.upper(), concrete_path(p))
            for p, ops in cast(Any, api.app).openapi()["paths"].items()
            if not p.endswith("/healthz")
            for m in ops
        ]
        for headers in (
            [("Authorization", "Bearer ")],
            [("Authorization", "Bearer")],
            [("Authorization", f"Bearer\t{good}")],
            [("Authorization", f"Bearer {good}"), ("Authorization", "")],
            [("Authorization", f"Bearer {revoked}")],
        ):
            for method, path in routes:
                r = api.request(method, path, headers=headers, json={"name": "x"})
                assert r.status_code == 401, f"{method} {path} {headers}: {r.status_code}"
                assert r.headers["www-authenticate"].startswith("Bearer")
    with db.session(write=False) as s:
        assert jobs.list_jobs(s, limit=10)[0] == []


# ---- the dashboard (headless Chromium, SQLite) -------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Database, Settings]]:
    """The app on a loopback port over a fresh SQLite database (auth off)."""
    root = tmp_path_factory.mktemp("breaker-web")
    url = f"sqlite:///{root / 'd.db'}"
    settings = Settings(home=root / ".ddpq", database_url=url, artifact_dir=root / "a")
    db = Database.from_url(settings.resolved_database_url)
    migrate.upgrade(db.engine)
    with serve_app(create_app(settings)) as url:
        yield url, db, settings
    db.dispose()


@pytest.fixture(scope="module")
def page(live: Any) -> Iterator[Any]:
    """A headless Chromium page (skips without Chromium or playwright)."""
    if not CHROMIUM.exists() or importlib.util.find_spec("playwright") is None:
        pytest.skip("needs /usr/bin/chromium and playwright: bash scripts/install-browser.sh")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu"],
        )
        yield browser.new_page()
        browser.close()


def wait_until(page: Any, expression: str, timeout_s: float) -> bool:
    """Poll ``expression`` in the page until truthy (``wait_for_function`` evaluates a string,
    which the dashboard's CSP forbids); False after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if page.evaluate(expression):
                return True
        except Exception:  # navigating: the context went away, ask again
            pass
        page.wait_for_timeout(100)
    return False


@pytest.mark.parametrize(
    ("name", "step"), [("", 1), ("loss", 2**63 - 1)], ids=["metric-named-empty", "step-2^63-1"]
)
def test_job_page_shows_logs_and_other_charts_when_one_series_misbehaves(
    live: Any, page: Any, name: str, step: int
) -> None:
    """One series the page cannot page through (a name the poll refuses, or a step past 2**53,
    which JavaScript rounds up to an after_step over 2**63-1: 422) throws out of the poll tick,
    so the other charts, the log and the checkpoints never load. Expected: they load."""
    url, db, settings = live
    job_id = running_job(db)
    record(db, job_id, [MetricPoint("acc", 1, 0.9, 0, AT)])
    with db.session() as s:  # as a row stored by an earlier version, refused today or not
        s.execute(
            insert(Metric).values(
                job_id=job_id, name=name, step=step, attempt=1, epoch=0, value=0.5, time=AT
            )
        )
    log = rank_log_path(settings.resolved_artifact_dir, job_id, 1, 0)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("hello from rank 0\n")
    page.goto(f"{url}/jobs/{job_id}")
    wait_until(page, "document.body.dataset.loaded === '1'", 6.0)  # asserted below
    shown = "ns => ns.map(n => [n.dataset.metric, n.dataset.points])"
    charts = dict(page.eval_on_selector_all(".chart", shown))
    assert charts.get("acc") == "1", f"charts shown: {charts}"
    assert "hello from rank 0" in page.content(), "the rank 0 log never loaded"


def test_submit_form_stores_a_large_max_steps_as_typed_or_refuses_it(live: Any, page: Any) -> None:
    """Max steps 9007199254740993 (no upper bound in the spec) goes through JavaScript's
    Number and is stored as 9007199254740992 without a word. Expected: the typed value, or an
    error next to the input."""
    url, db, _ = live
    page.goto(f"{url}/submit")
    page.fill('[name="name"]', "big-max-steps")
    page.fill('[data-path="training.max_steps"]', "9007199254740993")
    page.click("#submit-form")
    slot = "document.querySelector('[data-error-for=\"training.max_steps\"]')"
    assert wait_until(page, f"location.pathname.startsWith('/jobs/') || {slot}.textContent", 10)
    if "/jobs/" not in page.url:
        return  # refused next to the input: fine
    with db.session(write=False) as s:
        spec = jobs.get_job(s, int(page.url.rsplit("/", 1)[1])).spec
    assert spec["training"]["max_steps"] == 9007199254740993, spec["training"]
