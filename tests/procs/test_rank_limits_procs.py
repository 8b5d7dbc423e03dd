"""What a local attempt may consume, against real processes: its ranks' logs are capped by
the worker however the ranks write (DDPQ_RANK_LOG_MAX_BYTES), and its processes get
RLIMIT_NOFILE and RLIMIT_NPROC (DDPQ_RANK_NOFILE_MAX, DDPQ_RANK_NPROC_MAX).

The stand-in rank (stdlib plus the runtime's ``redirect_output``, no torch) points its fds 1/2
where a real rank does, then writes far past the cap: with ``os.write`` on fd 1 and from a
child process (neither goes through a Python wrapper). The fork bomb runs only as a dedicated
unprivileged user (root ignores RLIMIT_NPROC) and is itself bounded, so a bug cannot exhaust
this shared machine's process table.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from worker.launchers.base import RunPhase, RunStatus
from worker.launchers.local.launcher import LocalLauncher
from worker.launchers.local.process_limits import RankLimits, launch_preexec

REPO = Path(__file__).resolve().parents[2]
SLOW_BOX_S = 180.0
CAP = 128 * 1024
WRITTEN = 8 * 1024 * 1024  # per rank and way: 64 × the cap
BOMB_USER = "ddpq-bomb-test"
STAND_IN = textwrap.dedent(
    f"""
    import os, json, subprocess, sys
    from pathlib import Path
    sys.path.insert(0, {str(REPO)!r})
    from service.core import artifacts
    from worker.runtime.rank_output import redirect_output
    rank = int(os.environ["RANK"])
    root = Path(os.environ["DDPQ_ARTIFACT_DIR"])
    job, attempt = int(os.environ["DDPQ_JOB_ID"]), int(os.environ["DDPQ_ATTEMPT"])
    d = artifacts.attempt_dir(root, job, attempt)
    if os.environ["STAND_IN"] == "fd_bomb":
        opened = []
        while True:
            opened.append(os.open("/dev/null", os.O_RDONLY))  # OSError: EMFILE ends it
    # Before the redirect; the fd bomb writes none, or the other rank's flood could push
    # this rank's traceback out of the capped launcher log.
    os.write(1, b"torchrun's side " * ({WRITTEN} // 16))
    with redirect_output(artifacts.rank_log_path(root, job, attempt, rank),
                         artifacts.rank_log_pipe_path(root, job, attempt, rank)):
        os.write(1, b"FIRST LINE of rank %d\\n" % rank)
        line = b"x" * 63 + b"\\n"
        for _ in range({WRITTEN} // 64 // 64):
            os.write(1, line * 64)
        subprocess.run(["head", "-c", "{WRITTEN}", "/dev/zero"], check=True)
        os.write(2, b"LAST LINE of rank %d\\n" % rank)
    if rank == 0:
        (d / "result.json").write_text(json.dumps({{"status": "succeeded"}}))
    """
)
MARKER_RE = re.compile(rb"\n\xe2\x80\xa6 [\d.]+ MB cut \((\d+) bytes; DDPQ_RANK_LOG_MAX_BYTES")


def _wait_end(launcher: LocalLauncher, handle: str) -> RunStatus:
    deadline = time.monotonic() + SLOW_BOX_S
    while time.monotonic() < deadline:
        status = launcher.poll(handle)
        if status.phase != RunPhase.RUNNING:
            return status
        time.sleep(0.2)
    launcher.cancel(handle)
    raise AssertionError(f"attempt {handle} still running after {SLOW_BOX_S} s")


def _run(tmp_path: Path, mode: str, **limits: int) -> tuple[RunStatus, Path]:
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    settings = Settings(
        home=tmp_path, artifact_dir=tmp_path / "artifacts", rank_log_max_bytes=CAP,
        job_pids_max=None, **limits,
    )  # fmt: skip
    launcher = LocalLauncher(settings, entry=(str(stand_in),))
    spec = JobSpec.model_validate(
        {"name": "t", "task": "regression", "resources": {"nproc_per_node": 2}}
    )
    plan = launcher.plan(spec, 1, 1)
    plan = type(plan)(**{**plan.__dict__, "env": {**plan.env, "STAND_IN": mode}})
    return _wait_end(launcher, launcher.start(plan)), Path(plan.log_dir)


def test_ranks_writing_far_past_the_cap_leave_capped_logs_and_still_succeed(
    tmp_path: Path,
) -> None:
    status, attempt_dir = _run(tmp_path, "flood")
    assert status.phase == RunPhase.SUCCEEDED, status
    for rank in (0, 1):
        text = (attempt_dir / artifacts.rank_log_name(rank)).read_bytes()
        assert len(text) <= CAP + 200, len(text)
        assert text.startswith(b"FIRST LINE of rank %d\n" % rank)
        assert text.endswith(b"LAST LINE of rank %d\n" % rank)
        match = MARKER_RE.search(text)
        assert match is not None
        assert int(match.group(1)) > 2 * WRITTEN - CAP  # the line's count is what was cut
        assert not (attempt_dir / f"rank-{rank}.log.pipe").exists()  # the FIFO is gone
    launcher_log = (attempt_dir / "launcher.log").read_bytes()
    assert len(launcher_log) <= CAP + 200 and MARKER_RE.search(launcher_log)
    # Each cut log is a job event the worker posts, with what was written and the setting.
    noted = {data["quota"]: data for kind, data in status.notes if kind == "quota_exceeded"}
    assert set(noted) == {"log rank-0.log", "log rank-1.log", "log launcher.log"}, noted
    assert noted["log rank-0.log"]["setting"] == "DDPQ_RANK_LOG_MAX_BYTES"
    assert noted["log rank-0.log"]["asked"] > WRITTEN


def test_a_rank_opening_files_without_end_fails_at_its_nofile_limit(tmp_path: Path) -> None:
    status, attempt_dir = _run(tmp_path, "fd_bomb", rank_nofile_max=64)
    assert status.phase == RunPhase.FAILED, status
    said = (attempt_dir / "launcher.log").read_text(errors="replace")
    assert "OSError: [Errno 24] Too many open files" in said, said[-2000:]


@pytest.fixture(scope="module")
def bomb_user() -> pwd.struct_passwd:
    """An unprivileged user of its own, so RLIMIT_NPROC counts only the bomb's processes."""
    if os.geteuid() != 0:
        pytest.skip("the fork bomb runs as a test user: run as root to create it")
    try:
        return pwd.getpwnam(BOMB_USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip(f"no useradd to create {BOMB_USER}")
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", BOMB_USER], check=True, timeout=60)  # fmt: skip
        return pwd.getpwnam(BOMB_USER)


def _pids_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def test_a_fork_bomb_is_held_at_the_nproc_limit(bomb_user: pwd.struct_passwd) -> None:
    uid = bomb_user.pw_uid
    assert not _pids_of(uid), f"{BOMB_USER} already runs processes"
    limit = 16
    # Bounded on its own (300 forks at most), so a missing limit fails the test, not the box.
    bomb = "i=0; while [ $i -lt 300 ]; do sleep 30 </dev/null >/dev/null 2>&1 & i=$((i+1)); done"
    proc = subprocess.Popen(
        ["/bin/sh", "-c", bomb], user=uid, group=bomb_user.pw_gid, extra_groups=[],
        cwd="/", env={"PATH": os.environ.get("PATH", "")}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=launch_preexec(RankLimits(nproc=limit, nofile=None)),
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=SLOW_BOX_S)
        alive = _pids_of(uid)
        assert len(alive) <= limit, f"{len(alive)} processes of {BOMB_USER}, limit {limit}"
        assert b"fork" in err.lower() or b"resource" in err.lower(), err[-500:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in _pids_of(uid):  # the bomb's own processes: this test started them
            os.kill(pid, signal.SIGKILL)
    assert sys.executable  # the test process itself is alive and well
