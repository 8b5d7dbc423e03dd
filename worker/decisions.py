"""The worker's state decisions as pure functions: (what it observed) → ``Decision``.

No I/O here: ``worker.loop.WorkerLoop`` gathers observations (launcher polls, heartbeats) and
applies the decisions. One table, ``PHASE_DECISIONS``, maps each ``RunPhase`` a launcher can
report to the job's next state. ``decide_fences`` picks the jobs whose lease this worker could
not renew in time, to stop their ranks before the control plane may requeue them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.core.events import EventKind
from service.core.holds import AdoptedJob, ClaimedJob, HeldJob, Transition
from service.core.states import TERMINAL_STATES, JobState
from worker.attempt import FailureReason
from worker.launchers.base import RunPhase, RunStatus

SUMMARY_CHARS = 300
# Failure reasons (``RunStatus.failure``) never retried: a resume replays the same data, seed
# and weights into the same non-finite loss, and a failure before the first step (bad config,
# import error) would fail the same way. A stalled attempt is retried like any other failure.
NOT_RETRIED_REASONS = frozenset({FailureReason.NONFINITE_LOSS, FailureReason.SETUP})
# Seconds the lease fence keeps in hand beyond the launcher's cancel grace and one tick: a
# failing call may take a moment to fail, and the ranks' stop checkpoint a moment to land.
FENCE_MARGIN_S = 2.0


@dataclass
class HeldRun:
    """What a worker knows about one job it holds (the current attempt only)."""

    job_id: int
    attempt: int
    state: JobState
    restarts: int = 0
    max_restarts: int = 0
    gpus: tuple[int, ...] = ()
    handle: str | None = None
    launch_error: str | None = None
    cancel_requested: bool = False
    cancel_sent: bool = False
    notes_posted: bool = False  # the ended attempt's launcher notes (``RunStatus.notes``)
    # The token its ranks get, minted by the claim (adopted runs are never launched here).
    attempt_token: str = field(default="", repr=False)
    # The job's owner, from the claim: whose Unix user runs its ranks (None: not told).
    owner: str | None = None
    # The worker's monotonic clock (seconds) just before it sent the last call that leased
    # the job to it (claim, adoption or heartbeat): the API's lease runs ``lease_s`` from a
    # moment no earlier, so it cannot lapse before ``renewed_mono + lease_s``. None: unknown
    # (never fenced).
    renewed_mono: float | None = None

    @classmethod
    def claimed(cls, job: ClaimedJob, *, renewed_mono: float | None = None) -> HeldRun:
        """The run of a job this worker just claimed (``starting``, not launched yet);
        ``renewed_mono``: the worker's monotonic time just before it sent the claim."""
        return cls(
            job_id=job.job_id,
            attempt=job.attempt,
            state=JobState.STARTING,
            restarts=job.restarts,
            max_restarts=job.max_restarts,
            attempt_token=job.attempt_token,
            owner=job.owner,
            renewed_mono=renewed_mono,
        )

    @classmethod
    def adopted(cls, job: AdoptedJob, *, renewed_mono: float | None = None) -> HeldRun:
        """The run of a detached job this worker adopted, followed by its scheduler id;
        ``renewed_mono``: the worker's monotonic time just before it sent the adoption."""
        return cls(
            job_id=job.job_id,
            attempt=job.attempt,
            state=job.state,
            restarts=job.restarts,
            max_restarts=job.max_restarts,
            handle=job.scheduler_job_id,
            cancel_requested=job.cancel_requested,
            renewed_mono=renewed_mono,
        )


@dataclass(frozen=True)
class Decision:
    """A planned transition plus the side values ``apply_transition`` writes with it."""

    transition: Transition
    error: str | None = None
    values: Mapping[str, Any] = field(default_factory=dict)

    @property
    def job_id(self) -> int:
        """The job this decision is about."""
        return self.transition.job_id

    @property
    def releases(self) -> bool:
        """True when the worker no longer holds the job afterwards (ended or requeued)."""
        target = self.transition.target
        return target in TERMINAL_STATES or target == JobState.QUEUED


def summarize(text: str | None, limit: int = SUMMARY_CHARS) -> str:
    """The first line of ``text``, cut to ``limit`` characters."""
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _to(
    run: HeldRun,
    target: JobState,
    kind: EventKind,
    data: Mapping[str, Any] | None = None,
    **kw: Any,
) -> Decision:
    return Decision(Transition.of(run.job_id, run.state, target, kind, data), **kw)


def _on_pending(run: HeldRun, status: RunStatus) -> Decision | None:
    return None  # still starting (e.g. Slurm PENDING)


