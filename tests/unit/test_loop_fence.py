"""The worker's lease fence: a worker cut off from the control plane stops its ranks before
the API may requeue the job, so that a partition never runs one job twice.

``WorkerLoop.run`` is driven to the end on a fake clock: the stop event's waits advance the
clock instead of sleeping, so every time asserted here is the fake clock's, never wall time.
The records and the launcher are fakes of our own interfaces
(``worker.control.records.WorkerRecords`` and ``worker.launchers.base.Launcher``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from service.core.config import Settings
from service.core.errors import DatabaseUnavailableError, WorkerTokenRefusedError
from service.core.events import EventKind
from service.core.holds import AdoptedJob, ClaimedJob, ClaimedJobs, HeldJob, Transition
from service.core.spec.model import JobSpec
from service.core.states import TERMINAL_STATES, JobState
from worker.control.fences import DEFAULT_CANCEL_GRACE_S
from worker.decisions import (
    Fence,
    HeldRun,
    decide_fences,
    reconcile,
    stop_budget_for,
)
from worker.launchers.base import LaunchPlan, RunPhase, RunStatus
from worker.loop import WorkerLoop

T0 = 1000.0  # the fake clock's start (monotonic seconds)


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ClockedStop(threading.Event):
    """The loop's stop event: a wait advances the fake clock by its timeout instead of
    sleeping; the event sets itself once the clock reaches ``until``."""

    def __init__(self, clock: FakeClock, until: float) -> None:
        super().__init__()
        self.clock, self.until = clock, until

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None, "the loop must never wait without a timeout"
        self.clock.advance(timeout)
        if self.clock.now >= self.until:
            self.set()
        return self.is_set()


@dataclass
class FakeRecords:
    """The control plane, unreachable while the clock is within ``outage`` (start, end):
    every call then raises ``DatabaseUnavailableError``. ``heartbeat_takes_s`` makes
    heartbeats slow (the clock advances that much during the call). No reaper: a job stays
    held here until the worker moves it, as when a partition ends before the API reaps."""

    clock: FakeClock
    worker_id: str = "w-fence"
    lease_s: float = 30.0  # the lease the control plane grants (``_loop`` sets the settings')
    call_timeout_s: float = 0.0  # calls fail at once here
    outage: tuple[float, float] = (math.inf, math.inf)
    heartbeat_takes_s: float = 0.0
    refused_from: float = math.inf  # from then on every call: the token was revoked
    queue: list[tuple[float, ClaimedJob]] = field(default_factory=list)  # (claimable at, job)
    held: dict[int, HeldJob] = field(default_factory=dict)
    applied: list[tuple[float, Transition]] = field(default_factory=list)
    calls: list[tuple[float, str]] = field(default_factory=list)  # every call tried

    def _call(self, name: str) -> None:
        self.calls.append((self.clock(), name))
        if self.clock() >= self.refused_from:
            raise WorkerTokenRefusedError("the API refused this worker's token (revoked)")
        start, end = self.outage
        if start <= self.clock() < end:
            raise DatabaseUnavailableError("control plane unreachable (test outage)")

    def submit(self, job_id: int, *, at: float = T0, gpus_per_node: int = 0) -> None:
        spec: dict[str, Any] = {"name": f"j{job_id}", "task": "regression"}
        if gpus_per_node:
            spec["resources"] = {"gpus_per_node": gpus_per_node}
        self.queue.append((at, ClaimedJob(job_id, 1, 0, 0, spec)))

    def register(self, *, host: str, pid: int, capacity: dict[str, Any]) -> None:
        self._call("register")

    def heartbeat(self) -> list[HeldJob]:
        self._call("heartbeat")
        self.clock.advance(self.heartbeat_takes_s)
        return list(self.held.values())

    def stop(self) -> None:
        self._call("stop")

    def _ready(self) -> list[tuple[float, ClaimedJob]]:
        return [(at, job) for at, job in self.queue if at <= self.clock()]

    def claim(self, max_gpus_per_node: int, wait_s: float = 0.0) -> ClaimedJob | None:
        """A long poll: with nothing claimable, the clock runs until a queued job becomes
        claimable or ``wait_s`` passes."""
        self._call("claim")
        ready = self._ready()
        if not ready:
            later = [at for at, _ in self.queue if at <= self.clock() + wait_s]
            self.clock.advance((min(later) if later else self.clock() + wait_s) - self.clock())
            ready = self._ready()
        if not ready:
            return None
        self.queue.remove(ready[0])
        job = replace(ready[0][1], attempt_token=f"token-{ready[0][1].job_id}")
        self.held[job.job_id] = HeldJob(job.job_id, job.attempt, JobState.STARTING, False)
        return job

    def claim_many(
        self, max_gpus_per_node: int, limit: int, wait_s: float = 0.0
    ) -> list[ClaimedJob]:
        job = self.claim(max_gpus_per_node, wait_s)
        return [job] if job is not None else []

    def claim_batch(
        self, max_gpus_per_node: int, limit: int, wait_s: float = 0.0
    ) -> ClaimedJobs | None:
        job = self.claim(max_gpus_per_node, wait_s)
        return ClaimedJobs((job,), None, None) if job is not None else None

    def record_handles(self, handles: Sequence[Any]) -> None:
        self._call("record_handles")

    def apply(
        self,
        transition: Transition,
        *,
        error: str | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> JobState:
        self._call("apply")
        self.applied.append((self.clock(), transition))
        held = self.held.pop(transition.job_id)
        if transition.target == JobState.QUEUED:  # the next attempt, claimable at once
            job = ClaimedJob(
                held.job_id, held.attempt + 1, 0, 0, {"name": "j", "task": "regression"}
            )
            self.queue.append((self.clock(), job))
        elif transition.target not in TERMINAL_STATES:
            self.held[held.job_id] = HeldJob(held.job_id, held.attempt, transition.target, False)
        return transition.target

    def adopter_of(self, job_id: int, attempt: int) -> str | None:
        self._call("adopter_of")
        return None

    def adopt(self) -> list[AdoptedJob]:
        self._call("adopt")
        return []

    def note(self, job_id: int, attempt: int, kind: EventKind, data: Mapping[str, Any]) -> bool:
        self._call("note")
        return True

    def note_pending_reason(self, job_id: int, attempt: int, code: str, words: str) -> bool:
        self._call("note_pending_reason")
        return True


@dataclass
class FakeLauncher:
    """Starts nothing; its attempts run until cancelled. Records when each was started and
    cancelled, on the fake clock."""

    clock: FakeClock
    name: str = "local"
    grace_s: float = 10.0  # what the local launcher's cancel may block (GracefulCanceller)
    started: list[tuple[float, str]] = field(default_factory=list)
    cancelled: list[tuple[float, str]] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)  # stopped by the fence (no upload wait)

    def plan(self, spec: JobSpec, job_id: int, attempt: int) -> LaunchPlan[Any]:
        return LaunchPlan(self.name, job_id, attempt, ["true"], {}, "/", "/tmp")

    def bind_gpus(self, plan: LaunchPlan[Any], gpus: Sequence[int]) -> LaunchPlan[Any]:
        return plan

    def start(self, plan: LaunchPlan[Any]) -> str:
        handle = f"{plan.job_id}.{plan.attempt}"
        self.started.append((self.clock(), handle))
        return handle

    def poll(self, handle: str) -> RunStatus:
        if any(h == handle for _, h in self.cancelled):
            return RunStatus(RunPhase.CANCELLED, "cancelled")
        return RunStatus(RunPhase.RUNNING)

    def cancel(self, handle: str) -> None:
        self.cancelled.append((self.clock(), handle))

    def stop_within_grace(self, handle: str) -> None:
        self.fenced.append(handle)
        self.cancel(handle)


def _settings(tmp_path: Path, *, lease_s: float, heartbeat_interval_s: float) -> Settings:
    return Settings(home=tmp_path, lease_s=lease_s, heartbeat_interval_s=heartbeat_interval_s)


def _loop(
    settings: Settings, records: FakeRecords, launcher: FakeLauncher, **kw: Any
) -> WorkerLoop:
    records.lease_s = settings.lease_s
    return WorkerLoop(settings, records, launcher, host="h", pid=1, clock=records.clock, **kw)


def _cancel_times(launcher: FakeLauncher, handle: str) -> list[float]:
    return [t for t, h in launcher.cancelled if h == handle]


# -- the pure decisions ----------------------------------------------------------------


def test_stop_budget_covers_the_cancel_grace_and_a_tick_but_at_most_half_the_lease() -> None:
    assert stop_budget_for(30.0, 10.0, 1.0) == 13.0, "grace 10 s + tick 1 s + margin 2 s"
    assert stop_budget_for(30.0, 0.5, 0.2) == pytest.approx(2.7)
    assert stop_budget_for(2.0, 10.0, 0.5) == 1.0, "a tiny lease: half of it, never more"


def test_a_run_is_fenced_from_its_deadline_on_and_not_before() -> None:
    runs = {
        4: HeldRun(job_id=4, attempt=2, state=JobState.RUNNING, renewed_mono=100.0),
        5: HeldRun(job_id=5, attempt=1, state=JobState.RUNNING, renewed_mono=None),
    }
    # Lease 30 s, budget 13 s: the deadline is 17 s after the renewal was sent.
    assert decide_fences(runs, now=116.9, lease_s=30.0, budget_s=13.0) == ()
    fences = decide_fences(runs, now=117.0, lease_s=30.0, budget_s=13.0)
    assert fences == (Fence(4, 2, 17.0, 13.0),), "job 5's renewal is unknown: never fenced"
    assert str(fences[0]) == (
        "job 4 attempt 2: lease not renewed for 17.0 s, lapses in 13.0 s at the earliest"
    )


def test_runs_due_while_the_first_ones_are_stopped_are_fenced_with_them() -> None:
    runs = {
        i: HeldRun(job_id=i, attempt=1, state=JobState.RUNNING, renewed_mono=100.0 + dt)
        for i, dt in [(1, 0.0), (2, 5.0), (3, 20.0)]
    }
    # Deadlines 117, 122 and 137 s; cancelling may block 10 s.
    assert decide_fences(runs, now=116.0, lease_s=30.0, budget_s=13.0, ahead_s=10.0) == ()
    fences = decide_fences(runs, now=117.0, lease_s=30.0, budget_s=13.0, ahead_s=10.0)
    assert [f.job_id for f in fences] == [1, 2], "job 2 falls due while job 1 is stopped"


def test_a_fenced_job_still_held_by_the_api_is_requeued_as_an_orphan() -> None:
    held = [HeldJob(7, 3, JobState.RUNNING, False)]
    plan = reconcile({}, held)  # fenced: no longer among the worker's runs
    assert plan.lost == () and plan.states == {}
    assert [d.transition for d in plan.orphans] == [
        Transition(7, JobState.RUNNING, JobState.QUEUED, "held by this worker but not running here")
    ]


# -- the loop on a fake clock ----------------------------------------------------------


@pytest.mark.parametrize(
    ("lease_s", "heartbeat_interval_s", "grace_s", "budget_s"),
    [
        (2.0, 0.5, 10.0, 1.0),  # a tiny lease: half of it
        (30.0, 5.0, 10.0, 13.0),  # the defaults: grace 10 s + tick 1 s + 2 s
        (30.0, 0.2, 0.5, 2.7),  # a short grace: 0.5 s + tick 0.2 s + 2 s
    ],
)
def test_outage_stops_the_ranks_once_before_the_lease_can_lapse(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    lease_s: float,
    heartbeat_interval_s: float,
    grace_s: float,
    budget_s: float,
) -> None:
    clock = FakeClock()
    records = FakeRecords(clock, outage=(T0 + 1e-3, math.inf))  # down after the first tick
    records.submit(1, gpus_per_node=1)
    launcher = FakeLauncher(clock, grace_s=grace_s)
    settings = _settings(tmp_path, lease_s=lease_s, heartbeat_interval_s=heartbeat_interval_s)
    loop = _loop(settings, records, launcher, gpus=[0, 1])
    assert loop.stop_budget_s == pytest.approx(budget_s)
    with caplog.at_level(logging.WARNING, logger="worker.loop"):
        loop.run(ClockedStop(clock, until=T0 + 3 * lease_s))

    assert launcher.started == [(T0, "1.1")]
    cancels = _cancel_times(launcher, "1.1")
    assert len(cancels) == 1, f"attempt 1 must be stopped exactly once, got {cancels}"
    assert launcher.fenced == ["1.1"], "stopped within the grace: no wait for an upload"
    renewed = T0  # the claim and the last heartbeat that got through were sent at T0
    eps = 1e-6  # the fake clock's float sums
    assert lease_s - budget_s - eps <= cancels[0] - renewed < lease_s, "stopped out of the fence"
    assert cancels[0] == pytest.approx(renewed + lease_s - budget_s), (
        "the failing loop must wake at the fence deadline, not sleep past it"
    )
    assert loop.runs == {} and loop.pool.free == 2, "the fenced job's GPU must be given back"
    assert [t.target for _, t in records.applied] == [JobState.RUNNING], (
        "nothing may be applied while the control plane is unreachable"
    )
    warnings = [r.getMessage() for r in caplog.records if "lease not renewed" in r.getMessage()]
    assert len(warnings) == 1 and "job_id=1 attempt=1" in warnings[0], warnings
    assert "never runs twice" in warnings[0]


@pytest.mark.parametrize("heartbeat_interval_s", [0.2, 1.0, 5.0])
def test_an_outage_that_ends_a_tick_before_the_fence_costs_nothing(
    tmp_path: Path, heartbeat_interval_s: float
) -> None:
    """However the backoff falls, the failing loop tries once more a tick before the fence
    deadline: the job keeps running and its lease is renewed."""
    settings = _settings(tmp_path, lease_s=30.0, heartbeat_interval_s=heartbeat_interval_s)
    clock = FakeClock()
    launcher = FakeLauncher(clock)
    records = FakeRecords(clock)
    loop = _loop(settings, records, launcher)
    deadline = T0 + 30.0 - loop.stop_budget_s
    records.outage = (T0 + 1e-3, deadline - loop.tick_s - 1e-6)  # float sums: ± an ulp
    records.submit(1)
    loop.run(ClockedStop(clock, until=T0 + 60))

    assert [h for _, h in launcher.cancelled] == ["1.1"]
    assert launcher.cancelled[0][0] >= T0 + 60 - 1e-6, "stopped before the worker's shutdown"
    renewals = [t for t, name in records.calls if name == "heartbeat" and t >= records.outage[1]]
    assert renewals and renewals[0] <= deadline, "no heartbeat tried before the fence deadline"


@pytest.mark.parametrize("grace_s", [0.1, 10.0])
def test_each_job_is_fenced_by_its_own_deadline(tmp_path: Path, grace_s: float) -> None:
    """Job 2 becomes claimable after the last heartbeat that got through: the pause's long
    poll takes it at once, and its lease runs from when that claim was sent (the pause's
    start, right after the heartbeat), never from when it came back. Job 1 is stopped at its
    own deadline; job 2 at its own (here the same) or earlier, never later."""
    clock = FakeClock()
    records = FakeRecords(clock, outage=(T0 + 5.5, math.inf))
    records.submit(1)
    records.submit(2, at=T0 + 5.1)
    launcher = FakeLauncher(clock, grace_s=grace_s)
    settings = _settings(tmp_path, lease_s=30.0, heartbeat_interval_s=1.0)
    loop = _loop(settings, records, launcher, slots=2)
    loop.run(ClockedStop(clock, until=T0 + 90))

    claim_2 = next(t for t, h in launcher.started if h == "2.1")
    assert claim_2 == pytest.approx(T0 + 5.1), "job 2 is taken by the pause's long poll at once"
    deadline_1 = T0 + 5.0 + 30.0 - loop.stop_budget_s  # renewed by the heartbeat at T0 + 5
    deadline_2 = T0 + 5.0 + 30.0 - loop.stop_budget_s  # its claim was sent at T0 + 5
    assert _cancel_times(launcher, "1.1") == [pytest.approx(deadline_1)]
    (fenced_2,) = _cancel_times(launcher, "2.1")
    assert fenced_2 <= deadline_2 + 1e-6 and fenced_2 == pytest.approx(deadline_1)
    assert loop.runs == {}


@dataclass
class BlockingLauncher(FakeLauncher):
    """A launcher whose cancel blocks until ``parties`` cancels are in flight at once."""

    parties: int = 2
    barrier: threading.Barrier = field(init=False)

    def __post_init__(self) -> None:
        self.barrier = threading.Barrier(self.parties, timeout=10)  # a guard, not a timing

    def cancel(self, handle: str) -> None:
        super().cancel(handle)
        self.barrier.wait()  # BrokenBarrierError (the cancel fails) when run one by one


def test_jobs_fenced_together_are_cancelled_side_by_side(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two jobs renewed by one heartbeat share a deadline: their cancels (each blocking up
    to the grace) run at once, so the second one's SIGTERM does not wait for the first."""
    clock = FakeClock()
    records = FakeRecords(clock, outage=(T0 + 1e-3, math.inf))
    records.submit(1)
    records.submit(2)
    launcher = BlockingLauncher(clock)
    settings = _settings(tmp_path, lease_s=30.0, heartbeat_interval_s=1.0)
    loop = _loop(settings, records, launcher, slots=2)
    loop.tick()
    clock.advance(17.0)
    with caplog.at_level(logging.ERROR, logger="worker.loop"):
        assert loop.fence_lapsing_runs() == [1, 2]
    assert "could not stop" not in caplog.text, "the cancels ran one after the other"
    assert sorted(h for _, h in launcher.cancelled) == ["1.1", "2.1"]
    assert loop.runs == {}


