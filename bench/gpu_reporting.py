"""Reporting on one GPU: steps/s of a small bf16 transformer with ddpq's sink vs anchors.

Single process (world_size 1, no process group); ``bench/gpu.sh`` runs it. The sink is the
rank-0 ApiSink posting to a live ``ddpq serve`` (its own process). The sink's ``report``
keeps the loss on the GPU; the naive anchor syncs with ``.item()`` every step.
"""

from __future__ import annotations

import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import (
    BenchResult,
    active_jobs,
    attempt_token,
    cli_main,
    interleaved_rates,
    median,
    migrated,
    percentile,
    pick,
    rank_environ,
    ratio,
    serve_api,
    sqlite_url,
)
from bench.reporting import REPORT_P99_GOAL_US, STEPS_RATIO_GOAL


def build_transformer(device: torch.device) -> nn.Module:
    """A 4-layer, d_model 512 encoder with a 1-unit head (~13M params), in bf16."""
    layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 4), nn.Linear(512, 1)).to(
        device, torch.bfloat16
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(size: str, *, workdir: Path | None = None, device: str = "cuda") -> BenchResult:
    """Steps/s per mode (median of interleaved reps) and report() p99 (µs) on ``device``
    (``cuda``; ``cpu`` only to smoke-test this code on a machine without a GPU)."""
    from worker.runtime.distributed import DistContext
    from worker.runtime.metrics.sink import make_sink
    from worker.runtime.topology import RankEnv

    dev = torch.device(device)
    steps, reps = pick(size, 20, 200), pick(size, 2, 7)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-"))
    url = sqlite_url(tmp)
    db = migrated(url)
    job_id = active_jobs(db, 1)[0]
    token = attempt_token(db, job_id)
    db.dispose()
    with serve_api(url, tmp) as api_url:
        model = build_transformer(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(16, 128, 512, device=dev, dtype=torch.bfloat16)
        ctx = DistContext(0, 0, 1, dev, "ddp", None)
        sink = make_sink(RankEnv.from_environ(rank_environ(job_id, api_url, token)), ctx)
        naive = sqlite3.connect(tmp / "naive.db")
        naive.execute("CREATE TABLE m (name TEXT, step INT, value REAL)")
        report_ns: list[int] = []
        step = 0

        def train_step() -> torch.Tensor:
            nonlocal step
            step += 1
            opt.zero_grad(set_to_none=True)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        def ddpq() -> None:
            loss = train_step()
            t0 = time.perf_counter_ns()
            sink.report(step, 0, loss)
            report_ns.append(time.perf_counter_ns() - t0)
            if sink.flush_due():
                sink.flush()

        def naive_step() -> None:
            loss = train_step()
            naive.execute("INSERT INTO m VALUES (?, ?, ?)", ("loss", step, loss.item()))
            naive.commit()

        modes: dict[str, Callable[[], Any]] = {
            "none": train_step, "ddpq": ddpq, "naive": naive_step,
        }  # fmt: skip
        for _ in range(pick(size, 3, 20)):
            train_step()

        def finish(name: str) -> None:
            if name == "ddpq" and sink.pending:
                sink.flush()  # the segment's tail: its cost belongs to ddpq
            _sync(dev)

        rates = interleaved_rates(
            modes, reps=reps, steps=steps, before=lambda: _sync(dev), finish=finish
        )
        sink.close()
    med = {k: median(v) for k, v in rates.items()}
    paired = median([d / n for d, n in zip(rates["ddpq"], rates["none"], strict=True)])
    p99_us = percentile(report_ns, 99) / 1000
    res = BenchResult("gpu_reporting", size)
    res.figures = {
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "none (cpu)",
        "steps_per_s_median": {k: round(v, 1) for k, v in med.items()},
        "report_call_p99_us": round(p99_us, 2),
    }
    res.ratios = {
        "ddpq_vs_none": round(paired, 4),
        "naive_vs_none": ratio(med["naive"], med["none"]),
    }
    res.goals = {
        "ddpq_vs_none>=0.99": paired >= STEPS_RATIO_GOAL,
        "report_p99<=20us": p99_us <= REPORT_P99_GOAL_US,
    }
    return res


def main() -> None:
    """CLI: ``python -m bench.gpu_reporting --size default``."""
    cli_main(run, __doc__ or "")


if __name__ == "__main__":
    main()
