"""What a submission reads does not grow with the fleet: ``POST /jobs`` checks for its
warning whether any worker of the job's launcher is registered, in one small read, instead of
reading every worker with what each holds (with 200 idle workers long-polling two API
processes that cost the submit, and so the submit → claim time, hundreds of milliseconds).
PostgreSQL, whose cursors count the rows a SELECT returned."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from service.core.wire import API_PREFIX
from service.store.db import Database
from service.store.workers import registry as workers

FLEET = 300
SPEC: dict[str, Any] = {
    "name": "reg",
    "task": "regression",
    "resources": {"nproc_per_node": 1},
    "training": {"max_steps": 10},
}


class RowsRead:
    """Rows returned by each statement of ``db``'s engine while counting."""

    def __init__(self, db: Database) -> None:
        self.rows: list[tuple[int, str]] = []
        self._engine = db.engine

    def _count(self, _conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        if cursor.description is not None and cursor.rowcount > 0:
            self.rows.append((cursor.rowcount, statement.split("\n", 1)[0][:120]))

    def __enter__(self) -> RowsRead:
        event.listen(self._engine, "after_cursor_execute", self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self._engine, "after_cursor_execute", self._count)


@pytest.fixture
def fleet(db: Database) -> Iterator[None]:
    with db.session() as s:
        for i in range(FLEET):
            workers.register_worker(
                s, worker_id=f"w{i}", host="h", pid=1, launcher="local", capacity={"slots": 1}
            )
    yield


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_submission_reads_a_few_rows_whatever_the_number_of_workers(
    api: TestClient, fleet: None
) -> None:
    app_db: Database = api.app.state.db  # type: ignore[attr-defined]
    with RowsRead(app_db) as counted:
        r = api.post(f"{API_PREFIX}/jobs", json=SPEC)
    assert r.status_code == 201, r.text
    assert r.json()["warnings"] == [], "a registered local worker can run it"
    total = sum(n for n, _ in counted.rows)
    assert total <= 10, (
        f"a submission beside {FLEET} registered workers read {total} rows; expected a few "
        f"(its warning needs only whether one worker of the launcher exists): {counted.rows}"
    )
    slurm = api.post(f"{API_PREFIX}/jobs", json={**SPEC, "name": "s", "launcher": "slurm"})
    if slurm.status_code == 201:  # a deployment without Slurm refuses the spec (422)
        assert slurm.json()["warnings"][0].startswith("no worker of launcher slurm")
