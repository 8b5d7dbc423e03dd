"""A worker's clean shutdown of the jobs it holds: attached jobs (local ranks) are stopped and
requeued; a detached launcher's (Slurm) are left running for the next worker to adopt; a
worker whose token the API refuses calls nothing and only stops its ranks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from service.core.errors import (
    ControlPlaneUnavailableError,
    WorkerTokenMismatchError,
    WorkerTokenRefusedError,
)
from worker.decisions import HeldRun, decide_on_shutdown

if TYPE_CHECKING:
    from worker.loop import WorkerLoop

log = logging.getLogger(__name__)

# What a shutdown cannot get past: the API out of reach, or its refusal of this worker's token.
UNREACHABLE = (ControlPlaneUnavailableError, WorkerTokenRefusedError, WorkerTokenMismatchError)


def _jlog(level: int, run: HeldRun, msg: str, *args: Any) -> None:
    fields = {"job_id": run.job_id, "attempt": run.attempt}
    log.log(level, "job_id=%d attempt=%d " + msg, run.job_id, run.attempt, *args, extra=fields)


def shut_down(loop: WorkerLoop) -> None:
    """Stop ``loop`` claiming, end its held jobs as its launcher calls for, mark it stopped.

    A job that finished meanwhile ends as it ended; one with a pending cancel ends
    cancelled. If the API is out of reach the jobs' leases expire and the API requeues them.
    With a detached launcher (Slurm) the jobs are neither stopped nor requeued: outcomes
    already known are recorded, pending cancels are sent, and the rest keep running for the
    next worker of that launcher to adopt (at once, since this worker is marked stopped).
    A refused worker token: no call to the API (each would be refused); attached jobs'
    ranks are stopped through the fence at once.
    """
    loop.stopping = True
    if loop.refused:
        for run in loop.fence.stop_all(loop.runs, why="this worker's token is refused"):
            loop.forget(run)
        log.info("worker %s stopped", loop.worker_id)
        return
    if loop.detached:
        _leave_running(loop)
    else:
        _stop_runs(loop)
    if loop.registered:
        try:
            loop.records.stop()
        except UNREACHABLE as exc:
            log.warning("could not mark worker %s stopped: %s", loop.worker_id, exc)
    log.info("worker %s stopped", loop.worker_id)


def _stop_runs(loop: WorkerLoop) -> None:
    """Attached launcher: cancel every held job's processes, then requeue (or end) each."""
    for run in list(loop.runs.values()):
        if run.handle is not None:
            _jlog(logging.INFO, run, "stopping (worker shutdown)")
            try:
                loop.launcher.cancel(run.handle)
            except Exception:
                log.exception("job_id=%d: cancel failed", run.job_id)
    for run in list(loop.runs.values()):
        status = None
        if run.handle is not None:
            try:
                status = loop.launcher.poll(run.handle)
            except Exception:
                log.exception("job_id=%d: poll failed", run.job_id)
        try:
            loop.apply(run, decide_on_shutdown(run, status))
        except UNREACHABLE as exc:
            _jlog(logging.WARNING, run, "not requeued (%s); its lease will expire", exc)


def _leave_running(loop: WorkerLoop) -> None:
    """Detached launcher: one last watch, then leave submitted jobs be."""
    try:
        loop.watch_all()
    except Exception:  # the jobs still run; the next worker adopts and watches them
        log.exception("last watch before shutdown failed")
    for run in list(loop.runs.values()):
        if run.handle is not None:
            _jlog(logging.INFO, run, "left running as %s job %s for the next worker",
                  loop.launcher.name, run.handle)  # fmt: skip
            continue
        try:  # never submitted: nothing to adopt, so requeue it now
            loop.apply(run, decide_on_shutdown(run, None))
        except UNREACHABLE as exc:
            _jlog(logging.WARNING, run, "not requeued (%s); its lease will expire", exc)
