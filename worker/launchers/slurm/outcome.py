"""What an ended Slurm attempt left in its attempt directory, on top of what sacct said:
result.json decides success, a rank's error file names the failure, else the tail of task 0's
stderr; and which ddpq attempt a Slurm job or array element runs."""

from __future__ import annotations

from pathlib import Path

from service.core import artifacts
from worker.attempt import FailureReason
from worker.launchers.base import RunPhase, RunStatus
from worker.launchers.failure_text import earliest_failure, tail_lines
from worker.launchers.slurm.array import element_attempt
from worker.launchers.slurm.states import parse_job_name


def attempt_of(artifact_dir: Path, job_name: str, handle: str) -> tuple[int, int] | None:
    """``(job_id, attempt)`` that Slurm job ``handle`` named ``job_name`` runs: from a single
    job's name (``ddpq-<job_id>-<attempt>``), or an array element's manifest entry; None for a
    job ddpq did not name."""
    return parse_job_name(job_name) or element_attempt(artifact_dir, job_name, handle)


def with_artifacts(
    artifact_dir: Path, handle: str, job_id: int, attempt: int, status: RunStatus
) -> RunStatus:
    """``status`` (what sacct said of an ended attempt) corrected by its files: result.json
    (written before teardown) beats the exit code; a rank's error file is the best reason for
    a failure (its text and its ``FailureReason``), else the tail of task 0's stderr (with the
    state's reason, ``FailureReason.ERROR``)."""
    result = artifacts.result_path(artifact_dir, job_id, attempt)
    if status.phase in (RunPhase.SUCCEEDED, RunPhase.FAILED) and result.exists():
        return RunStatus(RunPhase.SUCCEEDED, exit_code=status.exit_code)
    if status.phase != RunPhase.FAILED:
        return status
    error = earliest_failure(artifacts.attempt_dir(artifact_dir, job_id, attempt))
    if error is not None:
        return RunStatus(RunPhase.FAILED, error.text, status.exit_code, failure=error.reason)
    # An array element's is the array folder's <id>_<index>_0_log.err, through the link.
    stderr = artifacts.slurm_dir(artifact_dir, job_id, attempt) / artifacts.slurm_stderr_name(
        handle
    )
    reason = f"{status.reason}; last lines of {stderr.name}:\n{tail_lines(stderr)}"
    failure = status.failure or FailureReason.ERROR
    return RunStatus(RunPhase.FAILED, reason, status.exit_code, failure=failure)
