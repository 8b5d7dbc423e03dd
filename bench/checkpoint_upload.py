"""Benchmark #8: checkpoint uploads through the attempt API (hosts without a shared filesystem).

Three figures, each a ratio within one run:

- upload throughput of a checkpoint file (1 GiB at the default size) from a rank's directory
  to a live ``ddpq serve`` over loopback (chunks with their sha256, the filesystem store, the
  commit's whole-file check), nothing else running, ÷ a plain copy of the same bytes into the
  store's directory (with fsync): goal ≥ 0.5;
- training steps/s while the uploader thread sends that file ÷ steps/s without (the same
  process, as on rank 0): goal ≥ 0.9. On one box the API competes for the same CPUs, which
  it would not on another host: measured as is (``same_host``) and with the API process at
  nice 19 (``api_niced``, standing in for a remote API); the goal reads ``api_niced``;
- the training thread's stall per checkpoint (#2) with the upload transport ÷ with the shared
  one: the upload adds nothing to the stall (goal ≤ 1.1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import (
    BenchResult,
    active_jobs,
    attempt_token,
    median,
    migrated,
    pick,
    ratio,
    serve_api,
    serve_pids,
    sqlite_url,
)

GOAL_THROUGHPUT = 0.5
GOAL_TRAINING = 0.9
GOAL_STALL = 1.1
BLOCK_BYTES = 16 << 20
API_NICE = 19


def write_file(path: Path, size_bytes: int) -> str:
    """``size_bytes`` of incompressible bytes at ``path`` (fsynced); returns their sha256."""
    digest = hashlib.sha256()
    block = os.urandom(BLOCK_BYTES)
    with open(path, "wb") as fh:
        left = size_bytes
        while left > 0:
            piece = block[: min(left, BLOCK_BYTES)]
            fh.write(piece)
            digest.update(piece)
            left -= len(piece)
        fh.flush()
        os.fsync(fh.fileno())
    return digest.hexdigest()


def plain_copy(src: Path, dest: Path) -> float:
    """Seconds to copy ``src`` to ``dest`` and fsync it (what a shared filesystem costs)."""
    t0 = time.perf_counter()
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        shutil.copyfileobj(fin, fout, BLOCK_BYTES)
        fout.flush()
        os.fsync(fout.fileno())
    elapsed = time.perf_counter() - t0
    dest.unlink()
    return elapsed


class Trainer:
    """A small CPU training step (MLP forward/backward/SGD) in this thread."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(64, 256)

    def steps_per_s(self, until: Any, min_s: float) -> float:
        """Steps/s from now until ``until()`` is true and ``min_s`` seconds passed."""
        t0 = time.perf_counter()
        steps = 0
        while True:
            loss = self.model(self.x).square().mean()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            steps += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s and until():
                return steps / elapsed


