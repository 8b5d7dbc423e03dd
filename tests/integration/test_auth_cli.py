"""`ddpq token create/ls/revoke` on SQLite and PostgreSQL, and the database password kept out
of the CLI's output, the API's answers (/readyz included) and the logs."""

from __future__ import annotations

import hashlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from service.app import create_app
from service.cli.main import app
from service.client import ApiError, DdpqClient
from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.core.wire import worker as wire
from service.store import migrate
from service.store.db import Database
from service.store.models import ApiToken
from tests.live import serve_app

runner = CliRunner()
API = API_PREFIX
PASSWORD = "pw-must-not-leak-7f3a"


def env_for(settings: Settings) -> dict[str, str]:
    return {"DDPQ_DATABASE_URL": settings.resolved_database_url, "DDPQ_HOME": str(settings.home)}


def test_token_create_prints_it_once_and_stores_only_its_hash(
    settings: Settings, db: Database
) -> None:
    result = runner.invoke(app, ["token", "create", "--owner", "alice"], env=env_for(settings))
    assert result.exit_code == 0, result.output
    token = result.output.strip().splitlines()[-1]
    assert result.stdout.strip() == token, "stdout holds the token alone: $(ddpq token create)"
    assert token.startswith("ddpq_") and len(token) >= 40, token
    assert "alice" in result.stderr and "shown only now" in result.stderr

    with db.session(write=False) as s:
        rows = s.execute(select(ApiToken.__table__)).all()
    assert len(rows) == 1
    row = rows[0]._mapping
    assert row["token_hash"] == hashlib.sha256(token.encode()).hexdigest()
    assert all(token not in str(v) for v in row.values()), "the token itself is not stored"
    assert (row["owner"], row["admin"], row["revoked_at"]) == ("alice", False, None)

    with TestClient(create_app(settings.model_copy(update={"auth": "on"}))) as api:
        headers = {"Authorization": f"Bearer {token}"}
        r = api.post(f"{API}/jobs", json={"name": "x", "task": "regression"}, headers=headers)
        assert r.status_code == 201 and r.json()["owner"] == "alice", r.text

        admin = runner.invoke(
            app, ["token", "create", "--owner", "ops", "--admin"], env=env_for(settings)
        )
        assert admin.exit_code == 0 and "admin token 2" in admin.stderr, admin.output
        listed = runner.invoke(app, ["token", "ls"], env=env_for(settings))
        assert listed.exit_code == 0, listed.output
        lines = listed.stdout.splitlines()
        assert lines[0].split() == ["ID", "KIND", "OWNER/NAME", "ADMIN", "CREATED", "REVOKED"]
        assert lines[1].split()[:3] == ["1", "user", "alice"]
        assert lines[2].split()[:4] == ["2", "user", "ops", "yes"]
        assert token not in listed.output and row["token_hash"] not in listed.output

        revoked = runner.invoke(app, ["token", "revoke", "1"], env=env_for(settings))
        assert revoked.exit_code == 0 and "revoked" in revoked.stdout, revoked.output
        assert api.get(f"{API}/jobs", headers=headers).status_code == 401
        again = runner.invoke(app, ["token", "revoke", "1"], env=env_for(settings))
        assert again.exit_code == 0, "revoking twice is harmless"
        missing = runner.invoke(app, ["token", "revoke", "99"], env=env_for(settings))
        assert missing.exit_code == 2 and "ddpq token ls" in missing.stderr, missing.output


def test_a_worker_token_opens_only_the_worker_api(settings: Settings, db: Database) -> None:
    env = env_for(settings)
    made = runner.invoke(app, ["token", "create", "--worker", "--name", "gpu-07"], env=env)
    assert made.exit_code == 0, made.output
    token = made.stdout.strip()
    assert (
        token.startswith("ddpqw_") and "gpu-07" in made.stderr and "shown only now" in made.stderr
    )
    listed = runner.invoke(app, ["token", "ls"], env=env)
    assert listed.stdout.splitlines()[1].split()[:3] == ["1", "worker", "gpu-07"]
    assert token not in listed.output
    refused = runner.invoke(app, ["token", "create", "--worker", "--owner", "alice"], env=env)
    assert refused.exit_code == 2 and "--worker" in refused.stderr, refused.output
    nameless_user = runner.invoke(app, ["token", "create", "--name", "x"], env=env)
    assert nameless_user.exit_code == 2, nameless_user.output
    headers = {"Authorization": f"Bearer {token}", wire.WORKER_ID_HEADER: "gpu-07-1"}
    body = {"host": "gpu-07", "pid": 1, "launcher": "local", "capacity": {}}
    with TestClient(create_app(settings.model_copy(update={"auth": "on"}))) as api:
        assert api.put(API + wire.REGISTER_PATH, json=body, headers=headers).status_code == 200
        assert api.get(f"{API}/jobs", headers=headers).status_code == 401
        revoked = runner.invoke(app, ["token", "revoke", "1"], env=env)
        assert revoked.exit_code == 0 and "worker gpu-07" in revoked.stdout, revoked.output
        assert api.post(API + wire.HEARTBEAT_PATH, headers=headers).status_code == 401


