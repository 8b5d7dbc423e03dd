"""Every writer of job events sets its kind (SQLite and PostgreSQL): the store's state
changes and notes, the worker's decisions, the claims (PostgreSQL's one-statement CTE, SQLite's
two statements, the batch claim), the checkpoint events and the sweeps'; every row's reason is
its kind's wording of its data; readers find events by kind. Plus the migration's backfill of
rows written with the old texts."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select, text

from service.core.events import EventKind, render
from service.core.spec.model import JobSpec
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store import migrate
from service.store.checkpoints.crud import record_checkpoint, record_checkpoint_failure
from service.store.checkpoints.events import note_fresh_start, note_rank_deletions, record_note
from service.store.checkpoints.retention import apply_retention
from service.store.db import Database
from service.store.jobs import batch_claims, claims, notes
from service.store.jobs import crud as jobs
from service.store.models import Job, JobEvent
from service.store.reaper import reap_once
from service.store.workers import leases
from service.store.workers import registry as workers
from worker.attempt import FailureReason
from worker.decisions import HeldRun, decide_on_shutdown, decide_on_status, reconcile
from worker.launchers.base import RunPhase, RunStatus

API = API_PREFIX
SPEC = JobSpec(name="e", task="regression", max_restarts=1)


def _events(db: Database, job_id: int) -> list[tuple[str, dict[str, Any]]]:
    with db.session(write=False) as s:
        return [(e.kind, e.data) for e in jobs.list_events(s, job_id)]


def _kinds(db: Database, job_id: int) -> list[str]:
    return [k for k, _ in _events(db, job_id)]


def _assert_reasons_are_worded(db: Database) -> None:
    """Every row's reason is the wording of its kind and data (one place words them)."""
    with db.session(write=False) as s:
        rows = s.scalars(select(JobEvent)).all()
        assert rows
        for e in rows:
            assert e.reason == render(EventKind(e.kind), e.data), (e.kind, e.data, e.reason)


def _submit(db: Database, spec: JobSpec = SPEC) -> int:
    with db.session() as s:
        job, _ = jobs.submit_job(s, spec, owner="o")
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
        return job.id


def _claim(db: Database, lease_s: float = 60) -> Job:
    with db.session() as s:
        job = claims.claim_next_job(
            s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=lease_s
        )
        assert job is not None
        s.expunge(job)
        return job


def _held(db: Database, job_id: int) -> HeldRun:
    with db.session(write=False) as s:
        job = jobs.get_job(s, job_id)
        return HeldRun(job.id, job.attempt, JobState(job.state), job.restarts, max_restarts=1)


def _apply(db: Database, run: HeldRun, status: RunStatus | None, shutdown: bool = False) -> None:
    decision = decide_on_shutdown(run, status) if shutdown else decide_on_status(run, status)  # type: ignore[arg-type]
    assert decision is not None
    with db.session() as s:
        jobs.apply_transition(
            s, decision.transition, worker_id="w", error=decision.error,
            values=dict(decision.values) or None,
        )  # fmt: skip


def test_state_changes_and_notes_carry_their_kind(db: Database) -> None:
    job_id = _submit(db)
    _claim(db)
    _apply(db, _held(db, job_id), RunStatus(RunPhase.RUNNING))
    with db.session() as s:
        notes.record_job_note(
            s, job_id, 1, EventKind.MORE_RANKS_THAN_CORES,
            {"nproc_per_node": 4, "cpus": 2, "batch_size": 8}, worker_id="w",
        )  # fmt: skip
        for code in ("Priority", "Priority", "Resources"):
            notes.record_scheduler_pending(s, job_id, 1, code, "words")
        pending = notes.latest_scheduler_pending(s, job_id, 1)
        assert pending is not None and pending.code == "Resources"
        assert notes.latest_scheduler_pending(s, job_id, 2) is None
        record_checkpoint_failure(s, job_id, 1, step=3, reason="disk full")
    failed = RunStatus(RunPhase.FAILED, "rank 0 exited 1", failure=FailureReason.ERROR)
    _apply(db, _held(db, job_id), failed)  # a restart is left: requeued
    _claim(db, lease_s=0.0)
    with db.session() as s:
        reaped = leases.requeue_expired_jobs(s)
    assert [t.kind for t in reaped] == [EventKind.WORKER_LOST]
    assert _events(db, job_id) == [
        ("submitted", {}),
        ("claimed", {}),
        ("launched", {}),
        ("more_ranks_than_cores", {"nproc_per_node": 4, "cpus": 2, "batch_size": 8}),
        ("scheduler_pending", {"code": "Priority", "words": "words"}),
        ("scheduler_pending", {"code": "Resources", "words": "words"}),
        ("checkpoint_failed", {"step": 3, "reason": "disk full"}),
        ("retried", {"restart": 1, "max_restarts": 1, "error": "rank 0 exited 1"}),
        ("claimed", {}),
        ("worker_lost", {}),
    ]

    # A requeue of a job whose cancel was requested ends it cancelled instead.
    _claim(db)
    _apply(db, _held(db, job_id), RunStatus(RunPhase.RUNNING))
    with db.session() as s:
        jobs.cancel_job(s, job_id)
    _apply(db, _held(db, job_id), None, shutdown=True)
    assert _events(db, job_id)[-1] == (
        "cancelled_instead_of_requeue",
        {"instead_of": "worker stopped", "requeue_kind": "worker_stopped"},
    )

    queued = _submit(db)
    with db.session() as s:
        jobs.cancel_job(s, queued)
    assert _kinds(db, queued) == ["submitted", "cancelled_while_queued"]
    _assert_reasons_are_worded(db)


