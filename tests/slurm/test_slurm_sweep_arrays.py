"""A sweep's trials as Slurm job arrays on the real dev cluster: the worker claims batches of
one sweep's trials and submits each batch as one array, within the sweep's max_concurrent;
arrays bigger than the cluster's MaxArraySize are split; a requeued element resumes its own
trial only."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from service.core.config import Settings
from service.core.states import JobState
from service.core.sweeps.spec import SweepSpec, plan_trials, resolve_objective
from service.store import migrate
from service.store.db import Database
from service.store.jobs import crud as jobs
from service.store.models import Job, JobEvent
from service.store.sweeps import crud as sweeps
from tests.slurm.conftest import (
    SlurmDb,
    assert_no_database_url,
    count_losses,
    job_row,
    loss_steps,
    running_worker,
    serving_api,
    slurm_settings,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slurm

ELEMENT_ID = re.compile(r"^(\d+)_(\d+)$")
BASE: dict[str, Any] = {
    "task": "regression",
    "launcher": "slurm",
    "backend": "gloo",
    "resources": {"nnodes": 1, "nproc_per_node": 2, "timeout_min": 10},
    "training": {"max_steps": 12, "batch_size": 16},
    "config": {"num_samples": 512, "sleep_per_step_ms": 50},
}


def _submit_sweep(
    db: Database, settings: Settings, *, lrs: list[float], max_concurrent: int | None,
    base: dict[str, Any] | None = None,
) -> list[int]:  # fmt: skip
    """Store a sweep over ``training.lr``; its trials' job ids, in trial order."""
    spec = SweepSpec.model_validate({
        "name": "arrays", "base": base or BASE, "axes": {"training.lr": {"grid": lrs}},
        "max_concurrent": max_concurrent,
    })  # fmt: skip
    planned = plan_trials(spec, settings)
    with db.session() as s:
        sweep = sweeps.submit_sweep(s, spec, resolve_objective(spec), planned, owner="test")
        sweep_id = sweep.id
    with db.session(write=False) as s:
        return list(s.scalars(select(Job.id).where(Job.sweep_id == sweep_id).order_by(Job.id)))


def _all_ended(db: Database, job_ids: list[int]) -> bool:
    return all(JobState(job_row(db, j).state).is_terminal for j in job_ids)


def _sacct(ids: set[str]) -> dict[str, tuple[str, datetime | None, datetime | None]]:
    """sacct's JobID → (State, Start, End) for every element of the arrays ``ids``."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-o", "JobID,State,Start,End", "-j", ",".join(sorted(ids))],
        capture_output=True, text=True, timeout=20, check=True,
    ).stdout  # fmt: skip

    def _time(text: str) -> datetime | None:
        try:
            return datetime.fromisoformat(text)
        except ValueError:  # "Unknown", "None"
            return None

    rows = {}
    for line in out.splitlines():
        job_id, state, start, end = line.split("|")
        rows[job_id] = (state.split(" ")[0], _time(start), _time(end))
    return rows


def _most_at_once(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most half-open intervals [start, end) that overlap at one instant."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in edges:  # an end sorts before a start at the same second (-1 < 1)
        now += step
        most = max(most, now)
    return most


def _most_active_in_events(db: Database, job_ids: list[int]) -> int:
    """Replaying the trials' job events in commit order: the most trials starting or running
    at once."""
    with db.session(write=False) as s:
        events = s.execute(
            select(JobEvent.job_id, JobEvent.to_state)
            .where(JobEvent.job_id.in_(job_ids))
            .order_by(JobEvent.id)
        ).all()
    state: dict[int, str] = {}
    most = 0
    for job_id, to_state in events:
        state[job_id] = to_state
        most = max(most, sum(v in ("starting", "running") for v in state.values()))
    return most


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SlurmDb]:
    """``slurm_db`` on SQLite, or the same on a PostgreSQL schema of its own."""
    if request.param == "sqlite":
        yield request.getfixturevalue("slurm_db")
        return
    settings = slurm_settings(tmp_path, request.getfixturevalue("pg_schema_url"))
    db = Database.from_url(settings.resolved_database_url)
    migrate.upgrade(db.engine)
    try:
        with serving_api(settings) as served:
            yield served, db
    finally:
        db.dispose()


def test_eight_trials_with_max_concurrent_2_run_as_arrays(any_db: SlurmDb) -> None:
    settings, db = any_db
    job_ids = _submit_sweep(db, settings, lrs=[0.001 * (i + 1) for i in range(8)],
                            max_concurrent=2)  # fmt: skip
    with running_worker(settings, slots=8):
        wait_until(lambda: _all_ended(db, job_ids), 600, "the 8 trials to end")
    rows = [job_row(db, j) for j in job_ids]
    assert [r.state for r in rows] == ["succeeded"] * 8, [(r.id, r.state, r.error) for r in rows]
    # Each trial's scheduler_job_id is its array element's id, as sacct shows it.
    handles = [r.scheduler_job_id or "" for r in rows]
    assert all(ELEMENT_ID.match(h) for h in handles), handles
    arrays = {h.split("_")[0] for h in handles}
    assert len(arrays) < 8, f"no trials shared an array: {handles}"
    sacct = _sacct(arrays)
    assert {h: sacct[h][0] for h in handles} == dict.fromkeys(handles, "COMPLETED"), sacct
    # Never more than 2 at once: in Slurm (element start/end) and in ddpq (job events).
    spans = [(sacct[h][1], sacct[h][2]) for h in handles]
    assert all(s and e for s, e in spans), spans
    assert _most_at_once([(s, e) for s, e in spans if s and e]) <= 2, spans
    assert _most_active_in_events(db, job_ids) == 2
    for job_id in job_ids:
        assert loss_steps(db, job_id) == list(range(1, 13))
    assert_no_database_url(settings, job_ids[0])  # the array's folder, through the link


@pytest.fixture
def max_array_size_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``scontrol`` first on PATH that reports ``MaxArraySize = 3`` for ``show config`` and
    runs the real scontrol for everything else (the dev cluster's limit is Slurm's 1001, and
    it is shared: its slurm.conf is not the test's to change). Returns its call log."""
    real = shutil.which("scontrol")
    assert real, "scontrol is not installed"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol-calls.txt"
    fake = bin_dir / "scontrol"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'if [ "$1 $2" = "show config" ]; then\n'
        "  echo 'MaxArraySize            = 3'\n  exit 0\nfi\n"
        f'exec {real} "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_a_batch_bigger_than_max_array_size_is_split_into_arrays_of_two_node_trials(
    slurm_db: SlurmDb, max_array_size_3: Path
) -> None:
    settings, db = slurm_db
    base = {**BASE, "resources": {"nnodes": 2, "nproc_per_node": 1, "timeout_min": 10}}
    job_ids = _submit_sweep(db, settings, lrs=[0.01, 0.02, 0.03, 0.04], max_concurrent=None,
                            base=base)  # fmt: skip
    with running_worker(settings, slots=4):
        wait_until(lambda: _all_ended(db, job_ids), 400, "the 4 trials to end")
    rows = [job_row(db, j) for j in job_ids]
    assert [r.state for r in rows] == ["succeeded"] * 4, [(r.id, r.state, r.error) for r in rows]
    elements = [ELEMENT_ID.match(r.scheduler_job_id or "") for r in rows]
    assert all(elements), [r.scheduler_job_id for r in rows]
    # One claim of 4 trials, MaxArraySize 3: an array of 3 (indices 0-2) and one of 1.
    sizes: dict[str, list[int]] = {}
    for m in elements:
        assert m is not None
        sizes.setdefault(m.group(1), []).append(int(m.group(2)))
    assert sorted(sorted(v) for v in sizes.values()) == [[0], [0, 1, 2]], sizes
    # MaxArraySize was read once (cached), not per batch.
    assert max_array_size_3.read_text().splitlines().count("show config") == 1
    for job_id in job_ids:  # each element a 2-node DDP job: a rank on each node
        attempt_dir = settings.resolved_artifact_dir / "jobs" / str(job_id) / "attempt-1"
        assert (attempt_dir / "rank-0.log").exists() and (attempt_dir / "rank-1.log").exists()
        assert loss_steps(db, job_id) == list(range(1, 13))


