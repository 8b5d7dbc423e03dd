"""The worker's pure decisions: launcher observations and heartbeats → transitions."""

from __future__ import annotations

import itertools
import random
import string
from pathlib import Path

import pytest

from service.core.config import Settings
from service.core.states import JobState, can_transition
from service.store.jobs.crud import Transition
from service.store.workers.registry import HeldJob
from worker.attempt import FailureReason, error_headline
from worker.decisions import (
    PHASE_DECISIONS,
    Decision,
    GpuPool,
    HeldRun,
    decide_on_launch_error,
    decide_on_shutdown,
    decide_on_status,
    reconcile,
    summarize,
)
from worker.launchers.base import LaunchPlan, RunPhase, RunStatus
from worker.main import detect_gpus, parse_gpus
from worker.up import settings_env


def _run(state: JobState = JobState.RUNNING, **kw: object) -> HeldRun:
    return HeldRun(job_id=4, attempt=2, state=state, handle="99", **kw)  # type: ignore[arg-type]


def test_every_phase_has_a_decision() -> None:
    assert set(PHASE_DECISIONS) == set(RunPhase), "add the new RunPhase to PHASE_DECISIONS"


@pytest.mark.parametrize(
    ("state", "phase", "cancel", "restarts", "max_restarts"),
    list(
        itertools.product(
            [JobState.STARTING, JobState.RUNNING], list(RunPhase), [False, True], [0, 1], [0, 1]
        )
    ),
)
def test_every_decision_is_allowed_by_the_transition_table(
    state: JobState, phase: RunPhase, cancel: bool, restarts: int, max_restarts: int
) -> None:
    run = _run(state, cancel_requested=cancel, restarts=restarts, max_restarts=max_restarts)
    decision = decide_on_status(run, RunStatus(phase, "why"))
    if decision is not None:
        t = decision.transition
        assert (t.job_id, t.expected) == (4, state)
        assert can_transition(t.expected, t.target), f"{phase} from {state} → {t.target}"


def test_running_phase_marks_a_starting_job_running_once() -> None:
    d = decide_on_status(_run(JobState.STARTING), RunStatus(RunPhase.RUNNING))
    assert d == Decision(Transition(4, JobState.STARTING, JobState.RUNNING, "launched"))
    assert decide_on_status(_run(JobState.RUNNING), RunStatus(RunPhase.RUNNING)) is None
    assert decide_on_status(_run(JobState.STARTING), RunStatus(RunPhase.PENDING)) is None


def test_success_and_cancel() -> None:
    d = decide_on_status(_run(), RunStatus(RunPhase.SUCCEEDED, exit_code=-6))
    assert d is not None and d.transition.target == JobState.SUCCEEDED and d.releases
    d = decide_on_status(_run(cancel_requested=True), RunStatus(RunPhase.CANCELLED))
    assert d is not None and d.transition.target == JobState.CANCELLED
    assert d.transition.reason == "cancel requested" and d.error is None
    # Ranks killed by our cancel may look failed to a backend: still cancelled.
    d = decide_on_status(_run(cancel_requested=True), RunStatus(RunPhase.FAILED, "exit 143"))
    assert d is not None and d.transition.target == JobState.CANCELLED
    d = decide_on_status(_run(), RunStatus(RunPhase.CANCELLED, "scancel by admin"))
    assert d is not None and d.error == "scancel by admin"


def test_failure_is_retried_while_restarts_are_left() -> None:
    error = "rank 1 failed: RuntimeError: boom\nTraceback ..."
    d = decide_on_status(_run(restarts=0, max_restarts=2), RunStatus(RunPhase.FAILED, error))
    assert d is not None and d.transition.target == JobState.QUEUED
    assert d.transition.reason == "retry 1/2: rank 1 failed: RuntimeError: boom"
    assert dict(d.values) == {"restarts": 1} and d.releases
    d = decide_on_status(_run(restarts=2, max_restarts=2), RunStatus(RunPhase.FAILED, error))
    assert d is not None and d.transition.target == JobState.FAILED
    assert d.error == error and d.transition.reason == "rank 1 failed: RuntimeError: boom"
    assert not d.values


def test_preemption_requeues_without_counting_a_restart() -> None:
    d = decide_on_status(_run(max_restarts=0), RunStatus(RunPhase.PREEMPTED, "PREEMPTED"))
    assert d is not None and d.transition.target == JobState.QUEUED
    assert d.transition.reason == "preempted: PREEMPTED" and not d.values


def test_launch_error_fails_or_retries() -> None:
    d = decide_on_launch_error(_run(JobState.STARTING), "launch failed: OSError: nope")
    assert d.transition == Transition(
        4, JobState.STARTING, JobState.FAILED, "launch failed: OSError: nope"
    )
    assert d.error == "launch failed: OSError: nope"
    d = decide_on_launch_error(_run(JobState.STARTING, max_restarts=1), "launch failed: x")
    assert d.transition.target == JobState.QUEUED