def test_the_worker_decisions_carry_their_kind(db: Database) -> None:
    ids = [_submit(db) for _ in range(5)]
    for _ in ids:
        _claim(db)
    preempted, succeeded, outside, honoured, orphan = ids
    _apply(db, _held(db, preempted), RunStatus(RunPhase.PREEMPTED, "PREEMPTED"))
    _apply(db, _held(db, succeeded), RunStatus(RunPhase.SUCCEEDED))
    _apply(db, _held(db, outside), RunStatus(RunPhase.CANCELLED, "Slurm job 9 cancelled"))
    run = _held(db, honoured)
    run.cancel_requested = True
    _apply(db, run, RunStatus(RunPhase.CANCELLED))
    with db.session() as s:
        held = leases.heartbeat(s, "w", lease_s=60)
    (requeue,) = reconcile({}, held).orphans  # held by "w", run by nobody
    with db.session() as s:
        jobs.apply_transition(s, requeue.transition, worker_id="w")
    assert _kinds(db, orphan)[-1] == "orphaned"
    assert _events(db, preempted)[-1] == ("preempted", {"detail": "PREEMPTED"})
    assert _kinds(db, succeeded)[-1] == "succeeded"
    assert _events(db, outside)[-1] == ("cancelled_outside", {"detail": "Slurm job 9 cancelled"})
    assert _kinds(db, honoured)[-1] == "cancelled"
    _assert_reasons_are_worded(db)


def test_the_batch_claim_writes_claimed_events(db: Database) -> None:
    ids = [_submit(db) for _ in range(3)]
    with db.session() as s:
        batch = batch_claims.claim_trial_batch(
            s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=60, limit=3
        )
        assert batch is not None
    for job_id in ids[: len(batch.jobs)]:
        assert _kinds(db, job_id) == ["submitted", "claimed"]


def test_checkpoint_events_carry_their_kind(db: Database) -> None:
    spec = JobSpec(name="c", task="regression", training={"keep_checkpoints": 1})
    job_id = _submit(db, spec)
    _claim(db)
    _apply(db, _held(db, job_id), RunStatus(RunPhase.RUNNING))
    with db.session() as s:
        for step in (1, 2):
            record_checkpoint(
                s, job_id, 1, step=step, epoch=0, path=f"/x/{step}", size_bytes=1, sha256="0" * 64
            )
            apply_retention(s, job_id)
        record_note(s, job_id, 1, "upload_fallback", step=None, total_steps=None)
        record_note(s, job_id, 1, "upload_fallback", step=None, total_steps=None)
        record_note(s, job_id, 1, "nothing_to_train", step=9, total_steps=5)
    _apply(db, _held(db, job_id), RunStatus(RunPhase.PREEMPTED))
    _claim(db)
    with db.session() as s:
        job = leases.check_attempt(s, job_id, 2)
        note_rank_deletions(s, job, 2, [2], damaged=True)
        note_rank_deletions(s, job, 2, [7], damaged=False)
        note_fresh_start(s, job, 2)
        note_fresh_start(s, job, 2)  # once per attempt
    assert [e for e in _events(db, job_id) if e[0].startswith(("checkpoint", "upload", "nothing",
                                                                "fresh"))] == [
        ("checkpoint_deleted", {"step": 1, "keep": 1}),
        ("upload_fallback", {}),
        ("nothing_to_train", {"step": 9, "total_steps": 5}),
        ("checkpoint_damaged", {"step": 2}),
        ("checkpoint_unplaced", {"step": 7}),
        ("fresh_start", {"attempt": 2, "damaged_steps": [2]}),
    ]  # fmt: skip
    _assert_reasons_are_worded(db)


