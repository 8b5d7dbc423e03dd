"""Benchmark #10: a script's side of ddpq: ``import ddpq``, and what following a script's
checkpoint file costs its epochs.

``import ddpq``: a fresh interpreter's wall time for ``python -c "import ddpq"`` minus that of
``python -c "pass"`` (median of interleaved runs); goal ≤ 50 ms, and no torch imported.


The same tutorial-style command job (2 ranks, gloo on CPU: an MLP whose ``snapshot.pt`` is
``mb`` MB, ``torch.save``d after every epoch, as the PyTorch tutorial does) runs through a live
``ddpq serve`` (SQLite, filesystem store) and one real worker, with and without
``checkpoints: {path: snapshot.pt}``, in interleaved repetitions. With it, rank 0's side copies
each new version while hashing it and records it through the attempt API beside the training
(the shared transport of the embedded default: the API verifies the file's sha256). The script
times its own epochs (training and save, after the first, which warms up) and prints them; the
figure is the median epoch time with following ÷ without (goal ≤ 1.05), plus the checkpoints
each run got.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from bench.common import BenchResult, cli_main, median, migrated, pick, serve_api, sqlite_url
from bench.workspace import TERMINAL, Deployment, wait_for

GOAL_EPOCH_RATIO = 1.05
GOAL_IMPORT_MS = 50.0
SCRIPT_NAME = "snapshots.py"
EPOCH_RE = re.compile(r"^epoch_s (\d+) (\d+\.\d+)$", re.M)
SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    mb, epochs, steps = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    width = int((mb * 2**20 / 4 / 2) ** 0.5)  # two width x width layers of float32
    model = DDP(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, width)
    for epoch in range(epochs):
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        if dist.get_rank() == 0:
            torch.save({"MODEL_STATE": model.module.state_dict(), "EPOCHS_RUN": epoch + 1},
                       "snapshot.pt")
            print(f"epoch_s {epoch} {time.perf_counter() - t0:.6f}", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    """
).lstrip()


def epoch_times(
    dep: Deployment, client: Any, workdir: Path, args: list[str], follow: bool
) -> dict[str, Any]:
    """Run the job once; its epochs' seconds (the first left out) and its checkpoints."""
    from service.core.artifacts import rank_log_path

    overrides: dict[str, Any] = {"training.keep_checkpoints": 1000}  # every version listed
    if follow:
        overrides["checkpoints"] = {"path": "snapshot.pt"}
    job = client.run([SCRIPT_NAME, *args], workdir=workdir, nproc_per_node=2, overrides=overrides)
    job_id = int(job["id"])
    state = wait_for(
        lambda: (s := dep.http.get(f"/jobs/{job_id}").json()["state"]) in TERMINAL and s,
        600, 0.2, f"job {job_id} to end",
    )  # fmt: skip
    log = rank_log_path(dep.artifact_dir, job_id, 1, 0).read_text(errors="replace")
    if state != "succeeded":
        raise RuntimeError(f"job {job_id} ended {state}:\n{log[-3000:]}")
    times = [float(t) for _, t in EPOCH_RE.findall(log)][1:]
    saved = dep.http.get(f"/jobs/{job_id}/checkpoints").json()["checkpoints"]
    return {"job": job_id, "epoch_s": times, "checkpoints": len(saved)}


def import_ms(reps: int) -> tuple[float, bool]:
    """Median milliseconds ``import ddpq`` takes in a fresh interpreter, and whether torch got
    imported by it. The time is CPython's own (``-X importtime``: the ``ddpq`` package's
    cumulative line), so interpreter start-up is not in it and no difference of two noisy
    wall times can come out negative on a busy box.

    Raises:
        RuntimeError: ``-X importtime`` printed no line for the ``ddpq`` package.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPQ_")}
    taken: list[float] = []
    for _ in range(reps):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import ddpq"],
            env=env, check=True, capture_output=True, text=True,
        )  # fmt: skip
        found = _IMPORT_TIME_RE.search(out.stderr)
        if found is None:
            raise RuntimeError(f"no importtime line for ddpq in: {out.stderr[-500:]}")
        taken.append(int(found.group(1)) / 1000)
    probe = "import sys, ddpq; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    return median(taken), out.stdout.strip() == "True"


# ``import time: <self us> | <cumulative us> | ddpq``: the top-level package's own line.
_IMPORT_TIME_RE = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| ddpq$", re.MULTILINE)


def run(size: str, *, workdir: Path | None = None) -> BenchResult:
    """The figure of the module docstring, both variants in one run."""
    from service.client import DdpqClient

    mb, epochs, steps = pick(size, (4, 3, 5), (64, 8, 10))
    reps = pick(size, 1, 3)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-follow-"))
    db_url = sqlite_url(tmp)
    migrated(db_url).dispose()
    work = tmp / "project"
    work.mkdir()
    (work / SCRIPT_NAME).write_text(SCRIPT)
    args = [str(mb), str(epochs), str(steps)]
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "followed": []}
    with serve_api(db_url, tmp) as url:
        dep = Deployment(tmp, url, db_url)
        client = DdpqClient(url, token="", timeout_s=60)
        try:
            for _ in range(reps):
                for name in ("plain", "followed"):
                    runs[name].append(epoch_times(dep, client, work, args, name == "followed"))
                    time.sleep(1)  # the API's writes settle between runs
        finally:
            client.close()
            dep.close()
    imported_ms, torch_imported = import_ms(pick(size, 5, 21))
    plain = median([t for r in runs["plain"] for t in r["epoch_s"]])
    followed = median([t for r in runs["followed"] for t in r["epoch_s"]])
    res = BenchResult("followed", size)
    res.figures = {
        "import_ddpq_ms": round(imported_ms, 1),
        "import_ddpq_loads_torch": torch_imported,
        "snapshot_mb": mb,
        "epochs": epochs,
        "steps_per_epoch": steps,
        "reps": reps,
        "epoch_s_median": {"plain": round(plain, 4), "followed": round(followed, 4)},
        "checkpoints_per_run": {k: [r["checkpoints"] for r in v] for k, v in runs.items()},
    }
    res.ratios = {
        "followed_vs_plain_epoch_s": round(followed / plain, 4),
        "import_ddpq_ms_vs_50ms": round(imported_ms / GOAL_IMPORT_MS, 3),
    }
    res.goals = {
        "followed_epoch_s<=1.05x": followed / plain <= GOAL_EPOCH_RATIO,
        "import_ddpq<=50ms_without_torch": imported_ms <= GOAL_IMPORT_MS and not torch_imported,
    }
    res.notes.append(
        "2 ranks gloo CPU, both ranks and the API and the worker on the same 2 cores; "
        "epochs after the first; each followed version is copied+hashed and uploaded "
        "(transport auto resolves to shared, as in the embedded default: the API verifies "
        "each recorded file by its sha256)"
    )
    return res


def main() -> None:
    """CLI: ``python -m bench.followed --size tiny``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