def test_a_detached_launchers_job_is_never_fenced(tmp_path: Path) -> None:
    """Slurm's jobs outlive the worker and are adopted, never requeued, while they run."""
    clock = FakeClock()
    records = FakeRecords(clock, outage=(T0 + 1e-3, math.inf))
    records.submit(1)
    launcher = FakeLauncher(clock, name="slurm")
    settings = _settings(tmp_path, lease_s=2.0, heartbeat_interval_s=0.5)
    loop = _loop(settings, records, launcher)
    loop.run(ClockedStop(clock, until=T0 + 20))

    assert launcher.started == [(T0, "1.1")]
    assert launcher.cancelled == [], "a detached job must never be stopped by the fence"
    assert list(loop.runs) == [1], "left running for the next worker to adopt"


def test_a_fenced_job_still_held_is_requeued_once_the_control_plane_answers(
    tmp_path: Path,
) -> None:
    """The partition ends before the API reaped the job: the first heartbeat still lists it
    as held here, and the worker requeues it (an orphan); attempt 2 starts only after
    attempt 1 was stopped."""
    clock = FakeClock()
    records = FakeRecords(clock, outage=(T0 + 1e-3, T0 + 40.0))
    records.submit(1)
    launcher = FakeLauncher(clock)
    settings = _settings(tmp_path, lease_s=30.0, heartbeat_interval_s=1.0)
    loop = _loop(settings, records, launcher)
    loop.run(ClockedStop(clock, until=T0 + 60))

    fenced_at = _cancel_times(launcher, "1.1")
    assert fenced_at == [pytest.approx(T0 + 17.0)], "stopped once, at the fence deadline"
    requeues = [(t, tr) for t, tr in records.applied if tr.kind == EventKind.ORPHANED]
    assert len(requeues) == 1, f"expected one requeue as an orphan, got {records.applied}"
    at, requeue = requeues[0]
    assert at >= T0 + 40.0 and (requeue.job_id, requeue.expected) == (1, JobState.RUNNING)
    assert requeue.reason == "held by this worker but not running here"
    assert [h for _, h in launcher.started] == ["1.1", "1.2"]
    assert launcher.started[1][0] >= fenced_at[0], "attempt 2 started before 1 was stopped"


