"""How the worker loop turns claimed jobs into started attempts: spec → GPUs → plan → token →
start, one job at a time (``Launcher.start``) or a sweep's batch of trials as job arrays
(``ArrayStarter``: Slurm).

Plan, then act: every plan is logged (secrets masked) before its start. A failure to prepare
or start an attempt fails that attempt only (``HeldRun.launch_error``; the loop decides what
follows), never the worker; a refused array fails its own elements only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.core.errors import DdpqError
from service.core.events import EventKind, render
from service.core.holds import SchedulerHandle
from service.core.spec.model import JobSpec
from worker.attempt_notes import oversubscription_note
from worker.control.records import WorkerRecords
from worker.decisions import GpuPool, HeldRun
from worker.launchers.base import (
    ArrayStarter,
    Launcher,
    LaunchPlan,
    with_attempt_token,
    with_owner,
)

log = logging.getLogger(__name__)


def _jlog(level: int, run: HeldRun, msg: str, *args: Any) -> None:
    fields = {"job_id": run.job_id, "attempt": run.attempt}
    log.log(level, "job_id=%d attempt=%d " + msg, run.job_id, run.attempt, *args, extra=fields)


def _failed(run: HeldRun, exc: BaseException) -> None:
    _jlog(logging.ERROR, run, "launch failed: %s", exc)
    run.launch_error = f"launch failed: {type(exc).__name__}: {exc}"


@dataclass
class Launches:
    """Starts claimed runs on ``launcher``: sets each run's ``handle`` (recorded as the job's
    ``scheduler_job_id`` when ``detached``) or its ``launch_error``. ``records`` gives the
    worker's records as they are now (tests swap them); ``pool`` is the worker's GPU pool,
    drawn from when ``host_gpus``."""

    launcher: Launcher
    records: Callable[[], WorkerRecords]
    pool: GpuPool
    host_gpus: bool
    detached: bool
    cpus: int  # cores the ranks of a host launcher share (the more-ranks-than-cores note)

    def start_one(self, run: HeldRun, spec_data: dict[str, Any]) -> None:
        """Plan and start one attempt."""
        plan = self._prepare(run, spec_data)
        if plan is None:
            return
        _jlog(logging.INFO, run, "launch plan:\n%s", plan.render())
        try:
            handle = self.launcher.start(plan)
        except Exception as exc:  # any launch problem fails this job, not the worker
            _failed(run, exc)
            return
        run.handle = handle
        if self.detached:
            self._record([(run, handle)])

    def start_arrays(
        self, claimed: list[tuple[HeldRun, dict[str, Any]]], *, parallelism: int | None
    ) -> None:
        """Plan every run, then start them as the launcher's arrays (``ArrayStarter``), at
        most ``parallelism`` elements of each array running at once.

        Raises:
            TypeError: the launcher cannot start arrays.
        """
        if not isinstance(self.launcher, ArrayStarter):
            raise TypeError(f"launcher {self.launcher.name!r} cannot start arrays")
        prepared = [(run, self._prepare(run, data)) for run, data in claimed]
        plans = {plan.job_id: (run, plan) for run, plan in prepared if plan is not None}
        try:
            arrays = self.launcher.plan_array(
                [plan for _, plan in plans.values()], parallelism=parallelism
            )
        except Exception as exc:
            for run, _ in plans.values():
                _failed(run, exc)
            return
        for array in arrays:
            runs = [plans[element.job_id][0] for element in array.elements]
            log.info("launch plan of jobs %s:\n%s", [r.job_id for r in runs], array.render())
            try:
                handles = self.launcher.start_array(array)
            except Exception as exc:  # fails this array's elements, not the worker
                for run in runs:
                    _failed(run, exc)
                continue
            for run, handle in zip(runs, handles, strict=True):
                run.handle = handle
            if self.detached:
                self._record(list(zip(runs, handles, strict=True)))

    def _prepare(self, run: HeldRun, spec_data: dict[str, Any]) -> LaunchPlan[Any] | None:
        """The attempt's plan with its GPUs, its owner and its attempt token; None (and the run's
        ``launch_error`` set) when it cannot be made."""
        try:
            spec = JobSpec.model_validate(spec_data)
            if self.host_gpus:
                gpus = self.pool.take(spec.resources.gpus_per_node)
                if gpus is None:
                    raise RuntimeError(f"{spec.resources.gpus_per_node} GPU(s) not free")
                run.gpus = gpus
            plan = self.launcher.plan(spec, run.job_id, run.attempt)
            note = oversubscription_note(spec, self.cpus) if self.host_gpus else None
            if note is not None:
                _jlog(logging.WARNING, run, "%s", render(EventKind.MORE_RANKS_THAN_CORES, note))
                self.records().note(run.job_id, run.attempt, EventKind.MORE_RANKS_THAN_CORES, note)
            if run.gpus:
                plan = self.launcher.bind_gpus(plan, run.gpus)
            # The ranks' only credential: this attempt's token, minted by the claim.
            if not run.attempt_token:
                raise RuntimeError("the claim carried no attempt token for the ranks")
            return with_attempt_token(with_owner(plan, run.owner), run.attempt_token)
        except Exception as exc:
            _failed(run, exc)
            return None

    def _record(self, handles: list[tuple[HeldRun, str]]) -> None:
        """Store detached handles on their jobs, so that any worker can adopt and follow them;
        a failure is logged, not fatal (the jobs run on, this worker follows them)."""
        try:
            self.records().record_handles(
                [SchedulerHandle(run.job_id, run.attempt, handle) for run, handle in handles]
            )
        except DdpqError as exc:
            for run, handle in handles:
                _jlog(logging.WARNING, run, "could not record %s job %s: %s",
                      self.launcher.name, handle, exc)  # fmt: skip