def _on_running(run: HeldRun, status: RunStatus) -> Decision | None:
    if run.state == JobState.STARTING:
        return _to(run, JobState.RUNNING, EventKind.LAUNCHED)
    return None


def _on_succeeded(run: HeldRun, status: RunStatus) -> Decision | None:
    return _to(run, JobState.SUCCEEDED, EventKind.SUCCEEDED)


def _on_cancelled(run: HeldRun, status: RunStatus) -> Decision | None:
    if run.cancel_requested:
        return _to(run, JobState.CANCELLED, EventKind.CANCELLED)
    # Slurm's words ("Slurm job 12 cancelled"), else "cancelled outside ddpq": also the error.
    t = Transition.of(
        run.job_id, run.state, JobState.CANCELLED, EventKind.CANCELLED_OUTSIDE,
        _detail(status.reason),
    )  # fmt: skip
    return Decision(t, error=t.reason)


def _detail(text: str | None) -> dict[str, str]:
    return {"detail": text} if text else {}


def _on_failed(run: HeldRun, status: RunStatus) -> Decision | None:
    if run.cancel_requested:
        return _to(run, JobState.CANCELLED, EventKind.CANCELLED)
    error = status.reason or "failed"
    # The policy reads the reason as a value, never the message: rewording one must not change
    # whether a job is retried.
    failure = status.failure or FailureReason.ERROR
    if run.restarts < run.max_restarts and failure not in NOT_RETRIED_REASONS:
        n = run.restarts + 1
        retry = {"restart": n, "max_restarts": run.max_restarts, "error": summarize(error)}
        return _to(run, JobState.QUEUED, EventKind.RETRIED, retry, values={"restarts": n})
    return _to(run, JobState.FAILED, EventKind.FAILED, {"error": summarize(error)}, error=error)


def _on_preempted(run: HeldRun, status: RunStatus) -> Decision | None:
    if run.cancel_requested:
        return _to(run, JobState.CANCELLED, EventKind.CANCELLED)
    detail = _detail(summarize(status.reason) if status.reason else None)
    return _to(run, JobState.QUEUED, EventKind.PREEMPTED, detail)


PHASE_DECISIONS: dict[RunPhase, Callable[[HeldRun, RunStatus], Decision | None]] = {
    RunPhase.PENDING: _on_pending,
    RunPhase.RUNNING: _on_running,
    RunPhase.SUCCEEDED: _on_succeeded,
    RunPhase.CANCELLED: _on_cancelled,
    RunPhase.FAILED: _on_failed,  # retried while restarts < max_restarts
    RunPhase.PREEMPTED: _on_preempted,  # requeued; does not count as a restart
}


def decide_on_status(run: HeldRun, status: RunStatus) -> Decision | None:
    """The transition a launcher observation calls for; None when the job stays as it is."""
    return PHASE_DECISIONS[status.phase](run, status)


def decide_on_launch_error(run: HeldRun, message: str) -> Decision:
    """A job whose attempt could not be started fails (retried if restarts are left: the
    reason is ``FailureReason.ERROR``)."""
    status = RunStatus(RunPhase.FAILED, message, failure=FailureReason.ERROR)
    return decide_on_status(run, status) or _to(
        run, JobState.FAILED, EventKind.FAILED, {"error": summarize(message)}, error=message
    )


def decide_on_shutdown(run: HeldRun, status: RunStatus | None) -> Decision:
    """After the worker stopped a job's processes at shutdown: keep a finished job's real
    outcome, honour a pending cancel, otherwise requeue it (no restart counted)."""
    if status is not None and status.phase == RunPhase.SUCCEEDED:
        return _to(run, JobState.SUCCEEDED, EventKind.SUCCEEDED)
    if run.cancel_requested:
        return _to(run, JobState.CANCELLED, EventKind.CANCELLED)
    return _to(run, JobState.QUEUED, EventKind.WORKER_STOPPED)


@dataclass(frozen=True)
class Reconciliation:
    """What a heartbeat changes in the worker's view of its jobs."""

    lost: tuple[int, ...] = ()  # taken away (requeued, ended elsewhere): stop their processes
    states: Mapping[int, JobState] = field(default_factory=dict)  # the database's state
    cancel_requested: frozenset[int] = frozenset()
    orphans: tuple[Decision, ...] = ()  # held in the database, unknown here: requeue