def test_a_heartbeat_that_returns_too_late_fences_the_job(tmp_path: Path) -> None:
    """A heartbeat that hangs past the fence deadline may have renewed the lease only just
    before it lapsed: its renewal counts from when it was sent, so the job is stopped, then
    requeued by the next heartbeat (it is still listed as held)."""
    clock = FakeClock()
    records = FakeRecords(clock)
    records.submit(1)
    launcher = FakeLauncher(clock)
    settings = _settings(tmp_path, lease_s=30.0, heartbeat_interval_s=1.0)  # deadline 17 s
    loop = _loop(settings, records, launcher)
    loop.tick()  # claims and launches job 1 at T0
    records.heartbeat_takes_s = 20.0
    loop.tick()  # sent at T0, answers at T0 + 20
    records.heartbeat_takes_s = 0.0
    assert loop.runs[1].renewed_mono == T0, "the renewal counts from the sending"
    assert loop.fence_lapsing_runs() == [1]
    assert _cancel_times(launcher, "1.1") == [T0 + 20.0]
    loop.tick()
    orphaned = [tr for _, tr in records.applied if tr.kind == EventKind.ORPHANED]
    assert [(tr.job_id, tr.expected, tr.target) for tr in orphaned] == [
        (1, JobState.RUNNING, JobState.QUEUED)
    ], f"expected job 1 requeued as an orphan, got {records.applied}"