def test_up_on_a_busy_port_leaves_the_running_ups_worker_token_alone(
    settings: Settings, db: Database
) -> None:
    """A second `ddpq up` that cannot bind (the first still serves there) fails before it
    mints its worker token: minting revokes the first one's, whose worker would then be
    refused while this one exits."""
    from service.cli.main import UP_WORKER_TOKEN_NAME
    from service.store.auth import service as auth

    running = auth.create_worker_token(db, name=UP_WORKER_TOKEN_NAME)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["up", "--port", str(port)], env=env_for(settings))
    assert result.exit_code != 0 and "cannot serve on" in result.output, result.output
    assert [(t.id, t.revoked_at) for t in auth.list_tokens(db)] == [(running.info.id, None)]


@pytest.mark.parametrize("owner", ["", "has space", "x" * 101, "../etc", "-flag"])
def test_token_create_refuses_bad_owner_names(settings: Settings, db: Database, owner: str) -> None:
    result = runner.invoke(app, ["token", "create", "--owner", owner], env=env_for(settings))
    assert result.exit_code == 2 and "invalid owner" in result.stderr, result.output
    assert "Traceback" not in result.output
    with db.session(write=False) as s:
        assert s.scalars(select(ApiToken)).all() == []


def test_token_commands_on_an_unmigrated_database_say_to_upgrade(settings: Settings) -> None:
    result = runner.invoke(app, ["token", "ls"], env=env_for(settings))
    assert result.exit_code == 2 and "ddpq db upgrade" in result.stderr, result.output


def test_the_database_password_appears_nowhere(
    pg_schema_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    # The test server trusts local connections, so a wrong password still connects.
    url = make_url(pg_schema_url).set(password=PASSWORD).render_as_string(hide_password=False)
    settings = Settings(home=tmp_path, database_url=url, artifact_dir=tmp_path / "a", auth="on")
    env = env_for(settings)
    outputs = [runner.invoke(app, ["token", "ls"], env=env).output]  # not migrated yet
    outputs.append(runner.invoke(app, ["db", "upgrade"], env=env).output)
    created = runner.invoke(app, ["token", "create", "--owner", "ops", "--admin"], env=env)
    outputs += [created.output, runner.invoke(app, ["token", "ls"], env=env).output]
    headers = {"Authorization": f"Bearer {created.stdout.strip()}"}

    answers = []
    app_ = create_app(settings)
    with TestClient(app_) as api:
        for path in ("/readyz", f"{API}/jobs", "/", "/workers", "/submit"):
            r = api.get(path, headers=headers)
            assert r.status_code == 200, f"{path}: {r.text}"
            answers.append(r.text)
        db = Database.from_url(url)
        migrate.downgrade(db.engine, "base")  # tokens gone too: every call fails now
        db.dispose()
        for path in ("/readyz", f"{API}/jobs"):
            r = api.get(path, headers=headers)
            assert r.status_code == 503, f"{path}: {r.status_code} {r.text}"
            answers.append(r.text)

    down = url.replace("127.0.0.1:5432", "127.0.0.1:1")
    assert down != url, "expected the test server on 127.0.0.1:5432"
    outputs.append(
        runner.invoke(app, ["token", "ls"], env={**env, "DDPQ_DATABASE_URL": down}).output
    )
    outputs.append(
        runner.invoke(app, ["db", "current"], env={**env, "DDPQ_DATABASE_URL": down}).output
    )
    unreachable = create_app(settings.model_copy(update={"database_url": down}))
    probe = TestClient(unreachable)  # no lifespan: it would refuse to start
    answers += [probe.get(p, headers=headers).text for p in ("/readyz", f"{API}/jobs")]

    assert any("database" in o for o in outputs), outputs
    leaks = [o for o in outputs + answers + [caplog.text] if PASSWORD in o]
    assert not leaks, f"the database password leaked into: {leaks}"


@pytest.fixture
def live_auth_url(settings: Settings, db: Database) -> Iterator[str]:
    """The API of ``settings`` with auth on, served by uvicorn on a free loopback port."""
    with serve_app(create_app(settings.model_copy(update={"auth": "on"}))) as url:
        yield url


def test_cli_and_client_send_ddpq_token(
    live_auth_url: str, settings: Settings, tmp_path: Path
) -> None:
    created = runner.invoke(app, ["token", "create", "--owner", "carol"], env=env_for(settings))
    token = created.stdout.strip()
    spec = tmp_path / "job.yaml"
    spec.write_text("name: cli-job\ntask: regression\n")
    env = {"DDPQ_API_URL": live_auth_url, "COLUMNS": "200"}

    refused = runner.invoke(app, ["submit", str(spec)], env=env)
    assert refused.exit_code == 2, refused.output
    assert "HTTP 401" in refused.stderr and "DDPQ_TOKEN" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.output

    env["DDPQ_TOKEN"] = token + "\n"  # as read from a file
    assert runner.invoke(app, ["submit", str(spec)], env=env).exit_code == 0
    listed = runner.invoke(app, ["ls"], env=env)
    assert listed.exit_code == 0 and "cli-job" in listed.stdout, listed.output

    with DdpqClient(live_auth_url, token=token) as client:
        assert [j["owner"] for j in client.list_jobs()["jobs"]] == ["carol"]
        assert client.ready() == {"status": "ok"}
    with DdpqClient(live_auth_url, token="ddpq_wrong") as client, pytest.raises(ApiError) as info:
        client.list_jobs()
    assert info.value.status_code == 401
