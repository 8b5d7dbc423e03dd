"""Benchmark: an honest job's steps/s beside a hostile one vs alone, and the API's poll p99.

Owner A's training script (``bench/hostile_jobs/honest.py``, CPU-bound, one rank) runs
twice on one local worker with 2 slots: alone, then with B's hostile script
(``bench/hostile_jobs/hostile.py``) running beside it: B fills its checkpoint quota, writes
``log`` bytes to stdout/stderr, reports ``names`` distinct metric names and opens files until
EMFILE. A's steps/s is counted from its loss points' times: alone over its whole run, beside
B over the seconds B's script was at work. Meanwhile a client polls ``GET /jobs`` every
``POLL_EVERY_S``; its p99 in each phase is set against the API's poll goal
(``bench.api.GOAL_POLL_P99_S``).

The embedded deployment (auth off, so one owner): B's checkpoint quota is its job's
(``DDPQ_CHECKPOINT_JOB_MAX_BYTES``), the owner's is left wide so A keeps checkpointing. B's
reads of A's files and its fork bomb need a Unix user per owner (``DDPQ_RANK_USERS``, a
root-run worker) and are left out here: ``tests/e2e/test_hostile_owner.py`` proves them; what
they cost is a few hundred syscalls.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.api import GOAL_POLL_P99_S
from bench.common import (
    BenchResult,
    cli_main,
    cpu_delta,
    cpu_s,
    free_port,
    migrated,
    percentile,
    pick,
    ratio,
    sqlite_url,
    worker_process_env,
)
from service.client import DdpqClient
from service.core import artifacts
from service.core.config import Settings
from worker.up import settings_env

JOBS = Path(__file__).resolve().parent / "hostile_jobs"
GOAL_RATIO = 0.9
POLL_EVERY_S = 0.05
MiB = 1 << 20
TERMINAL = ("succeeded", "failed", "cancelled")


class Poller:
    """``GET /jobs?limit=20`` every ``POLL_EVERY_S`` in a thread; latencies (seconds)."""

    def __init__(self, http: httpx.Client) -> None:
        self.http, self.errors = http, 0
        self.latencies_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_EVERY_S):
            t0 = time.perf_counter()
            try:
                ok = self.http.get("/jobs", params={"limit": 20}).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.latencies_s.append(time.perf_counter() - t0)
            self.errors += 0 if ok else 1

    def stop(self) -> list[float]:
        """Stop polling; every poll's latency (seconds)."""
        self._stop.set()
        self._thread.join()
        return self.latencies_s


class Deployment:
    """An API server and a 2-slot local worker (subprocesses, SQLite) with small quotas."""

    def __init__(self, tmp: Path, log_cap_bytes: int) -> None:
        self.tmp = tmp
        self.settings = Settings(
            home=tmp / ".ddpq", database_url=sqlite_url(tmp), artifact_dir=tmp / "artifacts",
            port=free_port(), user_code="allow", rank_log_max_bytes=log_cap_bytes,
            rank_nofile_max=1024, checkpoint_job_max_bytes=8 * MiB,
            checkpoint_owner_max_bytes=1 << 30, metric_names_per_job=100,
        )  # fmt: skip
        migrated(self.settings.resolved_database_url).dispose()
        env = {**os.environ, **settings_env(self.settings), "OMP_NUM_THREADS": "1"}
        self.url = f"http://127.0.0.1:{self.settings.port}"
        self.logs = [open(tmp / n, "ab") for n in ("api.log", "worker.log")]  # noqa: SIM115
        argvs = [
            [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app",
             "--host", "127.0.0.1", "--port", str(self.settings.port), "--no-access-log"],
            [sys.executable, "-m", "worker.main", "--slots", "2", "--gpus", "none"],
        ]  # fmt: skip
        envs = [env, worker_process_env(self.settings, env)]
        self.procs = [subprocess.Popen(a, env=e, stdout=log, stderr=subprocess.STDOUT)
                      for a, e, log in zip(argvs, envs, self.logs, strict=True)]  # fmt: skip
        self.http = httpx.Client(base_url=self.url + "/api/v1", timeout=30)
        self.client = DdpqClient(self.url, "", timeout_s=30)
        _wait(self._ready, 90, "the API to answer /readyz")

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def run(self, script: str, args: list[str]) -> int:
        """Ship ``bench/hostile_jobs/<script>`` alone and submit it as a one-rank job."""
        work = self.tmp / f"ws-{script}"
        if not work.exists():
            work.mkdir()
            shutil.copy(JOBS / script, work / script)
        job = self.client.run([script, *args], workdir=work, nproc_per_node=1,
                              env={"OMP_NUM_THREADS": "1"},
                              overrides={"training.keep_checkpoints": 100})  # fmt: skip
        return int(job["id"])

    def wait_end(self, job_id: int, timeout_s: float = 600) -> dict[str, Any]:
        def ended() -> dict[str, Any] | None:
            job: dict[str, Any] = self.http.get(f"/jobs/{job_id}").json()
            return job if job["state"] in TERMINAL else None

        job: dict[str, Any] = _wait(ended, timeout_s, f"job {job_id} to end")
        return job

    def cpu_s(self) -> dict[str, dict[int, float]]:
        """CPU seconds so far of the API process and of the worker process (its log
        threads read every rank's output)."""
        names = ("api", "worker")
        return {name: cpu_s([proc.pid]) for name, proc in zip(names, self.procs, strict=True)}

    def loss_times(self, job_id: int) -> list[float]:
        """Epoch seconds of each of the job's loss points, by step (every page of them)."""
        points: list[dict[str, Any]] = []
        after: int | None = 0
        while after is not None:
            r = self.http.get(
                f"/jobs/{job_id}/metrics",
                params={"name": "loss", "after_step": after, "limit": 10_000},
            )
            page = r.json()
            points.extend(page["points"])
            after = page.get("next_after_step") if page["points"] else None
        points.sort(key=lambda p: p["step"])
        return [datetime.fromisoformat(p["time"]).timestamp() for p in points]

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        self.http.close()
        self.client.close()


