"""What a worker notes about an attempt beyond its state, through a real ``WorkerLoop`` on
SQLite and PostgreSQL with scripted launchers (fakes of our own interface): a CPU job with
more ranks than cores gets an event saying so; a Slurm-like launcher's pending reasons are
asked for all pending attempts at once and recorded when they change. Plus squeue parsing
and the plain words of Slurm's reason codes."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.core.config import Settings
from service.core.events import EventKind, render
from service.core.pending_reasons import describe_slurm_reason
from service.core.spec.model import JobSpec
from service.store.db import Database
from service.store.jobs import crud as jobs
from tests.integration.test_loop_worker import ScriptedLauncher, _job, _loop, _reasons, _submit
from worker.attempt_notes import oversubscription_note
from worker.launchers.base import RunPhase, RunStatus
from worker.launchers.slurm.pending import parse_squeue_reasons, squeue_pending_command


def test_more_ranks_than_cores_is_an_event(settings: Settings, db: Database) -> None:
    loop = _loop(settings, db, ScriptedLauncher(), cpus=2)
    crowded = _submit(db, resources={"nproc_per_node": 16}, training={"batch_size": 8})
    loop.tick()
    notes = [r for f, t, r in _reasons(db, crowded) if f == t == "starting"]
    assert notes and notes[0] is not None
    assert notes[0].startswith("16 ranks on 2 CPU cores of this worker")
    assert "global batch is 16 × batch_size 8 = 128 samples per step" in notes[0]
    assert _job(db, crowded).state == "running", "a note, not a refusal"
    fits = _submit(db, resources={"nproc_per_node": 2})
    _loop(settings, db, ScriptedLauncher(), cpus=2).tick()
    assert all(f != t for f, t, _ in _reasons(db, fits)), "2 ranks on 2 cores: no note"


@dataclass
class PendingLauncher(ScriptedLauncher):
    """A detached, batch-polled launcher whose attempts stay pending, for reasons the test
    sets; counts its reason queries."""

    name: str = "slurm"
    reasons: dict[str, str] = field(default_factory=dict)
    queries: list[list[str]] = field(default_factory=list)

    def poll_many(self, handles: list[str]) -> dict[str, RunStatus]:
        return {h: RunStatus(RunPhase.PENDING) for h in handles}

    def poll(self, handle: str) -> RunStatus:
        return RunStatus(RunPhase.PENDING)

    def pending_reasons(self, handles: list[str]) -> dict[str, str]:
        self.queries.append(handles)
        return {h: self.reasons[h] for h in handles if h in self.reasons}


def test_pending_reasons_are_asked_at_once_and_recorded_on_change(
    settings: Settings, db: Database
) -> None:
    settings = settings.model_copy(update={"slurm_enabled": True})
    launcher = PendingLauncher()
    loop = _loop(settings, db, launcher, slots=4)
    a, b = _submit(db, launcher="slurm"), _submit(db, launcher="slurm")
    launcher.reasons = {f"{a}.1": "Priority", f"{b}.1": "Resources"}
    loop.tick()  # claims and submits both
    loop.pending.next_poll_mono = 0.0
    loop.tick()
    assert launcher.queries[-1] == sorted([f"{a}.1", f"{b}.1"]), "one query for all pending"

    def codes(job_id: int) -> list[str]:
        with db.session(write=False) as s:
            events = jobs.list_events(s, job_id)
        return [e.data["code"] for e in events if e.kind == EventKind.SCHEDULER_PENDING]

    assert codes(a) == ["Priority"] and codes(b) == ["Resources"]
    loop.pending.next_poll_mono = 0.0
    loop.tick()
    assert codes(a) == ["Priority"], "an unchanged reason is not recorded again"
    launcher.reasons[f"{a}.1"] = "Resources"
    loop.pending.next_poll_mono = 0.0
    loop.tick()
    assert codes(a) == ["Priority", "Resources"]
    queries = len(launcher.queries)
    loop.tick()
    assert len(launcher.queries) == queries, "at most one query per PENDING_REASON_POLL_S"


def test_squeue_command_and_parsing() -> None:
    assert squeue_pending_command(["12", "9", "12"]) == [
        "squeue", "--noheader", "--states=PENDING", "--jobs=12,9", "--format", "%i|%r",
    ]  # fmt: skip
    out = "12|Resources\n9|ReqNodeNotAvail, UnavailableNodes:ddpq-n1\nnoise\n13|\n"
    assert parse_squeue_reasons(out) == {
        "12": "Resources",
        "9": "ReqNodeNotAvail, UnavailableNodes:ddpq-n1",
    }


def test_slurm_reasons_in_plain_words() -> None:
    assert describe_slurm_reason("Priority").startswith("jobs with a higher Slurm priority")
    assert describe_slurm_reason("QOSMaxJobsPerUserLimit").startswith("its QOS allows no more")
    detailed = describe_slurm_reason("ReqNodeNotAvail, UnavailableNodes:ddpq-n1")
    assert detailed.startswith("a node it needs is down") and "ddpq-n1" in detailed
    assert "QOS" in describe_slurm_reason("QOSGrpNodeLimit")
    assert "man squeue" in describe_slurm_reason("SomethingNew")


def test_oversubscription_note_only_for_cpu_jobs() -> None:
    def spec(**resources: int) -> JobSpec:
        return JobSpec.model_validate({"name": "n", "task": "regression", "resources": resources})

    assert oversubscription_note(spec(nproc_per_node=3), cpus=2) is not None
    assert oversubscription_note(spec(nproc_per_node=2), cpus=2) is None
    assert oversubscription_note(spec(nproc_per_node=4, gpus_per_node=4), cpus=2) is None


def test_a_command_jobs_oversubscription_note_claims_no_batch_size() -> None:
    """A script picks its own batch size: the note must not quote the spec's default."""
    command = JobSpec.model_validate(
        {
            "name": "c",
            "command": ["t.py"],
            "workspace": "ab" * 32,
            "resources": {"nproc_per_node": 3},
        }
    )
    note = oversubscription_note(command, cpus=2)
    assert note == {"nproc_per_node": 3, "cpus": 2}
    text = render(EventKind.MORE_RANKS_THAN_CORES, note) or ""
    assert "the script's batch size" in text and "batch_size 32" not in text
