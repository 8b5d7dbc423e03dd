"""What a launcher checks before it starts any rank: that a user entrypoint resolves. One
that does not fails the attempt in a second with the ``setup`` error its ranks would have
written, instead of after a full launch (every rank starts, imports torch, fails the same
way)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    identity: Mapping[str, Any] | None = None,
    artifact_dir: Path,
    job_id: int,
    attempt: int,
    attempt_dir: Path,
) -> RunStatus | None:
    """Check ``entrypoint`` in a subprocess as the ranks would see it (``python``, ``cwd``,
    ``env``, and ``identity``: the Popen ``user``/``group`` the ranks run as, if any). When
    it does not resolve, write rank 0's error file as rank 0 would have (reason ``setup``:
    no retry) and return the attempt's final status.

    Returns:
        A FAILED status with ``FailureReason.SETUP``, or None when the entrypoint resolves
        (or the check could not tell: the ranks decide).
    """
    problem = check_in_subprocess(
        entrypoint, python=python, cwd=cwd, env=env, identity=identity or {}
    )
    if problem is None:
        return None
    problem.reason = FailureReason.SETUP  # type: ignore[attr-defined]
    write_rank_error(artifact_dir, job_id, attempt, 0, problem, now_s())
    failure = earliest_failure(attempt_dir)
    text = failure.text if failure is not None else str(problem.detail)
    return RunStatus(RunPhase.FAILED, text, None, failure=FailureReason.SETUP)
