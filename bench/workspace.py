"""Benchmark #9: workspaces and command jobs (``ddpq run -- train.py``), each figure within one run.

- **upload**: pack + upload of a fresh tree (2,000 files / 50 MB of incompressible bytes of
  varied sizes at the default size; tiny: 200 files / 5 MB) from a temporary directory to a
  live ``ddpq serve`` on loopback (SQLite, filesystem store), as ``DdpqClient.upload_workspace``
  does it (``pack_workspace``, ask which files are missing, the small ones in batches of up
  to 16 MiB, each bigger one begin + chunks + commit, ``POST /workspaces``), ÷ ``tar c DIR |
  sha256sum`` of the same tree (a subprocess pipeline; the page cache warm for both: the tar
  anchor runs once untimed first). Goal ≤ 3×.
- **re-submit**: the same tree again, unchanged: pack + ask-missing + (nothing to send) +
  ``POST /workspaces``. Absolute seconds (median), ratio to the 0.5 s goal, and the file bytes
  it sent (must be 0).
- **first line**: submit → the first line a command job prints (right after
  ``init_process_group``, gloo, 2 ranks) appears in its rank-0 log, through ``DdpqClient.run``
  and a real worker (``python -m worker.main --gpus none``, registered before the timer) ÷
  ``torchrun --standalone --nproc-per-node 2`` of the same script, from its start to the
  line in its stdout. Interleaved repetitions, median ratio. Goal ≤ 1.0.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    BenchResult,
    cli_main,
    cpu_delta,
    cpu_s,
    median,
    migrated,
    pick,
    ratio,
    serve_api,
    serve_pids,
    sqlite_url,
    worker_process_env,
)

GOAL_UPLOAD_VS_TAR = 3.0
GOAL_RESUBMIT_S = 0.5
GOAL_FIRST_LINE_VS_BARE = 1.0
MARKER = "ddpq-bench-first-line"
TERMINAL = ("succeeded", "failed", "cancelled")
SCRIPT_NAME = "first_line.py"
# The user's script: one line right after the process group is up, then a barrier and out.
SCRIPT = textwrap.dedent(
    f"""
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    print("{MARKER}", repr(time.time()), "rank", dist.get_rank(), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
).lstrip()


# -- the tree ---------------------------------------------------------------------------------


