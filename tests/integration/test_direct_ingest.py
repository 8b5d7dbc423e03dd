"""A metric batch gets the same answer whether it takes the direct path
(``service.api.attempts.direct_ingest``: a body with its Content-Length) or goes through the
whole app (a chunked body, as a client that streams sends it), on SQLite and PostgreSQL:
stored, refused, unauthorised, superseded, over a quota, too big. On PostgreSQL its
statement runs on the event loop's own connections (``service.store.loop_pool``), and
anything but a stored batch is done again the usual way."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire
from service.store.db import Database
from service.store.loop_pool import LoopPool, application_name
from tests.integration.test_attempt_api import bearer, mint, move, start_jobs
from tests.integration.test_attempt_metric_series import points, post, series

URL = API_PREFIX + wire.METRICS_PATH
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    """What this module's ``api`` serves (tests/conftest.py): auth on, a small body cap and
    a small rate quota, so both are reached with small bodies."""
    return settings.model_copy(
        update={"auth": "on", "max_body_bytes": MAX_BODY_BYTES, "metric_points_per_minute": 50}
    )


def _chunks(body: bytes) -> Iterator[bytes]:
    yield body[:7]
    yield body[7:]


def both(api: TestClient, headers: dict[str, str], body: Any) -> tuple[Any, Any]:
    """The answer to ``body`` by the direct path, then by the whole app."""
    raw = json.dumps(body).encode()
    direct = api.post(URL, content=raw, headers={**headers, "Content-Type": "application/json"})
    assert "content-length" in {k.lower() for k in direct.request.headers}
    routed = api.post(URL, content=_chunks(raw), headers=headers)
    assert routed.request.headers.get("transfer-encoding") == "chunked"
    return direct, routed


def same(direct: Any, routed: Any, *headers: str) -> Any:
    assert (direct.status_code, direct.json()) == (routed.status_code, routed.json()), (
        f"direct {direct.status_code} {direct.text} / routed {routed.status_code} {routed.text}"
    )
    for h in headers:
        assert direct.headers.get(h) == routed.headers.get(h), h
    return direct


def test_both_paths_answer_a_batch_alike(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    ids = start_jobs(api, db, users)
    a, b = ids["alice"], ids["bob"]
    rank_a = bearer(mint(db, a))
    batch = {"series": [series("loss", [1, 2, 3], [1.0, 2.0, 3.0])]}
    # The same batch stored once: the second send (the routed one) inserts nothing.
    direct, routed = both(api, rank_a, batch)
    assert direct.status_code == 200, direct.text
    assert direct.json() == {"accepted": 3, "inserted": 3, "refused": []}
    assert routed.json() == {"accepted": 3, "inserted": 0, "refused": []}
    assert points(api, users["alice"], a, "loss") == [(1, 1.0, None), (2, 2.0, None),
                                                      (3, 3.0, None)]  # fmt: skip
    # A bad point is refused alone, in the same words (the good one stored by the first).
    direct, routed = both(api, rank_a, {"series": [series("loss", [0, 4], [1.0, 4.0])]})
    assert direct.json()["refused"] == routed.json()["refused"], (direct.text, routed.text)
    assert direct.json()["refused"][0].startswith("series 0 point 0"), direct.text
    assert (direct.json()["inserted"], routed.json()["inserted"]) == (1, 0)
    # A malformed body: the same 422 naming the field.
    malformed = {"series": [{**series("loss", [5], [1.0]), "unit": "s"}]}
    assert same(*both(api, rank_a, malformed)).status_code == 422
    # Anyone but the attempt: the same 401 with its challenge.
    forged = bearer(wire.ATTEMPT_TOKEN_PREFIX + "x" * 43)
    for who in ({}, users["alice"], forged):
        assert same(*both(api, who, batch), "www-authenticate").status_code == 401
    # Over the rate quota (50 points a minute; 4 stored): the same 429 and Retry-After.
    many = {"series": [series("loss", list(range(10, 60)), [0.5] * 50)]}
    assert same(*both(api, rank_a, many), "retry-after").status_code == 429
    # Too big for DDPQ_MAX_BODY_BYTES: 413 either way, before the route reads it.
    huge = {"series": [series("loss", [7], [1.0])], "pad": "x" * MAX_BODY_BYTES}
    assert same(*both(api, rank_a, huge)).status_code == 413
    # A superseded attempt: the same 409, and nothing of it stored.
    rank_b = bearer(mint(db, b))
    move(db, b, JobState.STARTING, JobState.QUEUED)
    assert same(*both(api, rank_b, batch)).status_code == 409
    assert points(api, users["bob"], b, "loss") == []


def _loop_backends(db: Database) -> list[int]:
    """The PostgreSQL backends of this process's loop connections."""
    with db.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %(name)s",
            {"name": application_name()},
        ).all()
    return [pid for (pid,) in rows]


