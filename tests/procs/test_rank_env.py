"""Nothing secret in a rank's reach: the allow-listed rank environment, and a non-dumpable
worker whose ``/proc/<pid>/environ`` another process of the same user cannot open.

The /proc checks use real processes. Run as root (CI), both processes run as an
unprivileged user (``nobody``): root itself may read any process (CAP_SYS_PTRACE), which would
prove nothing.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from worker.attempt import inherited_env
from worker.processes import make_undumpable

REPO = Path(__file__).resolve().parents[2]

WORKER_ENV = {
    "DDPQ_DATABASE_URL": "postgresql://u:secret@db.example/ddpq",
    "DDPQ_TOKEN": "ddpq_user-token",
    "DDPQ_AUTH": "on",
    "DDPQ_HOME": "/var/lib/ddpq",
    "DDPQ_RANK_USER": "ranks",
    "DDPQ_SLURM_ENABLED": "true",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "PATH": "/usr/bin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONPATH": "/src",
    "VIRTUAL_ENV": "/venv",
    "CUDA_HOME": "/usr/local/cuda",
    "NCCL_DEBUG": "INFO",
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_PROC_BIND": "close",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCHELASTIC_ERROR_FILE": "/tmp/e",
    "SLURM_JOB_ID": "42",
    "MASTER_ADDR": "node1",
    "DDPQ_PG_TIMEOUT_S": "120",
    "DDPQ_ALLOWED_ENTRYPOINTS": '["examples.*:*"]',
}


def test_rank_env_drops_the_workers_secrets_and_keeps_the_allowed() -> None:
    env = inherited_env(WORKER_ENV)
    for secret in ("DDPQ_DATABASE_URL", "DDPQ_TOKEN", "DDPQ_AUTH", "AWS_SECRET_ACCESS_KEY"):
        assert secret not in env, f"{secret} must not reach a rank: {sorted(env)}"
    assert not any("secret" in value for value in env.values()), env
    ddpq = {name for name in env if name.startswith("DDPQ_")}
    assert ddpq == {"DDPQ_PG_TIMEOUT_S", "DDPQ_ALLOWED_ENTRYPOINTS"}, (
        "a rank inherits only the DDPQ_* variables the rank runtime reads"
    )
    for kept in ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "CUDA_HOME",
                 "NCCL_DEBUG", "GLOO_SOCKET_IFNAME", "OMP_PROC_BIND",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE", "SLURM_JOB_ID",
                 "MASTER_ADDR"):  # fmt: skip
        assert env[kept] == WORKER_ENV[kept], kept


def _unprivileged_ids() -> tuple[int, int] | None:
    """``(uid, gid)`` of ``nobody`` when we are root (the children become that user), None
    when we are not root (they stay our user)."""
    if os.geteuid() != 0:
        return None
    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root and there is no user 'nobody' to read /proc as")
    return user.pw_uid, user.pw_gid


def _become(ids: tuple[int, int] | None) -> None:
    if ids is not None:
        os.setgroups([])
        os.setgid(ids[1])
        os.setuid(ids[0])


def _fork_holder(ids: tuple[int, int] | None, *, undumpable: bool) -> tuple[int, int]:
    """Fork a child that becomes ``ids``, sets its dumpable flag (a uid change clears it, so
    the control sets it back as a freshly exec'd process has it), then waits to be killed.
    Forked, not exec'd: the interpreter may lie where that user cannot run it (/root).

    Returns:
        Its pid and the read end of a pipe that says "ready".
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on
        try:
            _become(ids)
            ok = make_undumpable() if undumpable else set_dumpable_for_test()
            os.write(write_fd, b"ready" if ok else b"failed")
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(write_fd)
    return pid, read_fd


def set_dumpable_for_test() -> bool:
    """``prctl(PR_SET_DUMPABLE, 1)``: what an ordinary process has."""
    return ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0) == 0


def _can_read_environ(ids: tuple[int, int] | None, pid: int) -> str:
    """From a forked child that becomes ``ids``: "read", or the error's type name."""
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:
        answer = b"read"
        try:
            _become(ids)
            with open(f"/proc/{pid}/environ", "rb") as fh:
                fh.read()
        except OSError as exc:
            answer = type(exc).__name__.encode()
        finally:
            os.write(write_fd, answer)
            os._exit(0)
    os.close(write_fd)
    os.waitpid(child, 0)
    with os.fdopen(read_fd, "rb") as fh:
        return fh.read().decode()


@pytest.fixture
def holders() -> Iterator[Any]:
    pids: list[int] = []

    def _start(ids: tuple[int, int] | None, *, undumpable: bool) -> int:
        pid, ready_fd = _fork_holder(ids, undumpable=undumpable)
        pids.append(pid)
        with os.fdopen(ready_fd, "rb") as fh:
            assert fh.read(5) == b"ready", "the holder could not set its dumpable flag"
        return pid

    yield _start
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_same_user_process_cannot_read_an_undumpable_workers_environ(holders: Any) -> None:
    ids = _unprivileged_ids()
    # The control: the same reader reads an ordinary process of its own user ...
    assert _can_read_environ(ids, holders(ids, undumpable=False)) == "read"
    # ... but not the environment of one that made itself non-dumpable.
    guarded = holders(ids, undumpable=True)
    assert _can_read_environ(ids, guarded) == "PermissionError", (
        f"a process of the same user should get PermissionError on /proc/{guarded}/environ "
        "once the owner called make_undumpable()"
    )


def test_make_undumpable_sets_the_flag_in_a_child() -> None:
    code = "from worker.processes import *; assert is_dumpable(); make_undumpable(); " \
        "assert not is_dumpable(); print('ok')"  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_sqlite_files_are_owner_only(tmp_path: Path) -> None:
    from service.store.db import Database
    from service.store.migrate import upgrade

    (tmp_path / "ddpq.db-wal").touch(mode=0o644)  # left by an older version: made private
    db = Database.from_url(f"sqlite:///{tmp_path / 'ddpq.db'}")
    try:
        upgrade(db.engine)
        with db.session() as s:
            s.connection().exec_driver_sql("SELECT 1")
    finally:
        db.dispose()
    files = [p for p in tmp_path.iterdir() if p.name.startswith("ddpq.db")]
    assert files, "the database file should exist"
    for path in files:
        assert path.stat().st_mode & 0o777 == 0o600, f"{path} should be mode 0600"