def test_a_requeued_element_resumes_its_own_trial_only(slurm_db: SlurmDb) -> None:
    settings, db = slurm_db
    base = {**BASE, "training": {"max_steps": 50, "batch_size": 16, "checkpoint_every_steps": 10},
            "config": {"num_samples": 4096, "sleep_per_step_ms": 150}}  # fmt: skip
    first, second = _submit_sweep(db, settings, lrs=[0.01, 0.02], max_concurrent=2, base=base)
    with running_worker(settings, slots=2):
        wait_until(
            lambda: count_losses(db, first) >= 12 and count_losses(db, second) >= 1,
            180,
            "both trials past a checkpoint",
        )
        element = job_row(db, first).scheduler_job_id
        other = job_row(db, second).scheduler_job_id
        assert element and other and element.split("_")[0] == other.split("_")[0], (element, other)
        subprocess.run(["scontrol", "requeue", element], check=True, timeout=20)
        wait_until(lambda: _all_ended(db, [first, second]), 300, "both trials to end")
    a, b = job_row(db, first), job_row(db, second)
    assert (a.state, b.state) == ("succeeded", "succeeded"), (a.error, b.error)
    assert a.attempt == 2 and a.restarts == 0, "the requeued trial resumes as attempt 2"
    assert a.scheduler_job_id != element and ELEMENT_ID.match(a.scheduler_job_id or "")
    assert b.attempt == 1 and b.scheduler_job_id == other, "the other trial ran on untouched"
    assert loss_steps(db, first) == list(range(1, 51))
    assert loss_steps(db, second) == list(range(1, 51))


def test_cancelling_one_trial_cancels_its_element_only(slurm_db: SlurmDb) -> None:
    settings, db = slurm_db
    base = {**BASE, "training": {"max_steps": 40, "batch_size": 16},
            "config": {"num_samples": 4096, "sleep_per_step_ms": 150}}  # fmt: skip
    first, second = _submit_sweep(db, settings, lrs=[0.01, 0.02], max_concurrent=2, base=base)
    with running_worker(settings, slots=2):
        wait_until(lambda: count_losses(db, first) > 0, 180, "the first trial to report")
        element = job_row(db, first).scheduler_job_id
        with db.session() as s:
            jobs.cancel_job(s, first)
        wait_until(lambda: _all_ended(db, [first, second]), 300, "both trials to end")
    a, b = job_row(db, first), job_row(db, second)
    assert (a.state, b.state) == ("cancelled", "succeeded"), (a.error, b.error)
    assert (
        element and b.scheduler_job_id and element.split("_")[0] == b.scheduler_job_id.split("_")[0]
    ), "both trials ran in one array"
    states = _sacct({element.split("_")[0]})
    assert states[element][0] == "CANCELLED" and states[b.scheduler_job_id][0] == "COMPLETED"
    assert loss_steps(db, second) == list(range(1, 41))
