"""Your own script, unchanged, through ``ddpq run``: a tutorial-style DDP script (plain torch,
no ddpq import, gloo on CPU) shipped from a git repository over HTTP and run by a real worker
with real torchrun ranks; a failing script, a cancelled one, and an unchanged re-run that
uploads nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.jobs_http import EXIT_ABORT_RESTART

REPO = Path(__file__).resolve().parents[2]
TUTORIAL = REPO / "examples" / "tutorial" / "train.py"
# The console script, as a user runs it: ``python -c`` would put the working directory
# first on sys.path, where a project's own ``service`` package would stand in for ddpq's.
CLI = [str(Path(sys.executable).parent / "ddpq")]


def git_repo(root: Path) -> Path:
    """A git work tree holding the tutorial script, a ``.gitignore`` and a file it ignores."""
    root.mkdir()
    shutil.copy(TUTORIAL, root / "train.py")
    (root / ".gitignore").write_text("data/\n*.secret\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"\0" * 4096)
    (root / "token.secret").write_text("not for the job")
    for argv in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", *argv], cwd=root, check=True, capture_output=True)
    return root


def ddpq(
    dep: Any, cwd: Path, *args: str, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    """The CLI, as a user runs it in ``cwd``, against the deployment's API."""
    env = {**os.environ, "DDPQ_API_URL": dep.url, "DDPQ_HOME": str(dep.tmp_path / "cli-home")}
    return subprocess.run(
        [*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )


def rank_logs(dep: Any, job_id: int, attempt: int = 1) -> dict[int, str]:
    folder = dep.artifact_dir / "jobs" / str(job_id) / f"attempt-{attempt}"
    return {
        int(p.stem.split("-")[1]): p.read_text(errors="replace") for p in folder.glob("rank-*.log")
    }


def job_id_of(output: str) -> int:
    for line in output.splitlines():
        if line.startswith("job "):
            return int(line.split()[1])
    raise AssertionError(f"no 'job N' line in:\n{output}")


@pytest.mark.slow
def test_the_tutorial_script_runs_unchanged_through_ddpq_run(
    deployment: Any, tmp_path: Path
) -> None:
    dep = deployment
    dep.start_worker()
    work = git_repo(tmp_path / "project")
    run = ddpq(dep, work, "run", "-n", "2", "--set", EXIT_ABORT_RESTART, "--wait", "--",
               "train.py", "--epochs", "4")  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr + dep.diagnostics(0)
    job_id = job_id_of(run.stdout)
    job = dep.assert_restarted_only_on_exit_aborts(job_id)
    assert job["state"] == "succeeded", dep.diagnostics(job_id)
    assert job["spec"]["command"] == ["train.py", "--epochs", "4"]
    assert job["spec"]["resources"]["nproc_per_node"] == 2
    logs = rank_logs(dep, job_id, job["attempt"])
    assert sorted(logs) == [0, 1]
    for epoch in range(4):
        assert f"epoch {epoch} loss " in logs[0], logs[0][-3000:]
    for text in logs.values():
        assert "HTTP Request" not in text, "ddpq logs no line per HTTP request"
    cwd = dep.artifact_dir / "jobs" / str(job_id) / f"attempt-{job['attempt']}" / "workspace"
    assert (cwd / "snapshot.pt").stat().st_size > 0, "the script writes next to itself"
    shipped = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*") if p.is_file())
    assert shipped == [".gitignore", "snapshot.pt", "train.py"], shipped

    again = ddpq(dep, work, "run", "-n", "2", "--set", EXIT_ABORT_RESTART, "--",
                 "train.py", "--epochs", "1")  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert "uploaded nothing" in again.stdout + again.stderr, "an unchanged tree uploads 0 bytes"
    (work / "train.py").write_text((work / "train.py").read_text() + "\n# edited\n")
    edited = ddpq(dep, work, "run", "-n", "2", "--set", EXIT_ABORT_RESTART, "--",
                  "train.py", "--epochs", "1")  # fmt: skip
    assert "uploaded 1 file " in edited.stdout + edited.stderr, edited.stdout + edited.stderr
    for other in (job_id_of(again.stdout), job_id_of(edited.stdout)):
        dep.wait_state(other, ("succeeded",), 300)
        dep.assert_restarted_only_on_exit_aborts(other)


def test_a_script_that_raises_names_the_rank_and_the_exception(
    deployment: Any, tmp_path: Path
) -> None:
    dep = deployment
    dep.start_worker()
    work = tmp_path / "plain"  # no git: everything but the always-excluded is shipped
    work.mkdir()
    (work / "boom.py").write_text(
        textwrap.dedent(
            """
            import os
            import torch.distributed as dist

            dist.init_process_group("gloo")
            if os.environ["RANK"] == "1":
                raise ValueError("bad batch shape on rank 1")
            dist.barrier()
            """
        )
    )
    run = ddpq(dep, work, "run", "-n", "2", "--wait", "--", "python", "boom.py")
    assert run.returncode == 1, run.stdout + run.stderr
    job = dep.job(job_id_of(run.stdout))
    assert job["state"] == "failed"
    error = job["error"]
    assert error.startswith("rank 1 failed: ValueError: bad batch shape on rank 1"), error
    assert 'boom.py", line' in error, f"no traceback tail naming the script: {error}"


def test_a_cancelled_command_job_stops_its_ranks(deployment: Any, tmp_path: Path) -> None:
    """The script saves on SIGTERM and exits 0, as torchrun scripts often do: the signal
    reaches it at once, and the job still ends cancelled (it did not finish its work)."""
    dep = deployment
    dep.start_worker()
    work = tmp_path / "sleepy"
    work.mkdir()
    (work / "sleep.py").write_text(
        textwrap.dedent(
            """
            import signal, sys, time

            def save_and_leave(signum, frame):
                print("saving snapshot", flush=True)
                sys.exit(0)

            signal.signal(signal.SIGTERM, save_and_leave)
            print("started", flush=True)
            while True:
                time.sleep(0.1)
            """
        )
    )
    run = ddpq(dep, work, "run", "-n", "2", "--", "sleep.py")
    assert run.returncode == 0, run.stdout + run.stderr
    job_id = job_id_of(run.stdout)
    dep.wait_state(job_id, ("running",), 120)
    dep.wait_for(lambda: "started" in rank_logs(dep, job_id).get(1, ""), 120, "the script")
    r = dep.http.post(f"/jobs/{job_id}/cancel")
    assert r.status_code == 202, r.text
    t0 = time.monotonic()
    dep.wait_state(job_id, ("cancelled",), 60)
    assert dep.processes(job_id) == [], "no rank outlives the cancel"
    assert time.monotonic() - t0 < 60
    for rank, text in rank_logs(dep, job_id).items():
        assert "saving snapshot" in text, f"rank {rank} never got the SIGTERM:\n{text[-2000:]}"


def test_a_project_may_have_its_own_worker_and_service_packages(
    deployment: Any, tmp_path: Path
) -> None:
    """ddpq's own packages (``worker``, ``service``) must not stand in for the project's: the
    script runs in a process of its own, as under torchrun. It also finds its checkpoint
    directory ready and logs with its own logging set-up."""
    dep = deployment
    dep.start_worker()
    work = tmp_path / "mine"
    (work / "worker").mkdir(parents=True)
    (work / "worker" / "__init__.py").write_text("def helper():\n    return 'project worker'\n")
    (work / "service.py").write_text("NAME = 'project service'\n")
    (work / "main.py").write_text(
        textwrap.dedent(
            """
            import logging, os, sys
            import torch.distributed as dist
            from service import NAME
            from worker import helper

            logging.basicConfig(level=logging.INFO, format="mine: %(message)s")
            dist.init_process_group("gloo")
            logging.info("%s / %s / argv0=%s", helper(), NAME, sys.argv[0])
            assert os.path.isdir(os.environ["DDPQ_CHECKPOINT_DIR"])
            dist.destroy_process_group()
            """
        )
    )
    run = ddpq(dep, work, "run", "-n", "2", "--wait", "--", "main.py")
    assert run.returncode == 0, run.stdout + run.stderr + dep.diagnostics(job_id_of(run.stdout))
    logs = rank_logs(dep, job_id_of(run.stdout))
    assert "mine: project worker / project service / argv0=main.py" in logs[0], logs[0][-2000:]


def test_a_spec_file_and_a_sweep_file_ship_their_directory(deployment: Any, tmp_path: Path) -> None:
    """``ddpq submit`` and ``ddpq sweep submit`` of a command job without a digest pack the
    spec file's directory (or ``workspace: <dir>``), upload it and submit its digest."""
    dep = deployment
    dep.start_worker(slots=2)
    work = tmp_path / "proj"
    (work / "src").mkdir(parents=True)
    (work / "src" / "show.py").write_text(
        "import os, sys\nprint('LR', os.environ.get('LR'), 'args', sys.argv[1:], flush=True)\n"
    )
    (work / "job.yaml").write_text("name: one\ncommand: [src/show.py, --x, '1']\n")
    (tmp_path / "sweep.yaml").write_text(
        textwrap.dedent(
            """
            name: lr
            base: {name: t, command: [src/show.py], workspace: proj}
            axes: {env.LR: {grid: ["0.1", "0.01"]}}
            max_concurrent: 2
            """
        )
    )
    dry = ddpq(dep, work, "submit", "job.yaml", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "each rank runs: python src/show.py --x 1" in dry.stdout, dry.stdout
    run = ddpq(dep, work, "submit", "job.yaml", "--wait")
    assert run.returncode == 0, run.stdout + run.stderr
    job_id = job_id_of(run.stdout)
    assert "args ['--x', '1']" in rank_logs(dep, job_id)[0]
    swept = ddpq(dep, tmp_path, "sweep", "submit", "sweep.yaml", "--wait")
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert "uploaded nothing" in swept.stdout, "the same tree: every file is there already"
    seen = {
        line.split()[1]
        for other in range(job_id + 1, job_id + 3)
        for line in rank_logs(dep, other)[0].splitlines()
        if line.startswith("LR ")
    }
    assert seen == {"0.1", "0.01"}, seen