def test_sweep_events_carry_their_kind(api: TestClient, db: Database) -> None:
    body = {
        "name": "s", "base": {"name": "b", "task": "regression", "training": {"max_steps": 5}},
        "axes": {"training.lr": {"grid": [0.001, 0.01, 0.1]}}, "max_failed": 1,
    }  # fmt: skip
    r = api.post(f"{API}/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    rows = api.get(f"{API}/sweeps/{sweep_id}/trials").json()["trials"]
    first, second, third = (t["job_id"] for t in rows)
    assert _events(db, first) == [("trial_submitted", {"sweep_id": sweep_id, "position": 0})]
    with db.session() as s:
        workers.register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
    _claim(db)  # the first trial
    _apply(db, _held(db, first), RunStatus(RunPhase.RUNNING))
    _claim(db)  # the second
    _apply(db, _held(db, second), RunStatus(RunPhase.RUNNING))
    _apply(db, _held(db, second), RunStatus(RunPhase.FAILED, "boom", failure=FailureReason.SETUP))
    reap_once(db)  # max_failed 1: the rest is cancelled, the running one flagged
    stop = {"sweep_id": sweep_id, "failed": 1, "max_failed": 1}
    assert _events(db, first)[-1] == ("sweep_stopped", {**stop, "cancel_requested": True})
    assert _events(db, third)[-1] == ("sweep_stopped", stop)
    sweep = api.get(f"{API}/sweeps/{sweep_id}").json()
    assert sweep["stop_reason"] == render(EventKind.SWEEP_STOPPED, stop)

    _apply(db, _held(db, first), RunStatus(RunPhase.CANCELLED))  # its worker honours the flag
    reap_once(db)
    r = api.post(f"{API}/sweeps/{sweep_id}/retry-failed")
    assert r.status_code in (200, 202), r.text
    rows = api.get(f"{API}/sweeps/{sweep_id}/trials").json()["trials"]
    retried = rows[1]["job_id"]
    assert retried != second
    kind, data = _events(db, retried)[0]
    assert kind == "trial_retried" and data["failed_job_id"] == second, data
    r = api.post(f"{API}/sweeps/{sweep_id}/cancel")
    assert r.status_code in (200, 202), r.text
    assert _events(db, retried)[-1][0] == "sweep_cancelled"
    _assert_reasons_are_worded(db)
    events = api.get(f"{API}/jobs/{retried}/events").json()["events"]
    assert [e["kind"] for e in events] == ["trial_retried", "sweep_cancelled"]
    assert events[-1]["data"]["by"] and events[-1]["reason"].startswith(f"sweep {sweep_id} ")


# -- the migration's backfill ------------------------------------------------------------------

# (from_state, to_state, reason as revision 0006's code wrote it) → (kind, data) after 0007
OLD_ROWS: list[tuple[str | None, str, str | None, str, dict[str, Any]]] = [
    (None, "queued", None, "submitted", {}),
    (None, "queued", "trial 2 of sweep 5", "trial_submitted", {"sweep_id": 5, "position": 2}),
    ("queued", "starting", "claimed", "claimed", {}),
    ("starting", "running", "launched", "launched", {}),
    ("starting", "starting", "scheduler pending: Priority — jobs ahead",
     "scheduler_pending", {"code": "Priority", "words": "jobs ahead"}),
    ("running", "running", "checkpoint at step 4 deleted: keep_checkpoints=2 keeps newer ones",
     "checkpoint_deleted", {"step": 4, "keep": 2}),
    ("running", "queued", "retry 1/3: boom", "retried",
     {"restart": 1, "max_restarts": 3, "error": "boom"}),
    ("running", "queued", "worker lost: lease expired", "worker_lost", {}),
    ("running", "running", "worker lost: lease expired", "note",
     {"text": "worker lost: lease expired"}),
    ("running", "cancelled", "cancel requested", "cancelled", {}),
    ("running", "failed", "rank 1 failed: x", "failed", {"error": "rank 1 failed: x"}),
    ("running", "succeeded", "succeeded", "succeeded", {}),
]  # fmt: skip


def test_the_migration_backfills_kinds_from_the_old_texts(db_url: str) -> None:
    db = Database.from_url(db_url)
    try:
        migrate.upgrade(db.engine, "0006")
        with db.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, name, owner, state, spec, launcher, gpus_per_node, "
                    "priority, attempt, restarts, cancel_requested, created_at, updated_at) "
                    "VALUES (1, 'old', 'o', 'running', '{}', 'local', 0, 0, 1, 0, false, "
                    "'2026-01-01 00:00:00', '2026-01-01 00:00:00')"
                )
            )
            # Revision 0006's table has no kind or data: written with SQL text, not the model.
            for f, t, r, _, _ in OLD_ROWS:
                conn.execute(
                    text(
                        "INSERT INTO job_events (job_id, attempt, from_state, to_state, reason, "
                        "created_at) VALUES (1, 1, :f, :t, :r, '2026-01-01 00:00:00')"
                    ),
                    {"f": f, "t": t, "r": r},
                )
        migrate.upgrade(db.engine)
        with db.session(write=False) as s:
            got = [(e.kind, e.data, e.reason) for e in jobs.list_events(s, 1)]
        assert got == [(k, d, r) for _, _, r, k, d in OLD_ROWS]
        migrate.downgrade(db.engine, "0006")
        with db.engine.connect() as conn:
            reasons = conn.execute(text("SELECT reason FROM job_events ORDER BY id")).scalars()
            assert list(reasons) == [r for _, _, r, _, _ in OLD_ROWS], "reasons kept"
        migrate.upgrade(db.engine)
        with db.session(write=False) as s:
            assert [e.kind for e in jobs.list_events(s, 1)] == [k for _, _, _, k, _ in OLD_ROWS]
    finally:
        db.dispose()
