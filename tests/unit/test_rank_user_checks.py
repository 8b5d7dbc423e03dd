"""``DDPQ_RANK_USER`` is refused at worker start unless the worker is root and the user exists
(the local launcher's constructor checks, ``run_worker`` builds it first)."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from service.core.config import Settings
from worker.errors import LaunchError
from worker.launchers.local.launcher import LocalLauncher
from worker.launchers.local.rank_user import resolve_rank_user


def _some_user() -> pwd.struct_passwd:
    users = [u for u in pwd.getpwall() if u.pw_uid != 0]
    if not users:
        pytest.skip("no unprivileged user on this host")
    return users[0]


def test_a_worker_that_is_not_root_is_refused() -> None:
    user = _some_user()
    with pytest.raises(LaunchError, match="needs a worker running as root"):
        resolve_rank_user(user.pw_name, euid=1000)


def test_an_unknown_user_is_refused() -> None:
    with pytest.raises(LaunchError, match="no such user"):
        resolve_rank_user("ddpq-no-such-user-x", euid=0)


def test_root_itself_is_refused() -> None:
    with pytest.raises(LaunchError, match="unprivileged"):
        resolve_rank_user("root", euid=0)


def test_a_known_user_resolves() -> None:
    user = _some_user()
    resolved = resolve_rank_user(user.pw_name, euid=0)
    assert (resolved.uid, resolved.gid) == (user.pw_uid, user.pw_gid)
    assert resolved.env()["HOME"] == (user.pw_dir or "/")


def test_the_local_launcher_checks_at_construction(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, rank_user="ddpq-no-such-user-x")
    match = "needs a worker running as root" if os.geteuid() != 0 else "no such user"
    with pytest.raises(LaunchError, match=match):
        LocalLauncher(settings)
