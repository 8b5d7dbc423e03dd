"""Pruning of stopped workers' rows (``worker_rows.prune_stopped_workers``, run by the API's
reaper) over real SQLite and PostgreSQL: only rows stopped longer ago than the retention go,
never a live worker's, a stale-but-unstopped one's, or one a job still names."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, update

from service.core.config import Settings
from service.core.spec.model import JobSpec
from service.store import reaper
from service.store.db import Database
from service.store.jobs import claims
from service.store.jobs import crud as jobs
from service.store.models import Worker, utcnow
from service.store.workers import registry as workers
from service.store.workers.pruning import prune_stopped_workers

DAY_S = 24 * 3600.0


def add_worker(db: Database, worker_id: str, *, stopped_days_ago: float | None) -> None:
    """A worker row whose heartbeat (and stop, if any) is ``stopped_days_ago`` days old."""
    with db.session() as s:
        workers.register_worker(
            s, worker_id=worker_id, host="h", pid=1, launcher="local", capacity={"slots": 1}
        )
    if stopped_days_ago is None:
        return
    at = utcnow() - timedelta(days=stopped_days_ago)
    with db.session() as s:
        s.execute(
            update(Worker)
            .where(Worker.id == worker_id)
            .values(stopped_at=at, heartbeat_at=at, started_at=at)
        )


def worker_ids(db: Database) -> set[str]:
    with db.session(write=False) as s:
        return set(s.scalars(select(Worker.id)))


def test_only_old_stopped_workers_that_hold_no_job_are_deleted(db: Database) -> None:
    add_worker(db, "old-stopped", stopped_days_ago=8)
    add_worker(db, "recent-stopped", stopped_days_ago=6)
    add_worker(db, "live", stopped_days_ago=None)
    add_worker(db, "old-holder", stopped_days_ago=None)
    with db.session() as s:
        jobs.submit_job(s, JobSpec(name="t", task="regression"), owner="local")
    with db.session() as s:
        held = claims.claim_next_job(
            s, worker_id="old-holder", launcher="local", max_gpus_per_node=0, lease_s=30
        )
        assert held is not None
    # The holder stops uncleanly long ago but its row still names the job: kept.
    at = utcnow() - timedelta(days=30)
    with db.session() as s:
        s.execute(update(Worker).where(Worker.id == "old-holder").values(stopped_at=at))
    with db.session() as s:
        s.execute(update(Worker).where(Worker.id == "live").values(heartbeat_at=at, started_at=at))

    with db.session() as s:
        assert prune_stopped_workers(s, retention_s=7 * DAY_S) == ["old-stopped"]
    assert worker_ids(db) == {"recent-stopped", "live", "old-holder"}
    with db.session() as s:
        assert prune_stopped_workers(s, retention_s=7 * DAY_S) == [], "idempotent"


def test_the_reaper_prunes_with_the_retention_it_is_given(db: Database) -> None:
    add_worker(db, "two-days", stopped_days_ago=2)
    add_worker(db, "ten-days", stopped_days_ago=10)
    reaper.reap_once(db)  # the default retention: 7 days
    assert worker_ids(db) == {"two-days"}
    reaper.reap_once(db, worker_retention_s=DAY_S)
    assert worker_ids(db) == set()


def test_the_retention_is_a_setting_with_a_seven_day_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().worker_retention_s == 7 * DAY_S
    monkeypatch.setenv("DDPQ_WORKER_RETENTION_S", "3600")
    assert Settings().worker_retention_s == 3600.0
    with pytest.raises(ValueError):
        prune_stopped_workers(None, retention_s=0)  # type: ignore[arg-type]
