"""The Unix user a root-run local worker starts a job's ranks as: its owner's, from
``DDPQ_RANK_USERS`` (owner → user, ``*`` for the rest) or ``DDPQ_RANK_USER`` (one user for every
owner); ``service.core.owners.rank_users`` resolves the owner to a name, this module the name to a
uid and gid.

With a map set, torchrun (and so every rank) runs as the owner's user with its own primary
group and no supplementary groups; the attempt directory and the job's checkpoint directory
are handed to it (``attempt_dir``). What the worker keeps to itself then stays out of the
ranks' reach by plain file permissions: the embedded default's SQLite file is 0600 root (the
store makes it private), and the worker's environment (its worker token) is another user's
``/proc/<pid>/environ``.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.core.owners.rank_users import RANK_USERS_SETTING, RankUserMap, unmapped_owner_message
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


def resolve_rank_user(
    name: str, *, euid: int | None = None, setting: str = "DDPQ_RANK_USER"
) -> RankUser:
    """Look up ``name`` and check this process may start processes as it.

    Args:
        name: a Unix user name (``DDPQ_RANK_USER``, or an entry of ``DDPQ_RANK_USERS``).
        euid: the effective uid to check (default: this process's).
        setting: the setting that named the user, for the messages.
    Raises:
        LaunchError: not running as root, or no such user (each message says what to do).
    """
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise LaunchError(
            f"{setting} ({name}) needs a worker running as root (it runs as uid {euid}): "
            f"start the worker as root, or unset {setting} to run ranks as the worker's "
            "own user"
        )
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise LaunchError(
            f"{setting} ({name}): no such user on this host; create it (e.g. `useradd "
            f"--system --no-create-home {name}`) or remove it from {setting}"
        ) from None
    if entry.pw_uid == 0:
        raise LaunchError(f"{setting} ({name}) is root (uid 0): name an unprivileged user")
    return RankUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir or "/")


class RankUsers:
    """The worker's owner → ``RankUser`` resolver (its ``DDPQ_RANK_USERS`` or
    ``DDPQ_RANK_USER``); none configured: every job's ranks run as the worker's own user."""

    def __init__(
        self, users: RankUserMap, *, setting: str = RANK_USERS_SETTING, euid: int | None = None
    ) -> None:
        """Check every user the map names once, at start, so a typo stops the worker with a
        clear message rather than failing jobs one by one.

        Args:
            setting: the setting the map came from, for the messages.
            euid: the effective uid to check (default: this process's).
        Raises:
            LaunchError: a map is set but this process is not root, a named user does not
                exist, or it is root.
        """
        self.users = users
        self.setting = setting
        self.euid = euid
        for name in users.names():
            resolve_rank_user(name, euid=euid, setting=self.setting)

    @property
    def configured(self) -> bool:
        """Whether ranks run as mapped users at all."""
        return self.users.configured

    def for_owner(self, owner: str | None) -> RankUser | None:
        """The user a job of ``owner`` runs its ranks as, looked up now (at launch, so a user
        removed since the worker started is noticed); None when no map is configured.

        Raises:
            LaunchError: the map covers ``owner`` not (the API should have refused the job
                at submit: its settings may differ from this worker's), or the user is gone.
        """
        if not self.users.configured:
            return None
        name = self.users.user_for(owner)
        if name is None:
            raise LaunchError(f"{unmapped_owner_message(owner)} (this worker has none for it)")
        return resolve_rank_user(name, euid=self.euid, setting=self.setting)


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
