"""The local launcher against real torchrun processes, with a stand-in rank program.

The stand-in (written to tmp) follows the rank contract — result.json on success,
error-rank-N.json on failure, exit on SIGTERM — without importing torch, so each test costs
one torchrun start-up (a few seconds on a small machine, far more on a loaded 2-core CI box:
every wait below allows ``SLOW_BOX_S`` and only takes that long when something is wrong).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from service.core.config import Settings
from service.core.spec.model import JobSpec
from worker.attempt import FailureReason
from worker.launchers.base import LaunchPlan, RunPhase, RunStatus
from worker.launchers.local.launcher import LocalLauncher, LocalRequest

REPO = Path(__file__).resolve().parents[2]  # the fake rank imports worker.attempt from here
SLOW_BOX_S = 180.0  # seconds any wait may take on a loaded machine before the test fails
FAKE_RANK = textwrap.dedent(
    """
    import json, os, signal, sys, time
    rank = int(os.environ["RANK"])
    d = os.path.join(os.environ["DDPQ_ARTIFACT_DIR"], "jobs", os.environ["DDPQ_JOB_ID"],
                     "attempt-" + os.environ["DDPQ_ATTEMPT"])
    os.makedirs(d, exist_ok=True)
    mode = os.environ.get("FAKE_MODE", "ok")

    def write(name, data):
        with open(os.path.join(d, name + ".tmp"), "w") as f:
            json.dump(data, f)
        os.rename(os.path.join(d, name + ".tmp"), os.path.join(d, name))

    def error(exc_type, message, t):
        write(f"error-rank-{rank}.json", {"rank": rank, "exc_type": exc_type, "message": message,
              "traceback": "Traceback (most recent call last):\\n  File x\\n" + exc_type + ": "
              + message, "time": t})

    def on_term(signum, frame):
        if mode == "fail":
            error("RuntimeError", "peer closed the connection", time.time())
        if mode == "silent_exit":  # its collective failed as the peer went away
            error("RuntimeError", PEER_LOST, time.time())
        sys.exit(143)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore_term" else on_term)
    write(f"port-rank-{rank}.json", {"master_port": os.environ["MASTER_PORT"]})
    if mode == "ok":
        time.sleep(float(os.environ.get("FAKE_SLEEP_S", "0")))
        if rank == 0:
            write("result.json", {"status": "succeeded"})
        sys.exit(0)
    if mode == "abort_after_result":
        if rank == 0:
            write("result.json", {"status": "succeeded"})
        else:  # after rank 0's result, as in a real job (its abort would stop rank 0 first)
            deadline = time.time() + 60
            while not os.path.exists(os.path.join(d, "result.json")) and time.time() < deadline:
                time.sleep(0.05)
        os.abort()
    if mode == "reason":  # the real writer, with the reason FAKE_REASON names
        from pathlib import Path
        from worker.attempt import write_rank_error
        exc = RuntimeError("loss is nan at step 3")
        exc.reason = os.environ["FAKE_REASON"]
        write_rank_error(Path(os.environ["DDPQ_ARTIFACT_DIR"]), int(os.environ["DDPQ_JOB_ID"]),
                         int(os.environ["DDPQ_ATTEMPT"]), rank, exc, time.time())
        sys.exit(1)
    if mode == "fail" and rank == 1:
        time.sleep(0.5)
        error("RuntimeError", "boom at step 5", time.time())
        sys.exit(1)
    PEER_LOST = "[pair.cc:534] Connection closed by peer [127.0.0.1]:4242"
    if mode == "silent_exit":  # rank 1 dies without a word; rank 0's collective then fails
        if rank == 1:
            time.sleep(0.5)
            sys.exit(3)
        time.sleep(30)
    if mode == "exit3":
        with open(os.path.join(d, f"rank-{rank}.log"), "w") as f:
            print("something went wrong in rank", rank, file=f)
        sys.exit(3)
    for _ in range(1200):
        time.sleep(0.1)
    """
)


def _tagged(artifact_dir: Path) -> list[int]:
    """Pids of processes started for this test's artifact dir (by their environment)."""
    needle = f"DDPQ_ARTIFACT_DIR={artifact_dir}".encode()
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _wait_end(launcher: LocalLauncher, handle: str, timeout_s: float = SLOW_BOX_S) -> RunStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = launcher.poll(handle)
        if status.phase != RunPhase.RUNNING:
            return status
        time.sleep(0.2)
    raise AssertionError(f"attempt {handle} still running after {timeout_s} s")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, artifact_dir=tmp_path / "artifacts")


@pytest.fixture
def fake_rank(tmp_path: Path) -> Path:
    path = tmp_path / "fake_rank.py"
    path.write_text(FAKE_RANK)
    return path


