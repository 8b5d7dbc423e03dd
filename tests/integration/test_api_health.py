"""Startup and probes on real SQLite and PostgreSQL: schema check, /healthz, /readyz."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.engine import make_url

from service.app import create_app
from service.core.config import Settings
from service.core.errors import DatabaseUnavailableError, SchemaOutOfDateError
from service.core.wire import API_PREFIX
from service.store import db as db_module
from service.store import migrate
from service.store.db import Database

PASSWORD = "s3cret-pw"


def with_password(url: str) -> str:
    """``url`` carrying a password (ignored by SQLite and by trust auth on the test server)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return url
    return parsed.set(password=PASSWORD).render_as_string(hide_password=False)


def test_refuses_to_start_on_an_unmigrated_database(settings: Settings) -> None:
    secret = settings.model_copy(
        update={"database_url": with_password(settings.database_url or "")}
    )
    app = create_app(secret)
    with (
        pytest.raises(SchemaOutOfDateError, match="run `ddpq db upgrade`") as info,
        TestClient(app),
    ):
        pass
    assert PASSWORD not in str(info.value)
    probe = TestClient(app)  # without the lifespan: the probes still answer
    ready = probe.get("/readyz")
    assert ready.status_code == 503
    assert "ddpq db upgrade" in ready.json()["detail"] and PASSWORD not in ready.text
    assert probe.get(API_PREFIX + "/readyz").status_code == 503
    assert probe.get("/healthz").json() == {"status": "ok"}


def test_ready_after_upgrade(settings: Settings, db: Database) -> None:
    with TestClient(create_app(settings)) as api:
        for path in ("/healthz", "/readyz", API_PREFIX + "/healthz", API_PREFIX + "/readyz"):
            r = api.get(path)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, path
        migrate.downgrade(db.engine, "base")
        r = api.get("/readyz")
        assert r.status_code == 503 and "ddpq db upgrade" in r.json()["detail"]
        migrate.upgrade(db.engine)
        assert api.get("/readyz").status_code == 200


def test_unreachable_database(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://ddpq:{PASSWORD}@127.0.0.1:1/nowhere?connect_timeout=2"
    settings = Settings(home=tmp_path, database_url=url, artifact_dir=tmp_path / "a")
    app = create_app(settings)  # builds, does not connect
    with pytest.raises(DatabaseUnavailableError) as info, TestClient(app):
        pass
    assert PASSWORD not in str(info.value)
    probe = TestClient(app)
    assert probe.get("/healthz").status_code == 200, "liveness needs no database"
    ready = probe.get("/readyz")
    assert ready.status_code == 503 and PASSWORD not in ready.text
    jobs = probe.get(API_PREFIX + "/jobs")
    assert jobs.status_code == 503 and PASSWORD not in jobs.text


def test_a_database_that_never_answers_fails_in_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that accepts TCP but never speaks PostgreSQL (a hung server, a wrong port behind
    a proxy): without a connect timeout every worker tick and API request hung on it."""
    monkeypatch.setattr(db_module, "PG_CONNECT_TIMEOUT_S", 1)
    with socket.socket() as silent:  # listens (the kernel completes handshakes), never reads
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        db = Database.from_url(f"postgresql+psycopg://ddpq@127.0.0.1:{port}/x")
        t0 = time.monotonic()
        with pytest.raises(DatabaseUnavailableError), db.session(write=False) as s:
            s.execute(text("SELECT 1"))
        assert time.monotonic() - t0 < 10, "the connect timeout did not apply"
        db.dispose()


def test_static_and_dashboard_router_are_mounted(settings: Settings, db: Database) -> None:
    static_dir = Path(__file__).resolve().parents[2] / "service" / "web" / "static"
    with TestClient(create_app(settings)) as client:
        page = client.get("/")  # the dashboard router's job list
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/html")
        assert "/static/jobs.js" in page.text, "the page loads its script from /static"
        script = client.get("/static/jobs.js")
        assert script.status_code == 200
        assert script.content == (static_dir / "jobs.js").read_bytes()
