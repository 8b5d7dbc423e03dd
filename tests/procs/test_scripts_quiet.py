"""The test scripts: apt's progress stays in a log unless apt fails, and scripts/test.sh's
plan (its dry run) runs the suite in two passes reporting the slowest tests, or the fast lane.
apt runs as a fake ``apt-get`` first on PATH: nothing is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APT_INSTALL = ROOT / "scripts" / "apt-install.sh"


def run_apt_install(tmp_path: Path, *, fail: bool) -> subprocess.CompletedProcess[str]:
    """scripts/apt-install.sh over a fake apt-get that chatters (and fails if ``fail``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apt = bin_dir / "apt-get"
    apt.write_text(
        "#!/bin/sh\n"
        'echo "Reading package lists... $DEBIAN_FRONTEND $*"\n'
        "echo 'debconf: delaying package configuration' >&2\n"
        + ('case "$*" in *install*) echo "E: Unable to locate package nope" >&2; exit 100;; esac\n'
           if fail else "")
    )  # fmt: skip
    sudo = bin_dir / "sudo"
    sudo.write_text('#!/bin/sh\nexec "$@"\n')
    for script in (apt, sudo):
        script.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "DDPQ_APT_LOG": str(tmp_path / "apt.log"),
    }
    return subprocess.run(
        ["bash", str(APT_INSTALL), "nope"], env=env, capture_output=True, text=True, timeout=60
    )


def test_apt_install_is_silent_when_apt_succeeds(tmp_path: Path) -> None:
    done = run_apt_install(tmp_path, fail=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == "", "apt's progress must stay in the log"
    log = (tmp_path / "apt.log").read_text()
    assert "noninteractive -qq" in log and "install -y --no-install-recommends nope" in log, log


def test_apt_install_shows_the_log_when_apt_fails(tmp_path: Path) -> None:
    done = run_apt_install(tmp_path, fail=True)
    assert done.returncode == 100, (done.returncode, done.stderr)
    assert "installing nope failed (exit 100)" in done.stderr, done.stderr
    assert "E: Unable to locate package nope" in done.stderr, "the log's end explains why"


def test_scripts_install_through_the_quiet_helper() -> None:
    for name in ("install-browser.sh", "slurm-dev-cluster.sh"):
        text = (ROOT / "scripts" / name).read_text()
        assert "apt-install.sh" in text, f"{name}: install with scripts/apt-install.sh"
        assert "apt-get install" not in text, f"{name}: a bare apt-get install prints progress"


def script_plan(*args: str, **env: str) -> list[str]:
    """The pytest commands scripts/test.sh would run (its dry run: nothing is set up)."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh"), *args],
        env={**os.environ, "DDPQ_TEST_DRY_RUN": "1", **env},
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.splitlines()


def test_test_script_reports_the_slowest_tests() -> None:
    parallel, serial = script_plan("-k", "spec and not slow")
    # The parallel pass reports the 15 slowest tests, and extra arguments reach both passes.
    assert "--durations=15" in parallel and "-n 4 --dist loadgroup" in parallel, parallel
    assert "-m 'not serial'" in parallel and "-m serial" in serial, serial
    for command in (parallel, serial):
        assert command.endswith("-k spec\\ and\\ not\\ slow"), command


def test_fast_lane_runs_unit_and_sqlite_integration_without_services() -> None:
    (fast,) = script_plan("--fast", DDPQ_TEST_WORKERS="2")
    assert fast.startswith("python -m pytest -n 2 --dist loadgroup"), fast
    assert "not slow and not postgres and not serial and not slurm" in fast, fast
    assert fast.endswith("tests/unit tests/integration"), fast
    (single,) = script_plan("--fast", DDPQ_TEST_WORKERS="0")
    assert "-n" not in single.split(), single