def make_tree(root: Path, files: int, total_bytes: int, seed: int) -> None:
    """``files`` files of ``os.urandom`` bytes, ``total_bytes`` in all, under ``root``: sizes
    log-normal (a few large, many small; at least 1 byte each), in two levels of folders
    (about 50 files a folder)."""
    rng = random.Random(seed)
    weights = [rng.lognormvariate(0.0, 1.5) for _ in range(files)]
    scale = (total_bytes - files) / sum(weights)
    sizes = [1 + int(w * scale) for w in weights]
    sizes[max(range(files), key=sizes.__getitem__)] += total_bytes - sum(sizes)
    folders = max(1, files // 50)
    for i, size in enumerate(sizes):
        folder = i % folders
        path = root / f"d{folder // 10:02d}" / f"e{folder % 10}" / f"f{i:05d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))


def tar_sha256_s(root: Path) -> float:
    """Seconds for ``tar c -C ROOT . | sha256sum`` (a subprocess pipeline, output dropped).

    Raises:
        RuntimeError: tar or sha256sum failed.
    """
    t0 = time.perf_counter()
    tar = subprocess.Popen(["tar", "c", "-C", str(root), "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None
    sha = subprocess.run(["sha256sum"], stdin=tar.stdout, capture_output=True, check=False)
    tar.stdout.close()
    tar_rc = tar.wait()
    elapsed = time.perf_counter() - t0
    if tar_rc != 0 or sha.returncode != 0:
        raise RuntimeError(f"tar exited {tar_rc}, sha256sum {sha.returncode}: {sha.stderr!r}")
    return elapsed


class Counter:
    """HTTP requests and their body bytes, counted by an httpx request hook."""

    def __init__(self) -> None:
        self.requests = 0
        self.body_bytes = 0

    def __call__(self, request: httpx.Request) -> None:
        self.requests += 1
        self.body_bytes += int(request.headers.get("content-length", 0))

    def take(self) -> tuple[int, int]:
        """(requests, body bytes) since the last ``take``."""
        got = (self.requests, self.body_bytes)
        self.requests = self.body_bytes = 0
        return got


def upload_once(client: Any, counter: Counter, tree: Path, port: int) -> dict[str, Any]:
    """Pack and upload ``tree`` once (``upload_workspace`` in two timed halves): seconds,
    what was sent, HTTP requests, and client/server CPU seconds."""
    from service.core.config import Settings
    from service.workspaces.pack import pack_workspace

    settings = Settings()
    pids = serve_pids(port)
    server_before, client_before = cpu_s(pids), time.process_time()
    counter.take()
    t0 = time.perf_counter()
    packed = pack_workspace(
        tree, max_bytes=settings.workspace_max_bytes, max_files=settings.workspace_max_files
    )
    t1 = time.perf_counter()
    sent = client.upload_workspace(packed)
    t2 = time.perf_counter()
    requests, body_bytes = counter.take()
    return {
        "total_s": t2 - t0,
        "pack_s": t1 - t0,
        "upload_s": t2 - t1,
        "files": sent.file_count,
        "bytes": sent.total_bytes,
        "sent_files": sent.sent_files,
        "sent_bytes": sent.sent_bytes,
        "http_requests": requests,
        "http_body_bytes": body_bytes,
        "client_cpu_s": time.process_time() - client_before,
        "server_cpu_s": cpu_delta(server_before, cpu_s(pids)),
    }


# -- first line of a command job --------------------------------------------------------------


def torchrun_argv(script: Path) -> list[str]:
    """``torchrun --standalone --nproc-per-node 2 SCRIPT`` (the venv's torchrun)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    head = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*head, "--standalone", "--nproc-per-node", "2", str(script)]


def bare_first_line_s(script: Path, env: dict[str, str], timeout_s: float = 120) -> float:
    """Seconds from starting bare torchrun to the marker line in its stdout; waits for it to
    end (untimed). A failure after the line (torch's gloo may abort at exit) is ignored.

    Raises:
        RuntimeError: torchrun ended without printing the line, or took over ``timeout_s``.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        torchrun_argv(script), cwd=script.parent, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    killer = threading.Timer(timeout_s, proc.kill)
    killer.start()
    seen: float | None = None
    tail: list[str] = []
    for line in proc.stdout:  # until torchrun ends (or the timer kills it)
        if seen is None and MARKER in line:
            seen = time.perf_counter() - t0
        tail = [*tail[-40:], line]
    proc.wait()
    killer.cancel()
    if seen is None:
        raise RuntimeError(f"bare torchrun exited {proc.returncode} with no line:\n{''.join(tail)}")
    return seen


class Deployment:
    """The API of phases 1–2 (``serve_api``) and one worker subprocess on the same settings."""

    def __init__(self, tmp: Path, url: str, db_url: str) -> None:
        from service.core.config import Settings
        from worker.up import settings_env

        self.url = url
        self.settings = Settings(
            home=tmp / ".ddpq", database_url=db_url, artifact_dir=tmp / "artifacts",
            api_url=url, auth="off",
        )  # fmt: skip
        self.artifact_dir = self.settings.resolved_artifact_dir
        self.env = {**os.environ, **settings_env(self.settings), "OMP_NUM_THREADS": "1"}
        self.http = httpx.Client(base_url=url + "/api/v1", timeout=30)
        self.log = open(tmp / "worker.log", "ab")  # noqa: SIM115
        argv = [sys.executable, "-m", "worker.main", "--slots", "1", "--gpus", "none"]
        env = worker_process_env(self.settings, self.env)  # a worker holds no database URL
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self._registered, 120, 0.1, "the worker to register")

    def _registered(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the worker exited {self.proc.returncode}; see worker.log")
        workers = self.http.get("/workers").json()["workers"]
        return any(w["stopped_at"] is None for w in workers)

    def first_line_s(self, client: Any, workdir: Path) -> float:
        """Seconds from ``client.run`` (pack, upload what is missing, submit) to the marker
        line in the job's rank-0 log (polled every 10 ms); waits for the job to end."""
        from service.core.artifacts import rank_log_path

        t0 = time.perf_counter()
        job = client.run([SCRIPT_NAME], workdir=workdir, nproc_per_node=2)
        job_id = int(job["id"])
        log = rank_log_path(self.artifact_dir, job_id, 1, 0)

        def seen() -> bool:
            try:
                return MARKER in log.read_text(errors="replace")
            except FileNotFoundError:
                return False

        wait_for(seen, 120, 0.01, f"job {job_id}'s first line")
        elapsed = time.perf_counter() - t0
        state = wait_for(
            lambda: (s := self.http.get(f"/jobs/{job_id}").json()["state"]) in TERMINAL and s,
            120, 0.2, f"job {job_id} to end",
        )  # fmt: skip
        if state != "succeeded":
            raise RuntimeError(f"job {job_id} ended {state}: see {log.parent}")
        return elapsed

    def close(self) -> None:
        """Stop the worker (SIGTERM, then SIGKILL after 30 s)."""
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.http.close()


def wait_for(cond: Any, timeout_s: float, every_s: float, what: str) -> Any:
    """``cond()``'s first true value, asked every ``every_s`` seconds.

    Raises:
        TimeoutError: none within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


# -- the run ----------------------------------------------------------------------------------


def run(size: str, *, workdir: Path | None = None) -> BenchResult:
    """The three figures (module docstring), each against its anchor of the same run."""
    from service.client import DdpqClient

    files, total_bytes = pick(size, (200, 5_000_000), (2_000, 50_000_000))
    upload_reps = pick(size, 1, 3)
    resubmit_reps = pick(size, 3, 5)
    line_reps = pick(size, 1, 3, 5)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-ws-"))
    db_url = sqlite_url(tmp)
    migrated(db_url).dispose()
    tar_s: list[float] = []
    uploads: list[dict[str, Any]] = []
    resubmits: list[dict[str, Any]] = []
    times: dict[str, list[float]] = {"bare": [], "ddpq": []}
    with serve_api(db_url, tmp) as url:
        port = int(url.rsplit(":", 1)[1])
        counter = Counter()
        client = DdpqClient(url, token="", timeout_s=60)
        client._http.event_hooks["request"].append(counter)
        tree = tmp / "tree-0"
        for rep in range(upload_reps):  # a fresh tree each time: nothing of it on the server
            if rep:
                shutil.rmtree(tree)
            tree = tmp / f"tree-{rep}"
            make_tree(tree, files, total_bytes, seed=rep)
            tar_sha256_s(tree)  # warms the page cache (and tar) for both
            tar_s.append(tar_sha256_s(tree))
            uploads.append(upload_once(client, counter, tree, port))
            if uploads[-1]["sent_bytes"] != total_bytes:
                raise RuntimeError(f"a fresh tree sent {uploads[-1]['sent_bytes']} bytes")
        for _ in range(resubmit_reps):  # the last tree again, unchanged
            resubmits.append(upload_once(client, counter, tree, port))
        shutil.rmtree(tree)

        script_dir = tmp / "project"
        script_dir.mkdir()
        script = script_dir / SCRIPT_NAME
        script.write_text(SCRIPT)
        dep = Deployment(tmp, url, db_url)
        try:
            bare_env = {**dep.env, "OMP_NUM_THREADS": "1"}
            if size != "tiny":  # warm-up of both: the worker's first job, torch's first import
                bare_first_line_s(script, bare_env)
                dep.first_line_s(client, script_dir)
            for _ in range(line_reps):
                times["bare"].append(bare_first_line_s(script, bare_env))
                times["ddpq"].append(dep.first_line_s(client, script_dir))
        finally:
            dep.close()
            client.close()

    if workdir is None:  # the store holds every uploaded tree: give the disk back
        shutil.rmtree(tmp, ignore_errors=True)
    res = BenchResult("workspace", size)
    med_tar = median(tar_s)
    med_upload = median([u["total_s"] for u in uploads])
    med_resubmit = median([r["total_s"] for r in resubmits])
    med_line = {k: median(v) for k, v in times.items()}
    line_ratios = [d / b for d, b in zip(times["ddpq"], times["bare"], strict=True)]

    def rounded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows]

    res.figures = {
        "tree": {"files": files, "bytes": total_bytes, "upload_reps": upload_reps},
        "tar_sha256_s": [round(v, 4) for v in tar_s],
        "upload": rounded(uploads),
        "upload_s_median": round(med_upload, 4),
        "upload_mb_per_s": round(total_bytes / med_upload / 1e6, 1),
        "tar_sha256_mb_per_s": round(total_bytes / med_tar / 1e6, 1),
        "resubmit": rounded(resubmits),
        "resubmit_s_median": round(med_resubmit, 4),
        "resubmit_sent_bytes_max": max(r["sent_bytes"] for r in resubmits),
        "first_line_reps": line_reps,
        "first_line_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "first_line_s_median": {k: round(v, 3) for k, v in med_line.items()},
        "first_line_ratio_per_rep": [round(x, 4) for x in line_ratios],
    }
    res.ratios = {
        "upload_vs_tar_sha256": ratio(med_upload, med_tar),
        "resubmit_s_vs_0.5s": ratio(med_resubmit, GOAL_RESUBMIT_S),
        "first_line_vs_bare_torchrun": round(median(line_ratios), 4),
    }
    r = res.ratios
    res.goals = {
        "upload<=3x_tar": (r["upload_vs_tar_sha256"] or 9e9) <= GOAL_UPLOAD_VS_TAR,
        "resubmit<=0.5s_and_0_bytes": (r["resubmit_s_vs_0.5s"] or 9e9) <= 1.0
        and res.figures["resubmit_sent_bytes_max"] == 0,
        "first_line<=bare": (r["first_line_vs_bare_torchrun"] or 9e9) <= GOAL_FIRST_LINE_VS_BARE,
    }
    res.notes.append(
        "upload = pack_workspace (walk, lstat, sha256 of every file) + upload_workspace (POST "
        "missing, then the files of at most 1 MiB in batches (POST /workspaces/files/batch, "
        "up to 16 MiB each) and each bigger one begin, chunk(s), commit; then POST "
        "/workspaces) to "
        "`ddpq serve` on SQLite with the filesystem store, a fresh tree of os.urandom files "
        "(log-normal sizes) per rep; anchor = `tar c -C DIR . | sha256sum` of the same tree, "
        "run once untimed first; server_cpu_s = the serve process's user+system CPU; "
        "resubmit = the same calls for the last tree again (sent_bytes = file bytes sent); "
        "first line = DdpqClient.run (pack + upload + POST /jobs) → the marker line in "
        "rank-0.log (polled every 10 ms) with one registered `python -m worker.main --gpus "
        "none`; bare = `torchrun --standalone --nproc-per-node 2 first_line.py` → the line in "
        "its stdout; interleaved, ratio = median of per-rep ratios; default/full: one untimed "
        "warm-up of each first"
    )
    return res


def main() -> None:
    """CLI: ``python -m bench.workspace --size tiny|default|full [--json FILE]``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