def test_an_unknown_grace_counts_as_the_local_launchers(tmp_path: Path) -> None:
    @dataclass
    class NoGrace:
        name: str = "local"

    settings = _settings(tmp_path, lease_s=60.0, heartbeat_interval_s=1.0)
    loop = WorkerLoop(settings, FakeRecords(FakeClock()), NoGrace(), host="h", pid=1)  # type: ignore[arg-type]
    assert loop.stop_budget_s == DEFAULT_CANCEL_GRACE_S + 1.0 + 2.0


def test_a_token_revoked_while_running_stops_the_worker_and_its_ranks(tmp_path: Path) -> None:
    """A refused token stays refused: the worker stops at once (its shutdown stops the ranks
    long before the lease could lapse, and cannot requeue them: the API does at the lease),
    instead of retrying forever; nothing more is claimed."""
    clock = FakeClock()
    records = FakeRecords(clock, refused_from=T0 + 3.0)
    records.submit(1)
    records.submit(2, at=T0 + 10.0)
    launcher = FakeLauncher(clock)
    loop = _loop(_settings(tmp_path, lease_s=45.0, heartbeat_interval_s=1.0), records, launcher)
    with pytest.raises(WorkerTokenRefusedError):
        loop.run(ClockedStop(clock, until=T0 + 120))
    assert loop.refused
    assert _cancel_times(launcher, "1.1") and _cancel_times(launcher, "1.1")[0] < T0 + 5.0
    assert [h for _, h in launcher.started] == ["1.1"], "nothing claimed after the refusal"
    assert clock() < T0 + 10.0, "the worker stopped at once, not at the end of the run"