def test_on_postgresql_a_batch_is_written_from_the_event_loop_even_after_a_restart(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    """PostgreSQL: a batch's statement runs on the app's loop connections (SQLite has none);
    one the server closed (a restart, pg_terminate_backend) costs no batch, and the loop
    gets a fresh connection. Each batch is stored once, whichever way it went."""
    a = start_jobs(api, db, {"alice": users["alice"]})["alice"]
    rank = bearer(mint(db, a))
    app_db: Database = api.app.state.db  # type: ignore[attr-defined]
    step = 0

    def until_loop_runs(more: int) -> None:
        """Send one-point batches until the loop pool has run ``more`` more statements
        (a batch may go the usual way while its first connection opens on a slow box)."""
        nonlocal step
        pool = app_db.loop_pool
        assert pool is not None
        goal = pool.statements_run + more
        deadline = time.monotonic() + 30
        while pool.statements_run < goal:
            assert time.monotonic() < deadline, "the batches never ran on the event loop"
            step += 1
            r = post(api, rank, {"series": [series("loss", [step], [float(step)])]})
            assert r.json() == {"accepted": 1, "inserted": 1, "refused": []}, r.text
            if pool.statements_run < goal:
                time.sleep(0.3)

    if db.dialect == "sqlite":
        assert app_db.loop_pool is None
        return
    until_loop_runs(1)
    backends = _loop_backends(db)
    assert backends, "no loop connection named for this process"
    with db.engine.connect() as conn:
        for pid in backends:
            # Waits (up to 10 s) until the backend has gone, as after a restart.
            conn.exec_driver_sql("SELECT pg_terminate_backend(%(pid)s, 10000)", {"pid": pid})
    until_loop_runs(1)
    assert set(_loop_backends(db)).isdisjoint(backends), "the killed connection came back"
    stored = points(api, users["alice"], a, "loss")
    assert stored == [(s, float(s), None) for s in range(1, step + 1)], stored


def test_a_rank_gone_before_its_body_came_gets_no_answer_and_leaves_no_error(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    """A client that disconnects mid-body: nothing to answer, nothing raised (no 500 and no
    traceback in the server's log), as on the routed path."""
    token = mint(db, start_jobs(api, db, {"alice": users["alice"]})["alice"])
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": URL, "raw_path": URL.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 1), "server": ("testserver", 80),
        "headers": [(b"host", b"testserver"), (b"content-length", b"100"),
                    (b"authorization", f"Bearer {token}".encode())],
    }  # fmt: skip
    asyncio.run(api.app(scope, receive, send))
    assert sent == [], sent


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_statement_the_loop_pool_cannot_run_is_left_to_the_usual_way(db: Database) -> None:
    """``LoopPool.one_row`` answers None for a failing statement and after ``close``."""

    async def run() -> list[Any]:
        pool = LoopPool(db.engine, 2, connect_timeout=5)
        await pool.open()
        answers = [await pool.one_row("SELECT %(a)s::int + 1", {"a": 1})]
        answers.append(await pool.one_row("SELECT 1 / %(zero)s", {"zero": 0}))
        answers.append(await pool.one_row("SELECT 2", {}))
        await pool.close()
        answers.append(await pool.one_row("SELECT 3", {}))
        return answers

    assert asyncio.run(run()) == [(2,), None, (2,), None]
