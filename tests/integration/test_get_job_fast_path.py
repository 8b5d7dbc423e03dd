"""GET /jobs/{id}'s fast path (a Core read through ``Database.read``) answers what the ORM path
did, byte for byte, and rides out a PostgreSQL connection the server closed."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Connection, create_engine, text, update

from service.api.schemas import dump_json, job_out
from service.app import create_app
from service.core.config import Settings
from service.core.errors import DatabaseUnavailableError, NotFoundError
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs.crud import get_job
from service.store.jobs.queue import JobShape, explain_queue
from service.store.jobs.view import get_job_row
from service.store.models import Job
from service.store.workers import registry as workers

API = API_PREFIX
SPEC: dict[str, Any] = {
    "name": "reg",
    "task": "regression",
    "resources": {"nproc_per_node": 1},
    "training": {"max_steps": 10},
}


def submit(api: TestClient) -> int:
    r = api.post(f"{API}/jobs", json=SPEC)
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    return job_id


def orm_body(db: Database, settings: Settings, job_id: int) -> bytes:
    """The body the ORM path (``Session.get`` + ``job_out``) gives for the job."""
    with db.session(write=False) as s:
        job = get_job(s, job_id)
        explanation = None
        if job.state == JobState.QUEUED.value:
            shape = JobShape(
                job.launcher,
                job.gpus_per_node,
                job.spec["resources"]["nproc_per_node"],
                job.priority,
                job_id=job.id,
            )
            explanation = explain_queue(
                s,
                shape,
                viewer=None,
                heartbeat_interval_s=settings.heartbeat_interval_s,
                max_gpus_per_node=settings.max_gpus_per_node,
            )
        return dump_json(job_out(job, queue=explanation))


def assert_same_as_orm(api: TestClient, db: Database, settings: Settings, job_id: int) -> None:
    r = api.get(f"{API}/jobs/{job_id}")
    assert r.status_code == 200, r.text
    want = orm_body(db, settings, job_id)
    assert r.content == want
    assert r.headers["etag"] == f'W/"{hashlib.sha256(want).hexdigest()[:32]}"'
    assert (
        api.get(f"{API}/jobs/{job_id}", headers={"If-None-Match": r.headers["etag"]}).status_code
        == 304
    )


def test_body_and_etag_equal_the_orm_path(
    api: TestClient, db: Database, settings: Settings
) -> None:
    queued = submit(api)
    assert_same_as_orm(api, db, settings, queued)
    assert api.get(f"{API}/jobs/{queued}").json()["queue_reason"].startswith("no live worker")

    running = submit(api)
    with db.session() as s:
        workers.register_worker(
            s, worker_id="w1", host="h", pid=1, launcher="local", capacity={"slots": 4}
        )
    with db.session() as s:
        claimed = claims.claim_next_job(
            s, worker_id="w1", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert claimed is not None and claimed.id == queued  # oldest first
    with db.session() as s:
        s.execute(
            update(Job)
            .where(Job.id == queued)
            .values(
                progress={"step": 3, "total_steps": 10, "epoch": 0, "samples_per_s": 1.5},
                latest_metrics={
                    "loss": {"value": 0.25, "step": 3},
                    "acc": {"value": "Infinity", "step": 3},
                    "gap": {"value": None, "step": 3},
                },
                error="a\nmultiline error",
            )
        )
    assert_same_as_orm(api, db, settings, queued)  # started, with progress and metrics
    assert_same_as_orm(api, db, settings, running)  # queued behind a live worker
    assert api.get(f"{API}/jobs/{running}").json()["queue_reason"] is not None


def test_missing_job_is_404(api: TestClient, db: Database) -> None:
    r = api.get(f"{API}/jobs/{2**63 - 1}")
    assert r.status_code == 404
    assert r.json() == {"detail": f"job {2**63 - 1} not found", "code": "job_not_found"}


def test_unreachable_database_is_503(tmp_path: Path) -> None:
    url = "postgresql+psycopg://ddpq:secret@127.0.0.1:1/nowhere?connect_timeout=2"
    app = create_app(Settings(home=tmp_path, database_url=url, artifact_dir=tmp_path / "a"))
    r = TestClient(app).get(f"{API}/jobs/1")  # no lifespan: it would refuse to start
    assert r.status_code == 503
    assert r.json() == {
        "detail": "database unavailable: try again later",
        "code": "database_unavailable",
    }


def test_read_passes_domain_errors_through_without_retrying(api: TestClient, db: Database) -> None:
    job_id = submit(api)
    calls: list[int] = []

    def read(conn: Connection) -> Any:
        calls.append(1)
        return get_job_row(conn, job_id, owner="someone else")

    with pytest.raises(NotFoundError):
        db.read(read)
    assert calls == [1]
    assert db.read(lambda conn: get_job_row(conn, job_id).id) == job_id


# ---- PostgreSQL connections closed by the server --------------------------------------


@pytest.fixture
def pg_admin(pg_schema_url: str) -> Iterator[Connection]:
    engine = create_engine(pg_schema_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        yield conn
    engine.dispose()


def kill_backend(admin: Connection, pid: int) -> None:
    """Terminate the server process behind a connection and wait (≤ 5 s) until it is gone."""
    assert admin.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid}).scalar()


def backend_pid(conn: Connection) -> int:
    pid: int = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    return pid


def pooled_backend_pids(db: Database) -> set[int]:
    """The server pids of every idle connection in ``db``'s pool (checked out all at once,
    so the pool hands out exactly those)."""
    idle = db.engine.pool.checkedin()  # type: ignore[attr-defined]
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(db.engine.connect()) for _ in range(idle)]
        return {backend_pid(c) for c in conns}


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_get_after_its_pooled_connections_were_killed_answers_200(
    api: TestClient, pg_admin: Connection
) -> None:
    job_id = submit(api)
    first = api.get(f"{API}/jobs/{job_id}")
    assert first.status_code == 200
    app_db: Database = api.app.state.db  # type: ignore[attr-defined]
    killed = pooled_backend_pids(app_db)
    assert killed, "the GET should have left its connection in the pool"
    for pid in killed:
        kill_backend(pg_admin, pid)
    again = api.get(f"{API}/jobs/{job_id}")
    assert again.status_code == 200, again.text
    assert again.content == first.content
    assert not pooled_backend_pids(app_db) & killed


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_checkout_drops_a_connection_the_server_closed(db: Database, pg_admin: Connection) -> None:
    pid = db.read(backend_pid)
    kill_backend(pg_admin, pid)
    calls: list[int] = []

    def read(conn: Connection) -> int:
        calls.append(1)
        return backend_pid(conn)

    assert db.read(read) != pid
    assert calls == [1], "the closed connection should not have reached the reader"
    with db.session() as s:  # write scopes get a live connection too
        assert s.connection().exec_driver_sql("SELECT 1").scalar() == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_read_retries_once_when_its_connection_dies_under_it(
    db: Database, pg_admin: Connection
) -> None:
    pids: list[int] = []

    def read(conn: Connection) -> int:
        pids.append(backend_pid(conn))
        if len(pids) == 1:  # killed after checkout: only the retry can save this read
            kill_backend(pg_admin, pids[0])
        return int(conn.exec_driver_sql("SELECT 41 + 1").scalar_one())

    assert db.read(read) == 42
    assert len(pids) == 2 and pids[0] != pids[1]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_read_gives_up_after_one_retry(db: Database, pg_admin: Connection) -> None:
    calls: list[int] = []

    def read(conn: Connection) -> int:
        calls.append(1)
        kill_backend(pg_admin, backend_pid(conn))
        return int(conn.exec_driver_sql("SELECT 1").scalar_one())

    with pytest.raises(DatabaseUnavailableError, match="database unavailable"):
        db.read(read)
    assert len(calls) == 2
