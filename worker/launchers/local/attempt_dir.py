"""A local attempt's directory, made ready before torchrun starts: a stale one moved aside,
the fresh one (and the job's checkpoint directory) handed to the job's rank user if there is
one, and the plan's files (the spec) written into it.

With rank users (``DDPQ_RANK_USERS``) one owner's user must not read another's files on this
host. So what the ranks write lies in directories their user alone owns, mode 0700: the
attempt directory (workspace, rank logs, ``launcher.log``, spills) and the job's checkpoint
directory; the directories above them stay the worker's, mode 0711 (``jobs/``,
``jobs/<id>/``, ``workspace-cache/``: a user passes through to its own but lists nothing),
each user has a workspace cache of its own, and the API's workspace file store
(``workspaces/``) is closed to them (0700). Directories are changed through a descriptor
opened without following links, and none that a rank user owns is ever a parent of
another's.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

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


# Modes: what a rank user owns (no one else may enter), and the worker's directories above
# them (everyone may pass through to a directory of their own, no one may list).
PRIVATE_MODE = 0o700
PASS_THROUGH_MODE = 0o711


def _set_owner_and_mode(directory: Path, owner: tuple[int, int] | None, mode: int) -> None:
    """chown (when ``owner``) and chmod ``directory`` through a descriptor opened without
    following a symlink, so a link planted in its place is never changed through.

    Raises:
        OSError: it is missing, a link, not a directory, or could not be changed.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def hand_over(directory: Path, user: RankUser) -> None:
    """Create ``directory`` (parents as the worker's) and give it to ``user`` alone (mode
    0700), so its ranks can write there and no other user can read it. Its parents stay the
    worker's: a rank cannot swap the directory for a link elsewhere.

    Raises:
        OSError: it could not be created or given away.
    """
    directory.mkdir(parents=True, exist_ok=True)
    _set_owner_and_mode(directory, user.owner, PRIVATE_MODE)


def seal_shared_dirs(artifact_dir: Path, job_id: int, user: RankUser) -> None:
    """Make the worker's directories above a job's 0711 (``jobs/``, ``jobs/<id>/``,
    ``workspace-cache/``), give ``user`` a workspace cache of its own (0700), and close the
    API's workspace file store (``workspaces/``, 0700: only the API reads it) when it is here.

    Raises:
        OSError: a directory could not be created or changed.
    """
    job = artifacts.job_dir(artifact_dir, job_id)
    job.mkdir(parents=True, exist_ok=True)
    for directory in (job.parent, job):
        _set_owner_and_mode(directory, None, PASS_THROUGH_MODE)
    cache = artifacts.workspace_cache_dir(artifact_dir)
    cache.mkdir(parents=True, exist_ok=True)
    _set_owner_and_mode(cache, None, PASS_THROUGH_MODE)
    hand_over(artifacts.user_workspace_cache_dir(artifact_dir, user.uid), user)
    store = artifacts.workspace_store_dir(artifact_dir)
    if store.is_dir() and not store.is_symlink():
        _set_owner_and_mode(store, None, PRIVATE_MODE)


def open_launcher_log(path: Path, user: RankUser | None) -> IO[bytes]:
    """Open the attempt's ``launcher.log`` for appending (torchrun's output), given to
    ``user`` (mode 0600) when ranks run as one: a job's logs are its owner's user's.

    Raises:
        OSError: it could not be opened or given away.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if user is not None:
            os.fchown(fd, *user.owner)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab")


def prepare_attempt_dir(
    plan: LaunchPlan[Any], artifact_dir: Path, user: RankUser | None
) -> Path | None:
    """Make ``plan.log_dir`` the attempt's fresh directory: move a stale one aside, create
    it, give it and the job's checkpoint directory to ``user`` alone (when ranks run as one;
    the directories above sealed, ``seal_shared_dirs``), and write the plan's files (mode
    0600, ``user``'s).

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
        seal_shared_dirs(artifact_dir, plan.job_id, user)
        hand_over(attempt_dir, user)
        hand_over(artifacts.checkpoint_dir(artifact_dir, plan.job_id), user)
    write_plan_files(plan, owner=user.owner if user is not None else None)
    return stale