@pytest.fixture
def make_plan(
    settings: Settings, fake_rank: Path
) -> Callable[..., tuple[LocalLauncher, LaunchPlan]]:
    def _make(
        mode: str, *, nproc: int = 2, job_id: int = 1, grace_s: float = 10.0, **env: str
    ) -> tuple[LocalLauncher, LaunchPlan]:
        launcher = LocalLauncher(settings, grace_s=grace_s, entry=(str(fake_rank),))
        spec = JobSpec.model_validate(
            {"name": "t", "task": "regression", "resources": {"nproc_per_node": nproc}}
        )
        plan = launcher.plan(spec, job_id, 1)
        return launcher, replace(plan, env={**plan.env, "FAKE_MODE": mode, **env})

    return _make


@pytest.fixture(autouse=True)
def _no_leftovers(settings: Settings) -> object:
    yield None
    left = _tagged(settings.resolved_artifact_dir)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


def test_success_is_decided_by_result_file(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]], settings: Settings
) -> None:
    launcher, plan = make_plan("ok")
    handle = launcher.start(plan)
    assert handle.isdigit()
    status = _wait_end(launcher, handle)
    assert status == RunStatus(RunPhase.SUCCEEDED, None, 0)
    log_file = Path(plan.log_dir) / "launcher.log"
    assert log_file.exists(), "torchrun's output should be captured in launcher.log"
    assert launcher.poll(handle) == status, "poll must be stable once the attempt ended"


def test_abort_at_exit_after_result_still_succeeds(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]],
) -> None:
    launcher, plan = make_plan("abort_after_result")
    status = _wait_end(launcher, launcher.start(plan))
    assert status.phase == RunPhase.SUCCEEDED, status
    assert status.exit_code != 0, "the stand-in aborts; the exit code should show it"


def test_failure_names_the_earliest_failing_rank(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]],
) -> None:
    launcher, plan = make_plan("fail")
    status = _wait_end(launcher, launcher.start(plan))
    assert status.phase == RunPhase.FAILED
    assert status.reason is not None
    assert status.reason.startswith("rank 1 failed: RuntimeError: boom at step 5"), status.reason
    assert "Traceback" in status.reason
    # rank 0 wrote a later error when torchrun stopped it: it must not be the one named.
    assert (Path(plan.log_dir) / "error-rank-0.json").exists()


def test_a_silent_rank_is_named_not_the_peer_that_lost_it(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]],
) -> None:
    """Rank 1 exits (``sys.exit(3)`` in user code) without an error file; rank 0's next
    collective fails with gloo's "Connection closed by peer" and writes one. The job's error
    names rank 1, as torchrun's summary does, not rank 0's symptom."""
    launcher, plan = make_plan("silent_exit")
    status = _wait_end(launcher, launcher.start(plan))
    assert status.phase == RunPhase.FAILED
    assert (Path(plan.log_dir) / "error-rank-0.json").exists()
    assert status.reason is not None
    assert status.reason.startswith("rank 1 exit code 3 without an error report"), status.reason


@pytest.mark.parametrize("reason", [FailureReason.NONFINITE_LOSS, FailureReason.SETUP])
def test_the_error_files_reason_becomes_the_status_failure(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]], reason: FailureReason
) -> None:
    launcher, plan = make_plan("reason", nproc=1, FAKE_REASON=str(reason), PYTHONPATH=str(REPO))
    status = _wait_end(launcher, launcher.start(plan))
    assert status.phase == RunPhase.FAILED and status.failure == reason, status
    assert (status.reason or "").startswith(f"{reason}: "), status.reason


def test_failure_without_error_file_reports_exit_code_and_log_tail(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]],
) -> None:
    launcher, plan = make_plan("exit3", nproc=1)
    status = _wait_end(launcher, launcher.start(plan))
    assert status.phase == RunPhase.FAILED
    assert status.reason is not None
    assert status.reason.startswith("rank 0 exit code 3 without an error report"), status.reason
    assert "something went wrong in rank 0" in status.reason, status.reason


def test_cancel_stops_every_process_and_is_idempotent(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]], settings: Settings
) -> None:
    launcher, plan = make_plan("sleep", grace_s=SLOW_BOX_S)
    handle = launcher.start(plan)
    log_dir = Path(plan.log_dir)
    _wait_for(
        lambda: len(list(log_dir.glob("port-rank-*.json"))) == 2, SLOW_BOX_S, "both ranks to start"
    )
    assert launcher.poll(handle).phase == RunPhase.RUNNING
    t0 = time.monotonic()
    launcher.cancel(handle)
    assert time.monotonic() - t0 < SLOW_BOX_S, "ranks that obey SIGTERM stop without SIGKILL"
    assert launcher.poll(handle).phase == RunPhase.CANCELLED
    assert _tagged(settings.resolved_artifact_dir) == []
    with pytest.raises(ProcessLookupError):
        os.killpg(int(handle), 0)
    launcher.cancel(handle)  # idempotent
    assert launcher.poll(handle).phase == RunPhase.CANCELLED


