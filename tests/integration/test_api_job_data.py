"""REST API over real SQLite and PostgreSQL: metrics (paging, downsampling, NaN/inf), checkpoints
(listing, download, confinement) and rank logs (offset paging, validation)."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert, update

from service.api.metrics.schemas import MetricsOut
from service.app import create_app
from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.checkpoints import crud as checkpoints
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.metrics import points as metrics
from service.store.metrics import rollups
from service.store.metrics.points import MetricPoint
from service.store.models import Job, Metric, utcnow
from service.store.workers import registry as workers

API = API_PREFIX


def running_job(db: Database, **spec: Any) -> int:
    """A 2-rank job (unless ``spec`` says otherwise) claimed by worker w1 and running
    (attempt 1), ready to record metrics."""
    fields: dict[str, Any] = {"name": "j", "task": "regression"}
    fields |= {"resources": {"nproc_per_node": 2}, **spec}
    with db.session() as s:
        job, _ = jobs.submit_job(s, JobSpec.model_validate(fields), owner="local")
        workers.register_worker(s, worker_id="w1", host="h", pid=1, launcher="local", capacity={})
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert claimed is not None and claimed.id == job.id
        jobs.apply_transition(s, jobs.Transition(job.id, JobState.STARTING, JobState.RUNNING))
    return job.id


def test_nan_and_inf_come_back_json_valid(api: TestClient, db: Database) -> None:
    job_id = running_job(db)
    values = [1.5, math.nan, math.inf, -math.inf, 0.25]
    with db.session() as s:
        metrics.record_metrics(
            s,
            job_id,
            1,
            [MetricPoint("loss", i + 1, v, epoch=0) for i, v in enumerate(values)],
            progress={"step": 5, "total_steps": 10, "epoch": 0, "samples_per_s": math.nan},
        )
    r = api.get(f"{API}/jobs/{job_id}/metrics", params={"name": "loss"})
    assert r.status_code == 200
    json.loads(r.text)  # strict JSON: no NaN/Infinity tokens
    assert "NaN" not in r.text
    body = r.json()
    assert [p["value"] for p in body["points"]] == [1.5, None, "Infinity", "-Infinity", 0.25]
    assert body["next_after_step"] == 5 and body["name"] == "loss"
    assert body["points"][0]["epoch"] == 0 and body["points"][0]["time"]
    # The body is serialised without the response model: it must still be one, byte for byte.
    out = MetricsOut.model_validate_json(r.text)
    assert out.model_dump_json().encode() == r.content
    job = api.get(f"{API}/jobs/{job_id}").json()
    assert body["points"][0]["time"][-1] == job["created_at"][-1] == "Z", "times in UTC"
    assert job["latest_metrics"] == {"loss": 0.25}
    assert job["progress"] == {
        "step": 5,
        "total_steps": 10,
        "epoch": 0,
        "epoch_number": 1,
        "samples_per_s": None,
        "eta_s": None,
    }
    with db.session() as s:
        metrics.record_metrics(s, job_id, 1, [MetricPoint("loss", 6, math.inf)])
    assert api.get(f"{API}/jobs/{job_id}").json()["latest_metrics"] == {"loss": "Infinity"}
    downsampled = api.get(f"{API}/jobs/{job_id}/metrics", params={"max_points": 4})
    json.loads(downsampled.text)


def test_metric_names_and_polling_cursor(api: TestClient, db: Database) -> None:
    job_id = running_job(db)
    with db.session() as s:
        metrics.record_metrics(
            s,
            job_id,
            1,
            [MetricPoint("loss", i, 1.0 / i) for i in range(1, 6)]
            + [MetricPoint("eval_accuracy", 5, 0.9)],
        )
    names = api.get(f"{API}/jobs/{job_id}/metrics/names").json()
    assert names == {"names": ["eval_accuracy", "loss"]}
    first = api.get(f"{API}/jobs/{job_id}/metrics", params={"limit": 3}).json()
    assert [p["step"] for p in first["points"]] == [1, 2, 3]
    rest = api.get(
        f"{API}/jobs/{job_id}/metrics", params={"after_step": first["next_after_step"]}
    ).json()
    assert [p["step"] for p in rest["points"]] == [4, 5]
    idle = api.get(f"{API}/jobs/{job_id}/metrics", params={"after_step": 5}).json()
    assert idle == {"name": "loss", "points": [], "next_after_step": 5}
    for params in ({"limit": 0}, {"after_step": -1}, {"max_points": 1}, {"name": ""}):
        r = api.get(f"{API}/jobs/{job_id}/metrics", params=params)
        assert r.status_code == 422, params
    assert api.get(f"{API}/jobs/777/metrics").status_code == 404
    assert api.get(f"{API}/jobs/777/metrics/names").status_code == 404


def _record_history(db: Database, job_id: int, n: int) -> list[float]:
    """``n`` loss points with a single-point global min and max, bulk-inserted with their
    rollups (fast setup; record_metrics is exercised by the other tests)."""
    values = [math.sin(i / 500.0) * (1 + i / n) for i in range(1, n + 1)]
    values[31_337] = -50.0  # the global minimum, a single spike
    values[77_777] = 80.0  # the global maximum
    now = utcnow()
    rows = [
        {"job_id": job_id, "name": "loss", "step": i + 1, "attempt": 1, "epoch": 0,
         "value": v, "time": now}
        for i, v in enumerate(values)
    ]  # fmt: skip
    with db.session() as s:
        s.execute(insert(Metric), rows)
        rollups.rebuild_job(s, job_id)  # written around the ingest: its rollups too
    return values


@pytest.mark.slow
def test_100k_points_page_and_downsample(api: TestClient, db: Database) -> None:
    job_id = running_job(db)
    n = 100_000
    values = _record_history(db, job_id, n)
    steps: list[int] = []
    after = 0
    while True:
        page = api.get(
            f"{API}/jobs/{job_id}/metrics", params={"after_step": after, "limit": 10_000}
        ).json()
        if not page["points"]:
            break
        assert len(page["points"]) <= 10_000
        steps += [p["step"] for p in page["points"]]
        after = page["next_after_step"]
    assert steps == list(range(1, n + 1)), "every step exactly once, in order"
    t0 = time.monotonic()
    down = api.get(f"{API}/jobs/{job_id}/metrics", params={"max_points": 500}).json()
    assert time.monotonic() - t0 < 60
    points = down["points"]
    assert 0 < len(points) <= 500
    got = [p["value"] for p in points]
    assert min(got) == -50.0 and max(got) == 80.0, "the global min and max survive"
    assert [p["step"] for p in points] == sorted({p["step"] for p in points})
    assert down["next_after_step"] == points[-1]["step"]
    assert got[0] == pytest.approx(values[points[0]["step"] - 1])


def test_max_points_and_limit_are_capped(settings: Settings, db: Database) -> None:
    job_id = running_job(db)
    with db.session() as s:
        metrics.record_metrics(
            s, job_id, 1, [MetricPoint("loss", i, float(i)) for i in range(1, 51)]
        )
    capped = settings.model_copy(update={"max_metric_points": 10})
    with TestClient(create_app(capped)) as api:
        r = api.get(f"{API}/jobs/{job_id}/metrics", params={"limit": 1000}).json()
        assert len(r["points"]) == 10
        r = api.get(f"{API}/jobs/{job_id}/metrics", params={"max_points": 1000}).json()
        assert 0 < len(r["points"]) <= 10
        steps = {p["step"] for p in r["points"]}
        assert {1, 50} <= steps


def test_checkpoints_list_and_download(api: TestClient, db: Database, settings: Settings) -> None:
    job_id = running_job(db)
    root = settings.resolved_artifact_dir
    payload = b"\x80checkpoint bytes" * 1000
    path = artifacts.checkpoint_path(root, job_id, 20)
    path.parent.mkdir(parents=True)
    path.write_bytes(payload)
    sha = hashlib.sha256(payload).hexdigest()
    with db.session() as s:
        for step in (10, 20):
            checkpoints.record_checkpoint(
                s,
                job_id,
                1,
                step=step,
                epoch=step // 10 - 1,
                path=str(artifacts.checkpoint_path(root, job_id, step)),
                size_bytes=len(payload),
                sha256=sha,
            )
    listed = api.get(f"{API}/jobs/{job_id}/checkpoints").json()["checkpoints"]
    assert [c["step"] for c in listed] == [20, 10]
    assert set(listed[0]) == {
        "step", "epoch", "epoch_number", "attempt", "size_bytes", "sha256", "created_at", "path",
        "store", "file_name",
    }  # fmt: skip
    assert listed[0]["file_name"] is None, "ddpq's own checkpoint: no workspace file"
    assert [c["path"] for c in listed] == [
        f"jobs/{job_id}/checkpoints/step-20.pt",
        f"jobs/{job_id}/checkpoints/step-10.pt",
    ], "relative to the artifact directory, never the server's absolute path"
    r = api.get(f"{API}/jobs/{job_id}/checkpoints/20/file")
    assert r.status_code == 200 and r.content == payload
    # A file goes as it is, though the client accepts gzip (byte ranges count its bytes).
    assert "content-encoding" not in r.headers and r.num_bytes_downloaded == len(payload)
    assert hashlib.sha256(r.content).hexdigest() == listed[0]["sha256"]
    assert "attachment" in r.headers["content-disposition"]
    assert api.get(f"{API}/jobs/{job_id}/checkpoints/10/file").status_code == 404, "no file"
    assert api.get(f"{API}/jobs/{job_id}/checkpoints/99/file").status_code == 404
    assert api.get(f"{API}/jobs/{job_id}/checkpoints/-1/file").status_code == 422


def test_checkpoint_outside_the_artifact_dir_is_not_served_nor_named(
    api: TestClient, db: Database, settings: Settings, tmp_path: Path
) -> None:
    job_id = running_job(db)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not serve me")
    link = artifacts.checkpoint_path(settings.resolved_artifact_dir, job_id, 3)
    link.parent.mkdir(parents=True)
    link.symlink_to(secret)
    inside = f"jobs/{job_id}/checkpoints/step-4.pt"  # recorded relative: still inside
    with db.session() as s:
        for step, path in ((1, str(secret)), (2, "../secret.txt"), (3, str(link)), (4, inside)):
            checkpoints.record_checkpoint(
                s, job_id, 1, step=step, epoch=0, path=path, size_bytes=1, sha256="0" * 64
            )
    for step in (1, 2, 3):
        r = api.get(f"{API}/jobs/{job_id}/checkpoints/{step}/file")
        assert r.status_code == 404 and "do not serve" not in r.text
    listed = api.get(f"{API}/jobs/{job_id}/checkpoints").json()["checkpoints"]
    paths = {c["step"]: c["path"] for c in listed}
    assert paths == {4: inside, 3: None, 2: None, 1: None}, "no path outside the artifact dir"
    assert str(tmp_path) not in json.dumps(listed)


def test_logs_page_by_offset(api: TestClient, db: Database, settings: Settings) -> None:
    job_id = running_job(db)
    log = artifacts.rank_log_path(settings.resolved_artifact_dir, job_id, 1, 1)
    log.parent.mkdir(parents=True)
    # The first 256 KiB chunk ends inside the 3-byte "✓": it must move whole to the next one.
    text = "x" * (256 * 1024 - 1) + "✓\n"
    text += "".join(f"step {i} loss {1 / i:.4f} ✓\n" for i in range(1, 20_001))
    data = text.encode() + b"\xff bad byte\n"
    log.write_bytes(data)
    got, offset, calls = b"", 0, 0
    while True:
        r = api.get(f"{API}/jobs/{job_id}/logs", params={"rank": 1, "offset": offset}).json()
        calls += 1
        assert r["rank"] == 1 and r["attempt"] == 1
        assert len(r["text"].encode()) <= 256 * 1024 + 3
        got += r["text"].encode()
        assert r["next_offset"] >= offset
        offset = r["next_offset"]
        if r["eof"]:
            break
    assert calls > 1, "a file over 256 KiB takes more than one call"
    assert got == text.encode() + "\ufffd bad byte\n".encode(), "no character split or lost"
    assert offset == len(data)
    log.open("ab").write(b"more\n")
    tail = api.get(f"{API}/jobs/{job_id}/logs", params={"rank": 1, "offset": offset}).json()
    assert tail["text"] == "more\n" and tail["next_offset"] == len(data) + 5 and tail["eof"]


def test_logs_missing_file_and_bad_params(api: TestClient, db: Database) -> None:
    job_id = running_job(db)
    r = api.get(f"{API}/jobs/{job_id}/logs", params={"rank": 1, "offset": 42, "attempt": 1})
    assert r.status_code == 200
    assert r.json() == {"text": "", "next_offset": 42, "rank": 1, "attempt": 1, "eof": True,
                        "found": False}  # fmt: skip
    for params in (
        {"rank": "../../etc/passwd"},
        {"rank": -1},
        {"offset": -5},
        {"attempt": 0},
        {"rank": "1e400"},
    ):
        r = api.get(f"{API}/jobs/{job_id}/logs", params=params)
        assert r.status_code == 422, params
        assert "passwd" not in json.dumps(r.json()["detail"][0].get("input", ""))
    assert api.get(f"{API}/jobs/31337/logs").status_code == 404


def test_logs_of_a_rank_the_job_does_not_have_is_404_naming_its_ranks(
    api: TestClient, db: Database
) -> None:
    job_id = running_job(db)
    for rank in (2, 5):
        r = api.get(f"{API}/jobs/{job_id}/logs", params={"rank": rank})
        assert r.status_code == 404, r.text
        assert r.json()["detail"] == f"job {job_id} has ranks 0–1; there is no rank {rank}"
    assert api.get(f"{API}/jobs/{job_id}/logs", params={"rank": 1}).status_code == 200
    with db.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(state=JobState.SUCCEEDED.value))
    dp = running_job(db, strategy="dp", resources={})
    r = api.get(f"{API}/jobs/{dp}/logs", params={"rank": 1})
    assert r.status_code == 404 and r.json()["detail"].startswith(f"job {dp} has only rank 0")


def test_logs_of_an_attempt_after_the_current_one_is_404_naming_its_attempts(
    api: TestClient, db: Database
) -> None:
    job_id = running_job(db)
    r = api.get(f"{API}/jobs/{job_id}/logs", params={"attempt": 99})
    assert r.status_code == 404, r.text
    assert r.json()["detail"] == f"job {job_id} has only attempt 1; there is no attempt 99"
    with db.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(attempt=3))
    for attempt in (4, 1_000_000):
        r = api.get(f"{API}/jobs/{job_id}/logs", params={"attempt": attempt})
        assert r.status_code == 404
        assert r.json()["detail"] == f"job {job_id} has attempts 1–3; there is no attempt {attempt}"
    for attempt in (1, 3):
        r = api.get(f"{API}/jobs/{job_id}/logs", params={"attempt": attempt})
        assert r.status_code == 200 and r.json()["attempt"] == attempt
    assert api.get(f"{API}/jobs/{job_id}/logs").json()["attempt"] == 3, "default: the current"


def test_downsampled_history_keeps_the_first_and_the_last_point(
    api: TestClient, db: Database
) -> None:
    """A plotted curve must end at the newest value, whatever ``max_points`` asks for."""
    job_id = running_job(db)
    values = [math.sin(step / 7) for step in range(1, 231)]
    with db.session() as s:
        metrics.record_metrics(
            s, job_id, 1, [MetricPoint("loss", i + 1, v, epoch=0) for i, v in enumerate(values)]
        )
    for max_points in (2, 3, 5, 10, 50, 229):
        body = api.get(
            f"{API}/jobs/{job_id}/metrics", params={"name": "loss", "max_points": max_points}
        ).json()
        steps = [p["step"] for p in body["points"]]
        assert steps[0] == 1 and steps[-1] == 230, (max_points, steps)
        assert len(steps) <= max(max_points, 2), (max_points, len(steps))


def test_json_answers_are_gzipped_for_clients_that_accept_it(api: TestClient, db: Database) -> None:
    """A sweep page's poll or a chart's points cost a fifth on the wire: JSON past
    ``GZIP_MIN_BYTES`` is gzipped when the client says it accepts gzip, and only then."""
    job_id = running_job(db)
    with db.session() as s:
        points = [MetricPoint("loss", i, 1.0 / i) for i in range(1, 501)]
        metrics.record_metrics(s, job_id, 1, points)
    path = f"{API}/jobs/{job_id}/metrics"
    zipped = api.get(path, params={"name": "loss"}, headers={"Accept-Encoding": "gzip"})
    plain = api.get(path, params={"name": "loss"}, headers={"Accept-Encoding": "identity"})
    assert zipped.status_code == plain.status_code == 200
    assert zipped.headers["content-encoding"] == "gzip"
    assert "content-encoding" not in plain.headers
    assert zipped.json() == plain.json() and len(zipped.json()["points"]) == 500
    assert zipped.num_bytes_downloaded * 3 < plain.num_bytes_downloaded
    small = api.get(f"{API}/jobs/{job_id}/metrics/names", headers={"Accept-Encoding": "gzip"})
    assert small.status_code == 200 and "content-encoding" not in small.headers
