"""A local attempt's directory, made ready before torchrun starts: a stale one moved aside,
the fresh one (and the job's checkpoint directory) handed to the rank user if there is one,
and the plan's files (the spec) written into it."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from service.core import artifacts
from worker.launchers.base import LaunchPlan, write_plan_files
from worker.launchers.local.rank_user import RankUser


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


def hand_over(directory: Path, user: RankUser) -> None:
    """Create ``directory`` (parents as the worker's) and give it to ``user``, so its ranks
    can write there. Its parents stay the worker's: a rank cannot swap the directory for a
    link elsewhere.

    Raises:
        OSError: it could not be created or given away.
    """
    directory.mkdir(parents=True, exist_ok=True)
    os.chown(directory, user.uid, user.gid, follow_symlinks=False)


def prepare_attempt_dir(
    plan: LaunchPlan[Any], artifact_dir: Path, user: RankUser | None
) -> Path | None:
    """Make ``plan.log_dir`` the attempt's fresh directory: move a stale one aside, create
    it, give it and the job's checkpoint directory to ``user`` (when ranks run as one), and
    write the plan's files (mode 0600, ``user``'s).

    Returns:
        Where a stale directory was moved, or None.
    Raises:
        OSError: a step failed.
        ValueError: a plan file name is a path.
    """
    attempt_dir = Path(plan.log_dir)
    stale = move_aside_stale_attempt(attempt_dir)
    attempt_dir.mkdir(parents=True, exist_ok=True)
    if user is not None:
        hand_over(attempt_dir, user)
        hand_over(artifacts.checkpoint_dir(artifact_dir, plan.job_id), user)
    write_plan_files(plan, owner=user.owner if user is not None else None)
    return stale