@pytest.mark.parametrize(
    ("phase", "cancel", "target"),
    [
        (RunPhase.CANCELLED, False, JobState.QUEUED),
        (RunPhase.FAILED, False, JobState.QUEUED),
        (RunPhase.SUCCEEDED, False, JobState.SUCCEEDED),
        (RunPhase.CANCELLED, True, JobState.CANCELLED),
        (None, False, JobState.QUEUED),
    ],
)
def test_shutdown_requeues_unless_finished_or_cancelled(
    phase: RunPhase | None, cancel: bool, target: JobState
) -> None:
    status = RunStatus(phase) if phase is not None else None
    d = decide_on_shutdown(_run(cancel_requested=cancel, max_restarts=0), status)
    assert d.transition.target == target
    assert not d.values, "a worker shutdown never counts as a restart"
    if target == JobState.QUEUED:
        assert d.transition.reason == "worker stopped"


def test_reconcile() -> None:
    runs = {
        1: HeldRun(1, 1, JobState.STARTING),
        2: HeldRun(2, 1, JobState.RUNNING),
        3: HeldRun(3, 1, JobState.RUNNING),
        4: HeldRun(4, 1, JobState.RUNNING),
    }
    held = [
        HeldJob(1, 1, "running", False),  # state moved on
        HeldJob(2, 1, "running", True),  # cancel requested
        HeldJob(4, 2, "starting", False),  # requeued and claimed again elsewhere/later
        HeldJob(9, 3, "running", False),  # held in the DB, unknown here
    ]
    r = reconcile(runs, held)
    assert set(r.lost) == {3, 4}
    assert dict(r.states) == {1: JobState.RUNNING}
    assert r.cancel_requested == frozenset({2})
    assert [d.transition for d in r.orphans] == [
        Transition(9, JobState.RUNNING, JobState.QUEUED, "held by this worker but not running here")
    ]


def test_gpu_pool() -> None:
    pool = GpuPool([3, 1, 2])
    assert pool.free == 3
    assert pool.take(2) == (1, 2)
    assert pool.take(2) is None, "only one GPU is left"
    assert pool.take(0) == ()
    pool.give((1, 2))
    assert pool.free == 3 and pool.take(3) == (1, 2, 3)


def test_parse_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_gpus("0,1") == [0, 1]
    assert parse_gpus("none") == [] and parse_gpus("") is None and parse_gpus("auto") is None
    for bad in ("a,b", "1,1", "-1"):
        with pytest.raises(ValueError):
            parse_gpus(bad)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert detect_gpus() == [2, 5]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect_gpus() == []


def test_summarize() -> None:
    assert summarize("a\nb") == "a"
    assert summarize(None) == ""
    assert summarize("x" * 500, 10) == "x" * 9 + "…"


def test_a_rendered_plan_masks_a_database_password() -> None:
    plan = LaunchPlan(
        "local", 1, 1, ["torchrun"], {"DDPQ_DATABASE_URL": "postgresql://u:s3cret@h/db"}, "/", "/"
    )
    text = plan.render()
    assert "s3cret" not in text and "u:***@h/db" in text


def test_settings_env_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = Settings(
        home=tmp_path,
        port=8123,
        allowed_entrypoints=["examples.*:*"],
        slurm_enabled=True,
        heartbeat_interval_s=0.25,
        token="tok",
    )
    env = settings_env(original)
    assert env["DDPQ_TOKEN"] == "tok" and "DDPQ_DATABASE_URL" not in env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert Settings() == original


# -- the retry policy reads FailureReason, never the message ------------------------------

NEVER_RETRIED = {FailureReason.NONFINITE_LOSS, FailureReason.SETUP}


def _reworded(reason: FailureReason, rng: random.Random) -> list[str | None]:
    """The message a launcher writes for ``reason``, and rewordings of it: random text, no text,
    and text that starts like another reason's message."""
    headline = error_headline(
        {"rank": 1, "reason": str(reason), "exc_type": "RuntimeError", "message": "boom"}
    )
    noise = "".join(rng.choice(string.printable) for _ in range(rng.randint(1, 80)))
    others = [f"{other}: {noise}" for other in FailureReason if other != reason]
    return [headline, noise, "", None, headline.replace(str(reason), "x"), *others]


@pytest.mark.parametrize("reason", list(FailureReason))
@pytest.mark.parametrize(("restarts", "max_restarts"), [(0, 2), (1, 2), (2, 2), (0, 0)])
def test_rewording_a_failure_message_never_changes_the_retry_decision(
    reason: FailureReason, restarts: int, max_restarts: int
) -> None:
    rng = random.Random(f"{reason}-{restarts}-{max_restarts}")
    run = _run(restarts=restarts, max_restarts=max_restarts)
    retried = restarts < max_restarts and reason not in NEVER_RETRIED
    for text in _reworded(reason, rng):
        d = decide_on_status(run, RunStatus(RunPhase.FAILED, text, failure=reason))
        assert d is not None
        assert d.transition.target == (JobState.QUEUED if retried else JobState.FAILED), text
        assert dict(d.values) == ({"restarts": restarts + 1} if retried else {}), text


def test_a_failure_without_a_reason_is_retried_whatever_its_text_says() -> None:
    for text in ("setup: rank 0 failed before its first step: E: x", "nonfinite_loss: nan"):
        d = decide_on_status(_run(max_restarts=1), RunStatus(RunPhase.FAILED, text))
        assert d is not None and d.transition.target == JobState.QUEUED, text
