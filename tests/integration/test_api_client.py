"""DdpqClient against a live uvicorn server (real HTTP) on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.app import create_app
from service.client import ApiError, ApiUnreachableError, DdpqClient
from service.core import artifacts
from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.checkpoints import crud as checkpoints
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.metrics import points as metrics
from service.store.metrics.points import MetricPoint
from service.store.workers import registry as workers
from tests.live import serve_app

SPEC = {"name": "c", "task": "regression", "training": {"max_steps": 3}}


@pytest.fixture
def client(settings: Settings, db: Database) -> Iterator[DdpqClient]:
    """A client of the API of ``settings``, served by uvicorn in a thread."""
    with serve_app(create_app(settings)) as url, DdpqClient(url + "/", token="t0ken") as c:
        yield c


def test_client_round_trip(
    client: DdpqClient, db: Database, settings: Settings, tmp_path: Path
) -> None:
    assert client.health() == {"status": "ok"} and client.ready() == {"status": "ok"}
    assert client._http.headers["authorization"] == "Bearer t0ken"
    job = client.submit(SPEC, idempotency_key="once")
    assert client.submit(SPEC, idempotency_key="once")["id"] == job["id"]
    assert client.get_job(job["id"])["state"] == "queued"
    other = client.submit({**SPEC, "name": "d"})
    page = client.list_jobs(limit=1)
    assert [j["id"] for j in page["jobs"]] == [other["id"]] and page["next_cursor"]
    rest = client.list_jobs(limit=1, cursor=page["next_cursor"])
    assert [j["id"] for j in rest["jobs"]] == [job["id"]] and rest["next_cursor"] is None
    assert [j["id"] for j in client.list_jobs(state="queued")["jobs"]] == [other["id"], job["id"]]

    with db.session() as s:
        workers.register_worker(s, worker_id="w", host="h", pid=7, launcher="local", capacity={})
    with db.session() as s:
        claims.claim_next_job(s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=30)
        jobs.apply_transition(s, jobs.Transition(job["id"], JobState.STARTING, JobState.RUNNING))
        metrics.record_metrics(s, job["id"], 1, [MetricPoint("loss", i, 2.0 / i) for i in (1, 2)])
    payload = b"ckpt" * 256
    path = artifacts.checkpoint_path(settings.resolved_artifact_dir, job["id"], 2)
    path.parent.mkdir(parents=True)
    path.write_bytes(payload)
    log = artifacts.rank_log_path(settings.resolved_artifact_dir, job["id"], 1, 0)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("line\n")
    with db.session() as s:
        checkpoints.record_checkpoint(
            s, job["id"], 1, step=2, epoch=0, path=str(path), size_bytes=len(payload),
            sha256=hashlib.sha256(payload).hexdigest(),
        )  # fmt: skip

    assert [w["id"] for w in client.workers()] == ["w"]
    assert client.workers()[0]["running_jobs"] == [job["id"]]
    assert [e["to_state"] for e in client.events(job["id"])] == ["queued", "starting", "running"]
    assert client.metric_names(job["id"]) == ["loss"]
    points = client.metrics(job["id"], after_step=1)
    assert [p["step"] for p in points["points"]] == [2] and points["next_after_step"] == 2
    assert len(client.metrics(job["id"], max_points=2)["points"]) == 2
    ckpts = client.checkpoints(job["id"])
    assert [c["step"] for c in ckpts] == [2]
    dest = client.download_checkpoint(job["id"], 2, tmp_path / "dl.pt")
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == ckpts[0]["sha256"]
    assert client.checkpoint_url(job["id"], 2).endswith(
        f"{API_PREFIX}/jobs/{job['id']}/checkpoints/2/file"
    )
    logs = client.logs(job["id"], rank=0)
    assert (logs["text"], logs["next_offset"], logs["eof"]) == ("line\n", 5, True)

    cancelled = client.cancel(job["id"])
    assert cancelled["cancel_requested"] is True and cancelled["state"] == "running"
    assert client.cancel(other["id"])["state"] == "cancelled"


def test_client_errors(client: DdpqClient, tmp_path: Path) -> None:
    with pytest.raises(ApiError) as bad:
        client.submit({**SPEC, "resources": {"nproc_per_node": 0}})
    assert bad.value.status_code == 422
    detail: Any = bad.value.detail
    assert detail[0]["loc"] == ["body", "resources", "nproc_per_node"]
    with pytest.raises(ApiError) as missing:
        client.get_job(4242)
    assert missing.value.status_code == 404 and "4242" in str(missing.value.detail)
    with pytest.raises(ApiError) as no_file:
        client.download_checkpoint(4242, 1, tmp_path / "x.pt")
    assert no_file.value.status_code == 404 and not (tmp_path / "x.pt").exists()
    queued = client.submit(SPEC)
    client.cancel(queued["id"])
    with pytest.raises(ApiError) as conflict:
        client.cancel(queued["id"])
    assert conflict.value.status_code == 409


def test_unreachable_names_the_url_and_the_fix() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with DdpqClient(url, timeout_s=2) as c, pytest.raises(ApiUnreachableError) as info:
        c.list_jobs()
    message = str(info.value)
    assert url in message and "ddpq serve" in message and "DDPQ_API_URL" in message


def test_default_url_and_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPQ_API_URL", "http://api.example:9000/")
    monkeypatch.setenv("DDPQ_TOKEN", "abc")
    with DdpqClient() as c:
        assert c.base_url == "http://api.example:9000"
        assert c._http.headers["authorization"] == "Bearer abc"
    monkeypatch.delenv("DDPQ_TOKEN")
    with DdpqClient() as c:
        assert "authorization" not in c._http.headers