def run(size: str, *, workdir: Path | None = None) -> BenchResult:
    """Upload throughput vs a plain copy, training speed during an upload, and the stall."""
    from worker.runtime.attempt_client import AttemptClient
    from worker.runtime.checkpoints.saver import Checkpointer
    from worker.runtime.checkpoints.uploader import CheckpointUploader, UploadItem

    torch.set_num_threads(1)
    size_bytes = pick(size, 32 << 20, 1 << 30)
    reps = pick(size, 1, 2)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-upload-"))
    rank_dir = tmp / "rank-host"
    rank_dir.mkdir(parents=True, exist_ok=True)
    url = sqlite_url(tmp)
    db = migrated(url)
    job_ids = active_jobs(db, 4)
    src = rank_dir / "checkpoint.pt"
    sha = write_file(src, size_bytes)
    store_dir = tmp / "artifacts"
    store_dir.mkdir(parents=True, exist_ok=True)
    phases: dict[str, dict[str, list[float]]] = {}
    trainer = Trainer()
    with serve_api(url, tmp) as api_url:
        port = int(api_url.rsplit(":", 1)[1])
        for phase in ("same_host", "api_niced"):
            if phase == "api_niced":  # the API as if on another host: it yields the CPU
                for pid in serve_pids(port):
                    os.setpriority(os.PRIO_PROCESS, pid, API_NICE)
            got: dict[str, list[float]] = {
                "copy_s": [], "upload_s": [], "upload_s_while_training": [], "with": [],
                "without": [],
            }  # fmt: skip
            client = AttemptClient(api_url, attempt_token(db, job_ids.pop()))
            for rep in range(reps):
                step = 2 * rep + 1
                got["copy_s"].append(plain_copy(src, store_dir / "copy.tmp"))
                item = UploadItem(step, 0, src, size_bytes, sha)
                got["upload_s"].append(upload(client, item, None, CheckpointUploader)[1])
                got["without"].append(trainer.steps_per_s(lambda: True, 3.0))
                item = UploadItem(step + 1, 0, src, size_bytes, sha)
                during, took_s = upload(client, item, trainer, CheckpointUploader)
                got["with"].append(during)
                got["upload_s_while_training"].append(took_s)
            client.close()
            phases[phase] = got
        stall = stall_by_transport(api_url, db, job_ids[:2], tmp, size, Checkpointer)
    db.dispose()
    res = BenchResult("checkpoint_upload", size)
    res.figures = {"file_bytes": size_bytes, "reps": reps, "stall_s_median": stall}
    for phase, got in phases.items():
        med_copy, med_upload = median(got["copy_s"]), median(got["upload_s"])
        res.figures[phase] = {
            "copy_s": [round(v, 3) for v in got["copy_s"]],
            "upload_s": [round(v, 3) for v in got["upload_s"]],
            "upload_s_while_training": [round(v, 3) for v in got["upload_s_while_training"]],
            "copy_mb_per_s": round(size_bytes / med_copy / 1e6, 1),
            "upload_mb_per_s": round(size_bytes / med_upload / 1e6, 1),
            "steps_per_s_without_upload": [round(v, 1) for v in got["without"]],
            "steps_per_s_during_upload": [round(v, 1) for v in got["with"]],
        }
        res.ratios[f"upload_vs_plain_copy_{phase}"] = ratio(med_copy, med_upload)
        res.ratios[f"training_during_upload_vs_without_{phase}"] = ratio(
            median(got["with"]), median(got["without"])
        )
    res.ratios["stall_upload_vs_shared"] = ratio(stall["upload"], stall["shared"])
    r = res.ratios
    res.goals = {
        "upload>=0.5_copy": (r["upload_vs_plain_copy_same_host"] or 0) >= GOAL_THROUGHPUT,
        "training>=0.9_during_upload": (r["training_during_upload_vs_without_api_niced"] or 0)
        >= GOAL_TRAINING,
        "stall_unchanged": (r["stall_upload_vs_shared"] or 9) <= GOAL_STALL,
    }
    res.notes.append(
        "upload (alone, as the copy) = begin + 16 MiB chunks (each with its sha256) + commit "
        "(the API checks the whole file's sha256) from the rank's directory into the API's "
        "filesystem store, over loopback; plain copy = copyfileobj + fsync of the same bytes "
        "in the same run; "
        "training = a 1-thread CPU MLP step in the uploading process (as on rank 0); "
        "same_host: the API process competes for this box's CPUs at normal priority; "
        "api_niced: the API process at nice 19, standing in for an API on another host "
        "(an upload only happens when the API is elsewhere); the throughput goal reads "
        "same_host (the API at full speed), the training goal api_niced"
    )
    return res


def upload(
    client: Any, item: Any, trainer: Trainer | None, uploader_cls: Any
) -> tuple[float, float]:
    """The uploader thread sends ``item`` while ``trainer`` trains (None: nothing else runs):
    (steps/s meanwhile or 0, upload seconds).

    Raises:
        RuntimeError: the upload failed (stderr says why).
    """
    done: list[float] = []
    uploader = uploader_cls(
        client,
        on_committed=lambda _item: done.append(time.perf_counter()),
        on_failed=lambda step, why: sys.stderr.write(f"upload {step} failed: {why}\n"),
        on_stale=lambda why: sys.stderr.write(f"fenced: {why}\n"),
    )
    t0 = time.perf_counter()
    uploader.submit(item)
    during = trainer.steps_per_s(lambda: not uploader.busy, 0.5) if trainer else 0.0
    uploader.close()
    if not done:
        raise RuntimeError("the upload failed (see stderr)")
    return during, done[0] - t0


def stall_by_transport(
    api_url: str, db: Any, job_ids: list[int], tmp: Path, size: str, checkpointer: Any
) -> dict[str, float]:
    """Median seconds the training thread spends in ``save`` (snapshot copy), shared vs
    upload transport, same state (#2's measure)."""
    from worker.runtime.attempt_client import AttemptClient

    torch.manual_seed(0)
    width = pick(size, 256, 1024)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(pick(size, 4, 24))])
    reps = pick(size, 3, 9)
    ckpts, stalls = {}, {}
    for transport, job_id in zip(("shared", "upload"), job_ids, strict=True):
        client = AttemptClient(api_url, attempt_token(db, job_id))
        artifacts = tmp / "artifacts" if transport == "shared" else tmp / "rank-host"
        ckpts[transport] = checkpointer(client, artifacts, job_id, 1, keep=2, transport=transport)
        stalls[transport] = []
    for step in range(1, reps + 2):  # interleaved: the box's load drifts alike for both
        for transport, ckpt in ckpts.items():
            t0 = time.perf_counter()
            ckpt.save(step, 0, lambda: {"model": model.state_dict()})
            if step > 1:  # the first save allocates the snapshot buffers (#2 reports it apart)
                stalls[transport].append(time.perf_counter() - t0)
            ckpt.wait_uploaded(600)
    for ckpt in ckpts.values():
        ckpt.close()
    return {transport: round(median(v), 5) for transport, v in stalls.items()}


def main() -> None:
    """CLI: ``python -m bench.checkpoint_upload --size tiny|default|full [--json FILE]``."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", choices=("tiny", "default", "full"), default="default")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    text = json.dumps(run(args.size).as_dict(), indent=2)
    if args.json:
        args.json.write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
