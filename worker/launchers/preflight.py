"""What a launcher does before it starts any rank: give the attempt an empty directory
(``move_aside_stale_attempt``), and check a user entrypoint resolves: one that does not fails
the attempt in a second with the ``setup`` error its ranks would have written, instead of after
a full launch (every rank starts, imports torch, fails the same way)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from worker.attempt import FailureReason, now_s, write_rank_error
from worker.entrypoints import check_in_subprocess
from worker.launchers.base import RunPhase, RunStatus
from worker.launchers.failure_text import earliest_failure


def entrypoint_setup_failure(
    entrypoint: str,
    *,
    python: str,
    cwd: str,
    env: Mapping[str, str],
    artifact_dir: Path,
    job_id: int,
    attempt: int,
    attempt_dir: Path,
) -> RunStatus | None:
    """Check ``entrypoint`` in a subprocess as the ranks would see it (``python``, ``cwd``,
    ``env``). When it does not resolve, write rank 0's error file as rank 0 would have
    (reason ``setup``: no retry) and return the attempt's final status.

    Returns:
        A FAILED status with ``FailureReason.SETUP``, or None when the entrypoint resolves
        (or the check could not tell: the ranks decide).
    """
    problem = check_in_subprocess(entrypoint, python=python, cwd=cwd, env=env)
    if problem is None:
        return None
    problem.reason = FailureReason.SETUP  # type: ignore[attr-defined]
    write_rank_error(artifact_dir, job_id, attempt, 0, problem, now_s())
    failure = earliest_failure(attempt_dir)
    text = failure.text if failure is not None else str(problem.detail)
    return RunStatus(RunPhase.FAILED, text, None, failure=FailureReason.SETUP)


def move_aside_stale_attempt(attempt_dir: Path) -> Path | None:
    """Rename a non-empty ``attempt_dir`` to ``<name>.stale-<UTC time>`` so the attempt
    starts empty (no earlier result.json, error files or logs can be mistaken for its own).

    Returns:
        Where it was moved, or None when there was nothing to move (absent or empty).
    Raises:
        OSError: the rename failed.
    """
    try:
        if not any(attempt_dir.iterdir()):
            return None
    except FileNotFoundError:
        return None
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    target = attempt_dir.with_name(f"{attempt_dir.name}.stale-{stamp}")
    attempt_dir.rename(target)
    return target