def test_cancel_escalates_to_sigkill_after_grace(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]], settings: Settings
) -> None:
    launcher, plan = make_plan("ignore_term", grace_s=1.0)
    handle = launcher.start(plan)
    log_dir = Path(plan.log_dir)
    _wait_for(
        lambda: len(list(log_dir.glob("port-rank-*.json"))) == 2, SLOW_BOX_S, "both ranks to start"
    )
    launcher.cancel(handle)
    assert launcher.poll(handle).phase == RunPhase.CANCELLED
    assert _tagged(settings.resolved_artifact_dir) == []


def test_two_attempts_on_one_host_get_distinct_ports(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]],
) -> None:
    launcher, plan1 = make_plan("ok", job_id=1, FAKE_SLEEP_S="2")
    _, plan2 = make_plan("ok", job_id=2, FAKE_SLEEP_S="2")
    h1, h2 = launcher.start(plan1), launcher.start(plan2)
    assert _wait_end(launcher, h1).phase == RunPhase.SUCCEEDED
    assert _wait_end(launcher, h2).phase == RunPhase.SUCCEEDED
    ports = [
        {(Path(p.log_dir) / f"port-rank-{r}.json").read_text() for r in (0, 1)}
        for p in (plan1, plan2)
    ]
    assert len(ports[0]) == 1 and len(ports[1]) == 1, "ranks of one attempt share a port"
    assert ports[0] != ports[1], f"both attempts used master port {ports[0]}"


def test_timeout_fails_the_attempt(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]], settings: Settings
) -> None:
    launcher, plan = make_plan("sleep", nproc=1)
    handle = launcher.start(replace(plan, request=LocalRequest(timeout_s=1.0)))
    status = _wait_end(launcher, handle)
    assert status.phase == RunPhase.FAILED
    assert status.reason is not None and "timed out" in status.reason


def test_ranks_die_with_the_worker(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]],
    settings: Settings,
    fake_rank: Path,
    tmp_path: Path,
) -> None:
    """PR_SET_PDEATHSIG: a SIGKILLed worker's torchrun gets SIGTERM and stops its ranks."""
    artifact_dir = settings.resolved_artifact_dir
    script = tmp_path / "worker_stand_in.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from dataclasses import replace
            from service.core.config import Settings
            from service.core.spec.model import JobSpec
            from worker.launchers.local.launcher import LocalLauncher
            s = Settings(home={str(tmp_path)!r}, artifact_dir={str(artifact_dir)!r})
            launcher = LocalLauncher(s, entry=({str(fake_rank)!r},))
            spec = JobSpec.model_validate(
                {{"name": "t", "task": "regression", "resources": {{"nproc_per_node": 2}}}})
            plan = launcher.plan(spec, 5, 1)
            launcher.start(replace(plan, env={{**plan.env, "FAKE_MODE": "sleep"}}))
            print("started", flush=True)
            time.sleep(600)
            """
        )
    )
    worker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == b"started"
        log_dir = settings.resolved_artifact_dir / "jobs/5/attempt-1"
        _wait_for(
            lambda: len(list(log_dir.glob("port-rank-*.json"))) == 2, SLOW_BOX_S, "ranks to start"
        )
        worker.kill()
        worker.wait()
        _wait_for(
            lambda: not _tagged(settings.resolved_artifact_dir),
            SLOW_BOX_S,
            "ranks to die with the worker",
        )
    finally:
        worker.kill()
        worker.wait()


def test_stale_attempt_dir_is_moved_aside(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]],
) -> None:
    """A job id reused (database recreated, artifacts kept): the old attempt's result.json
    must not make the new attempt succeed."""
    launcher, plan = make_plan("exit3", nproc=1)
    old = Path(plan.log_dir)
    old.mkdir(parents=True)
    (old / "result.json").write_text('{"status": "succeeded"}')
    (old / "launcher.log").write_text("old life\n")
    status = _wait_end(launcher, launcher.start(plan))
    assert status.phase == RunPhase.FAILED, f"a stale result.json decided the outcome: {status}"
    stale = list(old.parent.glob(f"{old.name}.stale-*"))
    assert len(stale) == 1, f"expected the old dir moved aside, found {stale}"
    assert (stale[0] / "result.json").exists() and (stale[0] / "launcher.log").exists()
    assert not (old / "result.json").exists()
    assert "old life" not in (old / "launcher.log").read_text(), "logs of two lives were mixed"


def test_result_older_than_the_attempt_is_not_trusted(
    make_plan: Callable[..., tuple[LocalLauncher, LaunchPlan]],
) -> None:
    launcher, plan = make_plan("sleep", nproc=1)
    handle = launcher.start(plan)
    log_dir = Path(plan.log_dir)
    _wait_for(lambda: (log_dir / "port-rank-0.json").exists(), SLOW_BOX_S, "the rank to start")
    result = log_dir / "result.json"
    result.write_text('{"status": "succeeded"}')
    an_hour_ago = time.time() - 3600
    os.utime(result, (an_hour_ago, an_hour_ago))
    assert launcher.poll(handle).phase == RunPhase.RUNNING
    launcher.cancel(handle)
    status = launcher.poll(handle)
    assert status.phase == RunPhase.CANCELLED, f"an old result.json decided the outcome: {status}"