def _wait(cond: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


def steps_per_s(times: list[float], start: float, end: float) -> float | None:
    """Steps whose point falls within ``[start, end]`` (epoch seconds) per second between the
    first and the last of them; None when fewer than 2 do."""
    inside = [t for t in times if start <= t <= end]
    if len(inside) < 2 or inside[-1] == inside[0]:
        return None
    return (len(inside) - 1) / (inside[-1] - inside[0])


def run(size: str, *, workdir: Path | None = None) -> BenchResult:
    """A alone, then A beside B (same deployment, one after the other)."""
    a_steps = pick(size, 150, 3000)
    b_args = {"log": pick(size, 16 * MiB, 1 << 30), "names": pick(size, 5_000, 1_000_000),
              "checkpoints": pick(size, 4, 12)}  # fmt: skip
    log_cap = 8 * MiB
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-"))
    dep = Deployment(tmp, log_cap)
    honest = ["--steps", str(a_steps), "--every", str(max(1, a_steps // 10))]
    try:
        poll, cpu0, t0 = Poller(dep.http), dep.cpu_s(), time.monotonic()
        alone_id = dep.run("honest.py", honest)
        alone_job = dep.wait_end(alone_id)
        alone_poll = poll.stop()
        cpu = {"alone": _spent(cpu0, dep.cpu_s(), time.monotonic() - t0)}
        alone_times = dep.loss_times(alone_id)
        alone_rate = steps_per_s(alone_times, alone_times[0], alone_times[-1])

        # Beside B, A goes on until B's job ended (the release file in its workspace).
        beside_id = dep.run("honest.py", [*honest, "--until", "release"])
        _wait(lambda: dep.loss_times(beside_id), 120, "A's first point")
        poll, cpu0, t0 = Poller(dep.http), dep.cpu_s(), time.monotonic()
        b_id = dep.run("hostile.py", [
            "--victim-job", str(beside_id), "--skip", "read,forks", "--checkpoints",
            str(b_args["checkpoints"]), "--checkpoint-bytes", str(3 * MiB),
            "--log-bytes", str(b_args["log"]),
            "--names", str(b_args["names"])])  # fmt: skip
        b_job = dep.wait_end(b_id)
        beside_poll = poll.stop()
        cpu["beside_hostile"] = _spent(cpu0, dep.cpu_s(), time.monotonic() - t0)
        a_dir = artifacts.workspace_dir(dep.settings.resolved_artifact_dir, beside_id, 1)
        (a_dir / "release").touch()
        beside_job = dep.wait_end(beside_id)
        b_dir = artifacts.attempt_dir(dep.settings.resolved_artifact_dir, b_id, 1)
        found = json.loads((b_dir / "hostile-result.json").read_text())
        beside_times = dep.loss_times(beside_id)
        beside_rate = steps_per_s(beside_times, found["started_at"], found["ended_at"])
        overlap = sum(found["started_at"] <= t <= found["ended_at"] for t in beside_times)
        events = dep.http.get(f"/jobs/{b_id}/events").json()["events"]
        hits = sorted({e["data"]["setting"] for e in events if e["kind"] == "quota_exceeded"})
    finally:
        dep.close()
    res = BenchResult("hostile", size)
    p99 = {"alone": percentile(alone_poll, 99), "beside_hostile": percentile(beside_poll, 99)}
    res.figures = {
        "a_steps": a_steps,
        "b_args": b_args,
        "a_steps_per_s": {"alone": _round(alone_rate), "beside_hostile": _round(beside_rate)},
        "a_steps_during_b": overlap,
        "b_phase_s": {k: round(v, 2) for k, v in found.items() if k.endswith("_s")},
        "b_files": found.get("files"),
        "b_state": b_job["state"],
        "b_error": (b_job["error"] or "")[:200],
        "cpu_s_while": cpu,
        "a_states": [alone_job["state"], beside_job["state"]],
        "b_quota_events": hits,
        "get_jobs_p99_ms": {k: round(v * 1000, 2) for k, v in p99.items()},
        "polls": {"alone": len(alone_poll), "beside_hostile": len(beside_poll)},
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    res.ratios = {
        "a_beside_hostile_vs_alone": ratio(beside_rate, alone_rate),
        "poll_p99_beside_vs_alone": ratio(p99["beside_hostile"], p99["alone"]),
    }
    rate_ratio = res.ratios["a_beside_hostile_vs_alone"]
    res.goals = {
        "a_steps_ratio>=0.9": None if rate_ratio is None else rate_ratio >= GOAL_RATIO,
        "get_jobs_p99<=20ms_beside_hostile": p99["beside_hostile"] <= GOAL_POLL_P99_S,
    }
    res.notes.append(
        "one SQLite deployment, worker with 2 slots, one rank per job, OMP_NUM_THREADS=1; A "
        "CPU-bound (no pause); B skips reads and forks (see the module docstring)"
    )
    return res


def _spent(
    before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], wall_s: float
) -> dict[str, float]:
    """CPU seconds each process spent between two ``Deployment.cpu_s``, and the wall time."""
    spent = {name: round(cpu_delta(before[name], after[name]), 2) for name in before}
    return {**spent, "wall_s": round(wall_s, 2)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def main() -> None:
    """CLI: ``python -m bench.hostile --size tiny``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
