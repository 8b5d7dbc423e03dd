"""Why a job waits, as a value (``values.QueueExplanation``): its place among the claimable jobs
(ordered as the claim takes them, filtered by the claim's own predicate
``claims._claimable``), which workers could run it and which cannot and why, and a batch
scheduler's pending reason. ``summary`` is the one-line ``queue_reason`` the API has always
served."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, exists, func, or_, select
from sqlalchemy.orm import Session

from service.core.launchers import LAUNCHER_TRAITS, launcher_traits, uses_host_gpus
from service.core.pending_reasons import describe_slurm_reason
from service.core.states import ACTIVE_STATES
from service.store.jobs.claims import _claimable
from service.store.jobs.values import (
    JobAhead,
    JobShape,
    QueueExplanation,
    SchedulerPending,
    SchedulerWait,
    WorkerFit,
)
from service.store.models import Job, Worker, utcnow

# A worker is live while its last heartbeat is younger than this many heartbeat intervals.
LIVE_HEARTBEATS = 3
# Jobs ahead listed one by one (the count covers all of them).
MAX_AHEAD_SHOWN = 20


def _capacity_int(capacity: Any, key: str, default: int | None) -> int | None:
    value = capacity.get(key) if isinstance(capacity, dict) else None
    if key == "gpus":
        return len(value) if isinstance(value, list) else default
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _fit(row: Any, job: JobShape, live_after: datetime) -> WorkerFit:
    """``row`` (id, host, launcher, capacity, heartbeat_at, stopped_at, jobs held, GPUs
    held) against ``job``."""
    wid, host, launcher, capacity, heartbeat_at, stopped_at, held, gpus_held = row
    slots = _capacity_int(capacity, "slots", 1) or 1
    gpus = _capacity_int(capacity, "gpus", 0) or 0
    cpus = _capacity_int(capacity, "cpus", None)
    host_gpus = uses_host_gpus(launcher)
    wants = job.gpus_per_node if host_gpus else 0
    live = stopped_at is None and heartbeat_at > live_after
    ever: list[str] = []
    if launcher != job.launcher:
        ever.append(f"runs {launcher} jobs, not {job.launcher}")
    elif wants > gpus:
        ever.append(f"has {_plural(gpus, 'GPU')}; the job needs {wants} per node")
    now_why: list[str] = []
    if stopped_at is not None:
        now_why.append("stopped")
    elif not live:
        now_why.append(f"silent: no heartbeat since {heartbeat_at:%Y-%m-%d %H:%M:%S} UTC")
    if not ever and live:
        if int(held) >= slots:
            now_why.append(f"all {_plural(slots, 'slot')} busy")
        elif wants and gpus - int(gpus_held) < wants:
            now_why.append(f"{gpus - int(gpus_held)} of {gpus} GPUs free; the job needs {wants}")
    notes: list[str] = []
    if not ever and host_gpus and job.gpus_per_node == 0 and cpus and job.nproc_per_node > cpus:
        notes.append(
            f"would run {job.nproc_per_node} ranks on {_plural(cpus, 'CPU core')}: they "
            "share cores (slower steps; the global batch is still nproc_per_node × batch_size)"
        )
    return WorkerFit(
        id=str(wid), host=str(host), launcher=str(launcher), live=live,
        stopped=stopped_at is not None, heartbeat_at=None if live else heartbeat_at,
        slots=slots, busy_slots=int(held), gpus=gpus, busy_gpus=int(gpus_held), cpus=cpus,
        can_ever=not ever, can_now=not ever and not now_why,
        why_not=tuple(ever + now_why), notes=tuple(notes),
    )  # fmt: skip


def _workers(session: Session, job: JobShape, heartbeat_interval_s: float) -> list[WorkerFit]:
    """Every registered worker against ``job``, in one query (correlated counts of what each
    holds, served by ix_jobs_worker_id)."""
    now = utcnow()
    live_after = now - timedelta(seconds=LIVE_HEARTBEATS * heartbeat_interval_s)
    held_by_worker = [Job.worker_id == Worker.id, Job.state.in_([s.value for s in ACTIVE_STATES])]
    rows = session.execute(
        select(
            Worker.id,
            Worker.host,
            Worker.launcher,
            Worker.capacity,
            Worker.heartbeat_at,
            Worker.stopped_at,
            select(func.count()).where(*held_by_worker).scalar_subquery(),
            select(func.coalesce(func.sum(Job.gpus_per_node), 0))
            .where(*held_by_worker)
            .scalar_subquery(),
        ).order_by(Worker.id)
    )
    # Live ones first, each group by id: an order by heartbeat would move with every beat.
    return sorted((_fit(row, job, live_after) for row in rows), key=lambda w: (not w.live, w.id))


def _summary(job: JobShape, fits: list[WorkerFit], ahead: int) -> str:
    """The one-line ``queue_reason`` (its wording predates the structured explanation)."""
    launcher = job.launcher
    live = [w for w in fits if w.live and w.launcher == launcher]
    if not live:
        hint = f"`ddpq worker --launcher {launcher}`"
        return f"no live worker for launcher {launcher} (start one: {hint})"
    wants = job.gpus_per_node if uses_host_gpus(launcher) else 0
    most_gpus = max(w.gpus for w in live)
    if wants and most_gpus < wants:
        return (
            f"waiting for a worker with {_plural(wants, 'free GPU')} "
            f"(live workers have at most {most_gpus})"
        )
    if not any(w.can_now for w in live):
        if wants and any(w.busy_slots < w.slots for w in live):
            most_free = max(w.gpus - w.busy_gpus for w in live)
            return (
                f"waiting for {_plural(wants, 'free GPU')} on one worker "
                f"(live workers have at most {most_free} free now)"
            )
        return f"waiting for a free slot ({_plural(len(live), 'live worker')}, all busy)"
    if ahead:
        return f"waiting for a worker to claim it ({_plural(ahead, 'queued job')} ahead)"
    return "waiting for a worker to claim it"


def explain_queue(
    session: Session,
    job: JobShape,
    *,
    viewer: str | None,
    heartbeat_interval_s: float,
    max_gpus_per_node: int,
) -> QueueExplanation:
    """Why ``job`` (queued, or a spec about to be) waits: three small queries, for one job
    at a time (never for lists).

    Args:
        viewer: the owner whose jobs the caller may see by name (``JobAhead.owner``/``name``);
            None for an admin (every job).
        heartbeat_interval_s: the deployment's; a worker is live while its heartbeat is
            younger than ``LIVE_HEARTBEATS`` intervals.
        max_gpus_per_node: the deployment's cap, which workers of launchers that do not hand
            out host GPUs (Slurm) claim with.
    """
    fits = _workers(session, job, heartbeat_interval_s)
    capable = [w for w in fits if w.can_ever and w.live]
    if uses_host_gpus(job.launcher):
        # Jobs that a worker able to run this one would take first: up to its GPUs.
        max_gpus = max([w.gpus for w in capable], default=job.gpus_per_node)
    else:
        max_gpus = max_gpus_per_node
    if job.job_id is None:
        before: Any = Job.priority >= job.priority
    else:
        before = or_(
            Job.priority > job.priority, and_(Job.priority == job.priority, Job.id < job.job_id)
        )
    ahead_where = (*_claimable(job.launcher, max_gpus), before)
    if job.job_id is not None:
        ahead_where = (*ahead_where, Job.id != job.job_id)
    ahead_count = int(session.scalar(select(func.count()).where(*ahead_where)) or 0)
    rows = session.execute(
        select(Job.id, Job.priority, Job.owner, Job.name)
        .where(*ahead_where)
        .order_by(Job.priority.desc(), Job.id)
        .limit(MAX_AHEAD_SHOWN)
    )
    ahead = tuple(
        JobAhead(
            id=r.id,
            priority=r.priority,
            owner=r.owner if viewer is None or r.owner == viewer else None,
            name=r.name if viewer is None or r.owner == viewer else None,
        )
        for r in rows
    )
    return QueueExplanation(
        summary=_summary(job, fits, ahead_count),
        position=None if job.cancel_requested else ahead_count + 1,
        ahead_count=ahead_count,
        ahead=ahead,
        workers=tuple(w for w in fits if not w.stopped),
        runnable=bool(capable),
        registered_runnable=any(w.can_ever for w in fits),
    )


def explain_scheduler_wait(
    launcher: str, scheduler_job_id: str | None, pending: SchedulerPending
) -> QueueExplanation:
    """Why a submitted attempt has not started: the batch scheduler (Slurm) holds it, for
    the reason a worker recorded (``service.store.jobs.notes``)."""
    title = launcher_traits(launcher).title if launcher in LAUNCHER_TRAITS else launcher
    text = describe_slurm_reason(pending.code)
    job = f"{title} job {scheduler_job_id}" if scheduler_job_id else f"its {title} job"
    return QueueExplanation(
        summary=f"{job} is pending: {text} ({title}'s reason: {pending.code})",
        scheduler=SchedulerWait(
            backend=title, scheduler_job_id=scheduler_job_id, code=pending.code, text=text
        ),
    )


def submit_warnings(
    session: Session, job: JobShape, *, starting_launcher: str | None = None
) -> list[str]:
    """Warnings for a spec being queued that no registered worker (live, silent or stopped)
    could ever run. Workers come and go, so this warns, never refuses.

    One read of the capacities of the workers of the job's launcher only (for a job that needs
    no host GPUs, whether one exists): it runs in every submission's transaction, and reading
    every worker with what each holds (``_workers``, the queue explanation's) made a submission
    cost 30 ms of API CPU with 400 registered workers holding 3,000 jobs.

    ``starting_launcher``: the launcher of a worker the deployment starts itself (``ddpq up``'s
    local worker, ``Settings.expect_worker``). Until that worker registers, "none is
    registered" would be wrong: it is starting, and the job waits only for it."""
    wants = job.gpus_per_node if uses_host_gpus(job.launcher) else 0
    same_launcher = Worker.launcher == job.launcher
    if wants == 0:
        if session.scalar(select(exists().where(same_launcher))):
            return []
        gpus: list[int] = []
    else:
        capacities = session.scalars(select(Worker.capacity).where(same_launcher))
        gpus = [_capacity_int(c, "gpus", 0) or 0 for c in capacities]
        if any(n >= wants for n in gpus):
            return []
    if not gpus:
        if job.launcher == starting_launcher:
            return []
        return [
            f"no worker of launcher {job.launcher} is registered: the job waits until one "
            f"starts (`ddpq worker --launcher {job.launcher}`)"
        ]
    return [
        f"no registered {job.launcher} worker could ever run this job: it needs "
        f"{_plural(job.gpus_per_node, 'GPU')} per node, the most any has is {max(gpus)}"
    ]
