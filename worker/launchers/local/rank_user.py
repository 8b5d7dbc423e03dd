"""``DDPQ_RANK_USER``: the Unix user a root-run local worker starts its ranks as.

With it set, torchrun (and so every rank) runs as that user with its own primary group and no
supplementary groups; the attempt directory and the job's checkpoint directory are handed to
it. What the worker keeps to itself then stays out of the ranks' reach by plain file
permissions: the embedded default's SQLite file is 0600 root (the store makes it private),
and the worker's environment (its worker token) is another user's ``/proc/<pid>/environ``.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.attempt import inherited_env
from worker.errors import LaunchError


@dataclass(frozen=True)
class RankUser:
    """The user ranks run as: its name, uid, primary gid and home directory."""

    name: str
    uid: int
    gid: int
    home: str

    @property
    def owner(self) -> tuple[int, int]:
        """``(uid, gid)`` for chown."""
        return self.uid, self.gid

    def env(self) -> dict[str, str]:
        """The identity entries of the ranks' environment (HOME, USER, LOGNAME)."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


def resolve_rank_user(name: str, *, euid: int | None = None) -> RankUser:
    """Look up ``name`` and check this process may start processes as it.

    Args:
        name: a Unix user name (``DDPQ_RANK_USER``).
        euid: the effective uid to check (default: this process's).
    Raises:
        LaunchError: not running as root, or no such user (each message says what to do).
    """
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise LaunchError(
            f"DDPQ_RANK_USER={name} needs a worker running as root (it runs as uid {euid}): "
            "start the worker as root, or unset DDPQ_RANK_USER to run ranks as the worker's "
            "own user"
        )
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise LaunchError(
            f"DDPQ_RANK_USER={name}: no such user on this host; create it (e.g. `useradd "
            f"--system --no-create-home {name}`) or unset DDPQ_RANK_USER"
        ) from None
    if entry.pw_uid == 0:
        raise LaunchError(f"DDPQ_RANK_USER={name} is root (uid 0): name an unprivileged user")
    return RankUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir or "/")


def process_env(plan_env: Mapping[str, str], user: RankUser | None) -> dict[str, str]:
    """The environment torchrun (and so every rank) starts with: the allowed part of the
    worker's own (``worker.attempt.inherited_env``), the rank user's identity (HOME, USER,
    LOGNAME) if any, then the plan's entries."""
    identity = user.env() if user is not None else {}
    return {**inherited_env(os.environ), **identity, **plan_env}


def popen_identity(user: RankUser | None) -> dict[str, Any]:
    """``subprocess.Popen`` keywords that start a process as ``user``: its uid, its primary
    group and no supplementary groups (the worker's, e.g. root's, are not handed down);
    none without a user."""
    if user is None:
        return {}
    return {"user": user.uid, "group": user.gid, "extra_groups": []}
