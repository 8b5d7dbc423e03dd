"""The Slurm launcher: each attempt is one Slurm job submitted through submitit.

``plan`` renders the sbatch script (one Slurm task per rank: ``--nodes=nnodes``,
``--ntasks-per-node=nproc_per_node``); ``start`` submits it with submitit's ``SlurmExecutor``
and a ``SlurmRank`` per task; ``poll`` reads every followed job's state with one ``sacct`` call
per poll interval (``SLURM_STATE_TO_PHASE`` decides; rank 0's result.json decides success);
``cancel`` is ``scancel``. The handle is Slurm's job id, and the Slurm job name
(``ddpq-<job_id>-<attempt>``) ties it back to its ddpq attempt, so a restarted worker can
poll a job it did not start. Slurm jobs outlive the worker (its traits say ``detached``).

Preemption: sbatch gets ``--signal=USR1@<signal_delay_s>``; the ranks checkpoint at the next
step and exit ``128+USR1``, which ``poll`` reports as PREEMPTED (ddpq requeues the job as
attempt + 1, resuming from the newest checkpoint). A Slurm requeue (``scontrol requeue``,
preemption with requeue) is PREEMPTED too: the launcher cancels Slurm's requeued copy so only
ddpq's relaunch runs.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from service.core import artifacts
from service.core.config import Settings
from service.core.limits import SLURM_COMMAND_TIMEOUT_S
from service.core.spec.model import JobSpec
from worker.attempt import FailureReason, inherited_env
from worker.errors import LaunchError
from worker.launchers.base import ArrayPlan, LaunchPlan, RunPhase, RunStatus, write_plan_files
from worker.launchers.slurm.array import SlurmArrayRequest, plan_arrays, start_array_plan
from worker.launchers.slurm.cluster import (
    read_max_array_size,
    refusal_message,
    scancel,
)
from worker.launchers.slurm.outcome import attempt_of, with_artifacts
from worker.launchers.slurm.params import (
    DEFAULT_SIGNAL_DELAY_S,
    SlurmBatchRequest,
    rank_environment,
    sbatch_parameters,
)
from worker.launchers.slurm.pending import query_pending_reasons
from worker.launchers.slurm.rank import SlurmRank
from worker.launchers.slurm.states import (
    SacctRecord,
    parse_sacct,
    sacct_command,
    slurm_job_name,
    status_from_records,
)
from worker.launchers.slurm.submitit_adapter import (
    sbatch_script,
    submission_script,
    submit_with_environment,
    task_command,
)

log = logging.getLogger(__name__)

NAME = "slurm"
DEFAULT_POLL_INTERVAL_S = 1.0  # one sacct per this many seconds, for all followed jobs
DEFAULT_MISSING_GRACE_S = 60.0  # sacct may not know a fresh job yet; after this it is lost
DEFAULT_CANCEL_CONFIRM_S = 15.0  # cancel() waits this long for Slurm to confirm
MAX_FINISHED_JOBS = 1000  # ended jobs whose final status is kept for repeated polls
# Slurm runs a job as the user who submitted it, and only root may submit as another
# (sbatch --uid): ddpq does not, so every owner's job runs as the worker's account.
RUNS_AS_NOTE = (
    "runs as the worker's own Unix user (the account that calls sbatch); DDPQ_RANK_USERS is "
    "not applied on Slurm (sbatch --uid needs root): separate owners with one Slurm worker "
    "(and its account) per owner"
)


@dataclass
class _Followed:
    """What the launcher knows about one Slurm job it follows."""

    first_polled_mono: float
    job_name: str | None = None  # ``ddpq-<job_id>-<attempt>``; learnt from sacct on re-attach
    ids: tuple[int, int] | None = None  # (job_id, attempt); from the name or array manifest
    records: list[SacctRecord] | None = None
    final: RunStatus | None = None
    cancel_sent: bool = False


class SlurmLauncher:
    """Runs attempts as Slurm jobs through submitit (see the module docstring)."""

    name = NAME

    def __init__(
        self,
        settings: Settings,
        *,
        cwd: Path | None = None,
        python: str = sys.executable,
        partition: str | None = None,
        signal_delay_s: int = DEFAULT_SIGNAL_DELAY_S,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        missing_grace_s: float = DEFAULT_MISSING_GRACE_S,
        cancel_confirm_s: float = DEFAULT_CANCEL_CONFIRM_S,
        sacct: str = "sacct",
        squeue: str = "squeue",
        scontrol: str = "scontrol",
    ) -> None:
        """Args:
        settings: where ranks find the API (``resolved_api_url``: it must be reachable
            from the compute nodes) and the artifact root (which every Slurm node must see
            at the same path).
        cwd: the ranks' working directory (``--chdir``; default: the worker's).
        python: the interpreter the ranks run (same path on every node).
        partition: used when a spec names none (else Slurm's default partition).
        signal_delay_s: seconds before the time limit that Slurm sends USR1.
        poll_interval_s: at most one sacct per this many seconds; polls in between share it.
        missing_grace_s: seconds a job may be unknown to sacct before it counts as lost.
        cancel_confirm_s: seconds ``cancel`` waits for Slurm to confirm the job ended.
        sacct, squeue: the sacct and squeue executables.
        scontrol: the scontrol executable (read once: the cluster's ``MaxArraySize``).
        """
        self.settings = settings
        self.api_url = settings.resolved_api_url
        self.artifact_dir = settings.resolved_artifact_dir
        self.cwd = (cwd or Path.cwd()).resolve()
        self.python = python
        self.partition = partition
        self.signal_delay_s = signal_delay_s
        self.poll_interval_s = poll_interval_s
        self.missing_grace_s = missing_grace_s
        self.cancel_confirm_s = cancel_confirm_s
        self.sacct = sacct
        self.squeue = squeue
        self.scontrol = scontrol
        self._max_array_size: int | None = None
        self._followed: dict[str, _Followed] = {}
        self._last_sacct_mono = float("-inf")
        self._last_asked: frozenset[str] = frozenset()  # the handles the last sacct covered
        self.sacct_calls = 0  # how many sacct calls this launcher made (tests check batching)

    # -- plan ----------------------------------------------------------------------------

    @classmethod
    def from_settings(cls, settings: Settings) -> Self:
        """The launcher of a Slurm worker of this deployment: its ``slurm_python`` (default:
        this interpreter), ``slurm_partition`` and ``slurm_signal_delay_s`` settings."""
        return cls(
            settings,
            python=settings.slurm_python or sys.executable,
            partition=settings.slurm_partition,
            signal_delay_s=settings.slurm_signal_delay_s,
        )

    def bind_gpus(
        self, plan: LaunchPlan[SlurmBatchRequest], gpus: Sequence[int]
    ) -> LaunchPlan[SlurmBatchRequest]:
        """``plan`` unchanged: Slurm places GPUs itself (``--gpus-per-node``)."""
        return plan

    def plan(self, spec: JobSpec, job_id: int, attempt: int) -> LaunchPlan[SlurmBatchRequest]:
        """The sbatch script submitit will submit for this attempt; touches nothing. Its
        note says whose account the job runs as (``RUNS_AS_NOTE``).

        Raises:
            LaunchError: ``spec.slurm.extra`` sets an option ddpq manages.
        """
        folder = artifacts.slurm_dir(self.artifact_dir, job_id, attempt)
        params = sbatch_parameters(
            spec,
            job_id,
            attempt,
            cwd=str(self.cwd),
            artifact_dir=self.artifact_dir,
            api_url=self.api_url,
            default_partition=self.partition,
            signal_delay_s=self.signal_delay_s,
        )
        script = sbatch_script(task_command(self.python, folder), folder, params)
        return LaunchPlan(
            launcher=NAME,
            job_id=job_id,
            attempt=attempt,
            argv=["sbatch"],
            env=rank_environment(
                spec, job_id, attempt, artifact_dir=self.artifact_dir, api_url=self.api_url
            ),
            cwd=str(self.cwd),
            log_dir=str(artifacts.attempt_dir(self.artifact_dir, job_id, attempt)),
            script=script,
            request=SlurmBatchRequest(folder=str(folder), parameters=params),
            files={artifacts.spec_path(self.artifact_dir, job_id, attempt).name:
                   spec.model_dump_json()},
            notes=(RUNS_AS_NOTE,),
        )  # fmt: skip

    # -- start ---------------------------------------------------------------------------

    def start(self, plan: LaunchPlan[SlurmBatchRequest]) -> str:
        """Write the plan's files (the spec) into the attempt directory, then submit the
        plan's script through submitit (the worker loop records the handle as the job's
        ``scheduler_job_id``: this launcher writes nothing to the database). The plan's
        environment, attempt token included, travels in submitit's pickle (``SlurmRank``),
        in a folder only the worker's user can read.

        Returns:
            The handle: Slurm's job id.
        Raises:
            LaunchError: Slurm is not installed, sbatch refused the job (its message, plus
                what the partition's nodes offer), or the plan was not made by ``plan``.
        """
        from submitit.slurm.slurm import SlurmExecutor

        if plan.request is None:
            raise LaunchError("a Slurm plan needs its SlurmBatchRequest (made by plan())")
        folder = Path(plan.request.folder)
        # A copy: submitit's executor and the plan must not share a mutable dict.
        params = dict(plan.request.parameters)
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            write_plan_files(plan)
            # submitit's pickle carries the attempt token: owner only (mkdir's mode is
            # masked by the umask, and an existing folder keeps its mode: chmod).
            folder.mkdir(mode=0o700, exist_ok=True)
            folder.chmod(0o700)
        except (OSError, ValueError) as exc:
            raise LaunchError(f"could not prepare {folder}: {exc}") from exc
        try:
            executor = SlurmExecutor(folder=folder, python=shlex.quote(self.python))
        except RuntimeError as exc:
            raise LaunchError(f"cannot submit to Slurm: {exc}") from exc
        executor.update_parameters(**params)
        submit_with_environment(executor, inherited_env(os.environ))
        if submission_script(executor) != plan.script:
            raise LaunchError("the sbatch script submitit would submit differs from the plan")
        rank = SlurmRank(env=dict(plan.env))
        try:
            job = executor.submit(rank)
        except Exception as exc:  # submitit wraps sbatch's failure in several types
            raise LaunchError(refusal_message(params, exc)) from exc
        handle = str(job.job_id)
        self._followed[handle] = _Followed(
            first_polled_mono=time.monotonic(),
            job_name=slurm_job_name(plan.job_id, plan.attempt),
        )
        log.info("job_id=%d attempt=%d submitted as Slurm job %s", plan.job_id, plan.attempt,
                 handle, extra={"job_id": plan.job_id, "attempt": plan.attempt})  # fmt: skip
        return handle

    # -- arrays (a sweep's trials) -------------------------------------------------------

    @property
    def max_array_size(self) -> int:
        """The cluster's ``MaxArraySize`` (elements per array at most), read from ``scontrol
        show config`` on first use and kept."""
        if self._max_array_size is None:
            self._max_array_size = read_max_array_size(self.scontrol)
        return self._max_array_size

    def plan_array(
        self, plans: Sequence[LaunchPlan[SlurmBatchRequest]], *, parallelism: int | None
    ) -> list[ArrayPlan[SlurmArrayRequest]]:
        """The job arrays (``worker.launchers.slurm.array.plan_arrays``) that start ``plans``,
        chunked below ``max_array_size`` (the one read this makes, once), at most
        ``parallelism`` elements of each running at once (``--array=0-<n-1>%<parallelism>``).

        Raises:
            LaunchError: a plan was not made by ``plan``, or the cluster disables arrays.
        """
        size = self.max_array_size
        return plan_arrays(plans, parallelism=parallelism, python=self.python,
                           artifact_dir=self.artifact_dir, max_array_size=size)  # fmt: skip

    def start_array(self, plan: ArrayPlan[SlurmArrayRequest]) -> list[str]:
        """Submit one job array through submitit (``slurm_array.start_array_plan``); returns
        the element ids ``<array id>_<index>``, in element order, each followed from here on
        like a single job's handle (one sacct per poll covers the whole array).

        Raises:
            LaunchError: as ``start``.
        """
        handles = start_array_plan(plan, python=self.python, artifact_dir=self.artifact_dir)
        name = plan.request.parameters["job_name"] if plan.request else None
        now = time.monotonic()
        for handle, element in zip(handles, plan.elements, strict=True):
            ids = (element.job_id, element.attempt)
            self._followed[handle] = _Followed(now, job_name=name, ids=ids)
            log.info("job_id=%d attempt=%d submitted as Slurm array element %s", *ids, handle,
                     extra={"job_id": ids[0], "attempt": ids[1]})  # fmt: skip
        return handles

    # -- poll ----------------------------------------------------------------------------

    def poll(self, handle: str) -> RunStatus:
        """Observe the attempt behind Slurm job ``handle`` (stable once it ended).

        Every followed job is refreshed by one sacct call at most every ``poll_interval_s``
        seconds, so polling all of a worker's jobs in a row costs one sacct. A job sacct does
        not list yet is PENDING for ``missing_grace_s`` seconds; a failed sacct keeps the last
        observation. A handle this launcher did not start (re-attach) is followed from here on.
        """
        followed = self._followed.setdefault(handle, _Followed(time.monotonic()))
        if followed.final is not None:
            return followed.final
        if handle not in self._last_asked or self._sacct_due():
            self.refresh()
        return self._status(handle, followed)

    def poll_many(self, handles: list[str]) -> dict[str, RunStatus]:
        """``poll`` for several handles with (at most) one sacct call."""
        for handle in handles:
            self._followed.setdefault(handle, _Followed(time.monotonic()))
        self.refresh()
        return {h: self.poll(h) for h in handles}

    def pending_reasons(self, handles: list[str]) -> dict[str, str]:
        """Slurm's pending reason (``squeue -o %r``) of each of ``handles`` still pending,
        by one squeue call for all of them."""
        return query_pending_reasons(handles, self.squeue)

    def _sacct_due(self) -> bool:
        return time.monotonic() - self._last_sacct_mono >= self.poll_interval_s

    def refresh(self) -> bool:
        """One sacct call for every followed job that has not ended; False if it failed."""
        pending = [h for h, f in self._followed.items() if f.final is None]
        self._last_sacct_mono = time.monotonic()
        self._last_asked = frozenset(pending)
        if not pending:
            return True
        cmd = [self.sacct, *sacct_command(pending)[1:]]
        self.sacct_calls += 1
        try:
            out = subprocess.run(
                cmd, capture_output=True, text=True, timeout=SLURM_COMMAND_TIMEOUT_S, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", None) or exc
            log.warning("sacct failed (%s); keeping the last known Slurm states", detail)
            return False
        records = parse_sacct(out)
        for handle in pending:
            followed = self._followed[handle]
            runs = records.get(handle, [])
            # Slurm can reuse a job id after losing its state: keep only this job's rows.
            name = followed.job_name or (runs[-1].job_name if runs else None)
            runs = [r for r in runs if r.job_name == name]
            if runs:
                followed.job_name, followed.records = name, runs
        return True

    def _status(self, handle: str, followed: _Followed) -> RunStatus:
        if not followed.records:
            waited = time.monotonic() - followed.first_polled_mono
            if waited < self.missing_grace_s:
                return RunStatus(RunPhase.PENDING)
            return self._end(
                followed,
                RunStatus(
                    RunPhase.FAILED,
                    f"Slurm has no record of job {handle} after {waited:.0f} s",
                    failure=FailureReason.ERROR,
                ),
            )
        status = status_from_records(followed.records)
        if status.phase in (RunPhase.PENDING, RunPhase.RUNNING):
            return status
        followed.ids = followed.ids or attempt_of(
            self.artifact_dir, followed.records[-1].job_name, handle
        )
        if followed.ids is not None:
            status = with_artifacts(self.artifact_dir, handle, *followed.ids, status)
        if status.phase == RunPhase.PREEMPTED and followed.records[-1].state != "FAILED":
            # Slurm requeued the job: stop its copy, ddpq relaunches it as the next attempt.
            scancel(handle)
        return self._end(followed, status)

    def _end(self, followed: _Followed, status: RunStatus) -> RunStatus:
        followed.final = status
        ended = [h for h, f in self._followed.items() if f.final is not None]
        for handle in ended[: max(0, len(ended) - MAX_FINISHED_JOBS)]:
            del self._followed[handle]
        return status

    # -- cancel --------------------------------------------------------------------------

    def cancel(self, handle: str) -> None:
        """``scancel`` the job, then wait up to ``cancel_confirm_s`` for sacct to show it
        ended. Idempotent; a job that already ended keeps its outcome."""
        followed = self._followed.setdefault(handle, _Followed(time.monotonic()))
        if followed.final is not None:
            return
        if not followed.cancel_sent:
            scancel(handle)
            followed.cancel_sent = True
        deadline = time.monotonic() + self.cancel_confirm_s
        while time.monotonic() < deadline:
            self.refresh()
            status = self._status(handle, followed)
            if status.phase not in (RunPhase.PENDING, RunPhase.RUNNING):
                return
            time.sleep(0.25)
        log.warning("Slurm job %s not confirmed ended %.0f s after scancel", handle,
                    self.cancel_confirm_s)  # fmt: skip