def reconcile(runs: Mapping[int, HeldRun], held: Sequence[HeldJob]) -> Reconciliation:
    """Compare the worker's runs with the jobs the database says it holds."""
    by_id = {h.job_id: h for h in held}
    lost = tuple(
        job_id
        for job_id, run in runs.items()
        if job_id not in by_id or by_id[job_id].attempt != run.attempt
    )
    kept = {h.job_id: h for h in held if h.job_id in runs and h.job_id not in lost}
    orphans = tuple(
        Decision(Transition.of(h.job_id, JobState(h.state), JobState.QUEUED, EventKind.ORPHANED))
        for h in held
        if h.job_id not in runs
    )
    return Reconciliation(
        lost=lost,
        states={i: JobState(h.state) for i, h in kept.items() if runs[i].state != h.state},
        cancel_requested=frozenset(i for i, h in kept.items() if h.cancel_requested),
        orphans=orphans,
    )


def stop_budget_for(lease_s: float, cancel_grace_s: float, tick_s: float) -> float:
    """Seconds before a lease can lapse at which the worker starts stopping the job's ranks
    (the fence): the launcher's cancel grace (SIGTERM → SIGKILL, ``cancel`` blocks that
    long), one tick (the loop may notice a tick late) and ``FENCE_MARGIN_S``; at most half
    of ``lease_s``, so that a short lease (tests) is not fenced as soon as it is claimed.

    All arguments and the result are in seconds.
    """
    return min(cancel_grace_s + tick_s + FENCE_MARGIN_S, lease_s / 2)


def fence_deadline(run: HeldRun, *, lease_s: float, budget_s: float) -> float | None:
    """The worker's monotonic time (seconds) by which ``run``'s lease must be renewed, else
    its ranks are stopped: ``renewed_mono + lease_s - budget_s``; None when the renewal
    time is unknown."""
    if run.renewed_mono is None:
        return None
    return run.renewed_mono + lease_s - budget_s


def next_fence_deadline(
    runs: Mapping[int, HeldRun], *, lease_s: float, budget_s: float
) -> float | None:
    """The earliest ``fence_deadline`` of ``runs`` (monotonic seconds); None if none has one."""
    deadlines = [fence_deadline(r, lease_s=lease_s, budget_s=budget_s) for r in runs.values()]
    known = [d for d in deadlines if d is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class Fence:
    """A held job whose lease this worker did not renew in time: stop its ranks here and
    forget it, without the control plane (unreachable), before the API may requeue it and
    another worker start its next attempt.

    ``unrenewed_s``: seconds since the last renewal was sent; ``lapses_in_s``: seconds left
    before the lease can lapse at the earliest (the API cannot requeue it sooner).
    """

    job_id: int
    attempt: int
    unrenewed_s: float
    lapses_in_s: float

    def __str__(self) -> str:
        return (
            f"job {self.job_id} attempt {self.attempt}: lease not renewed for "
            f"{self.unrenewed_s:.1f} s, lapses in {self.lapses_in_s:.1f} s at the earliest"
        )


def decide_fences(
    runs: Mapping[int, HeldRun],
    *,
    now: float,
    lease_s: float,
    budget_s: float,
    ahead_s: float = 0.0,
) -> tuple[Fence, ...]:
    """The runs to fence at ``now`` (the worker's monotonic clock, seconds), in job id
    order: none unless some run's fence deadline (``fence_deadline``) has passed; then those
    and every run whose deadline comes within ``ahead_s`` seconds, since stopping the first
    ones blocks the caller that long and it would notice the others late. Only for attached
    launchers: a detached launcher's jobs are adopted, never requeued, while they run."""
    candidates: list[tuple[float, Fence]] = []
    for job_id in sorted(runs):
        run = runs[job_id]
        deadline = fence_deadline(run, lease_s=lease_s, budget_s=budget_s)
        if deadline is None or run.renewed_mono is None or deadline > now + ahead_s:
            continue
        unrenewed = now - run.renewed_mono
        candidates.append((deadline, Fence(job_id, run.attempt, unrenewed, lease_s - unrenewed)))
    if not any(deadline <= now for deadline, _ in candidates):
        return ()
    return tuple(fence for _, fence in candidates)


class GpuPool:
    """The worker's GPU ids; jobs take ``gpus_per_node`` of them and give them back."""

    def __init__(self, gpus: Sequence[int]) -> None:
        self._free = sorted(set(gpus))

    @property
    def free(self) -> int:
        """How many GPUs are free."""
        return len(self._free)

    def take(self, n: int) -> tuple[int, ...] | None:
        """The ``n`` lowest free ids (removed from the pool), or None if fewer are free."""
        if n > len(self._free):
            return None
        taken, self._free = self._free[:n], self._free[n:]
        return tuple(taken)

    def give(self, gpus: Sequence[int]) -> None:
        """Return ``gpus`` to the pool."""
        self._free = sorted(set(self._free) | set(gpus))
