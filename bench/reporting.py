"""Benchmark #1: steps/s of a 2-rank gloo DDP loop with ddpq's rank-0 sink (posting to a live
``ddpq serve``'s attempt API, as ranks do) vs its anchors; the Trainer's ``sink.report``, a
custom entrypoint's ``ctx.report`` and a script's ``ddpq.report``, each into a job of its own."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bench.common import (
    BenchResult,
    active_jobs,
    attempt_token,
    interleaved_rates,
    median,
    migrated,
    parser,
    percentile,
    pick,
    rank_environ,
    ratio,
    serve_api,
    sqlite_url,
)

MLFLOW_SITE_ENV = "DDPQ_BENCH_MLFLOW_SITE"  # a pip --target dir holding mlflow (optional)
REPORT_P99_GOAL_US = 20.0
STEPS_RATIO_GOAL = 0.99


def import_mlflow() -> Any | None:
    """``mlflow`` if importable (the venv first, then ``$DDPQ_BENCH_MLFLOW_SITE``), else None."""
    site = os.environ.get(MLFLOW_SITE_ENV)
    if site and site not in sys.path:
        sys.path.append(site)  # appended: the venv's own packages win over the target dir's
    try:
        import mlflow
    except Exception:  # any import failure means "not available"
        return None
    return mlflow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, cfg: dict[str, Any]) -> None:
    """One rank: every mode for ``steps`` steps per repetition, interleaved; rank 0 writes the
    figures to ``cfg['out']``."""
    import ddpq
    from ddpq import _state as ddpq_state
    from service.core.spec.model import JobSpec
    from worker.runtime.checkpoints.saver import NullCheckpointer
    from worker.runtime.distributed import DistContext
    from worker.runtime.metrics.sink import make_sink
    from worker.runtime.signals import StopFlag
    from worker.runtime.topology import RankEnv
    from worker.runtime.train.context import TrainContext
    from worker.runtime.train.session import RankSession

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    ctx = DistContext(rank, rank, 2, torch.device("cpu"), "ddp", "gloo")

    def env_of(job_id: int, token: str) -> RankEnv:
        environ = rank_environ(job_id, cfg["api_url"], token, rank=rank, world_size=2)
        return RankEnv.from_environ(environ)

    sink = make_sink(env_of(cfg["job_id"], cfg["token"]), ctx)
    # A custom entrypoint's path: ``ctx.report`` into its own job's sink (its own rows).
    ctx_sink = make_sink(env_of(cfg["ctx_job_id"], cfg["ctx_token"]), ctx)
    train_ctx = TrainContext(
        spec=JobSpec.model_validate({"name": "bench", "task": "examples.custom_loop:train"}),
        dist=ctx, sink=ctx_sink,
        checkpointer=NullCheckpointer(), stop=StopFlag(), api=None,
        artifact_dir=Path(cfg["out"]).parent, job_id=cfg["ctx_job_id"], attempt=1,
    )  # fmt: skip
    # A script's path: ``ddpq.report`` into the process's session (its own job's rows).
    lib_sink = make_sink(env_of(cfg["lib_job_id"], cfg["lib_token"]), ctx)
    lib_session = RankSession(
        spec=JobSpec.model_validate({"name": "bench", "task": "examples.custom_loop:train"}),
        dist=ctx, sink=lib_sink,
        checkpointer=NullCheckpointer(), stop=StopFlag(), api=None,
        artifact_dir=Path(cfg["out"]).parent, job_id=cfg["lib_job_id"], attempt=1,
    )  # fmt: skip
    ddpq_state.use(lib_session)
    naive = sqlite3.connect(cfg["naive_path"]) if rank == 0 else None
    if naive is not None:
        naive.execute("CREATE TABLE IF NOT EXISTS m (name TEXT, step INT, value REAL)")
    mlflow = import_mlflow() if (rank == 0 and cfg["mlflow"]) else None
    if mlflow is not None:
        mlflow.set_tracking_uri(cfg["mlflow_uri"])
        mlflow.start_run()
    report_ns: list[int] = []
    ctx_report_ns: list[int] = []
    lib_report_ns: list[int] = []
    step = 0

    def train_step() -> torch.Tensor:
        nonlocal step
        step += 1
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    def run_ddpq() -> None:
        loss = train_step()
        t0 = time.perf_counter_ns()
        sink.report(step, 0, loss)
        report_ns.append(time.perf_counter_ns() - t0)
        if sink.flush_due():
            sink.flush()

    def run_ctx() -> None:
        loss = train_step()
        t0 = time.perf_counter_ns()
        train_ctx.report(step, 0, loss=loss)  # flushes (no collective) when due: timed too
        ctx_report_ns.append(time.perf_counter_ns() - t0)

    def run_lib() -> None:
        loss = train_step()
        t0 = time.perf_counter_ns()
        ddpq.report(step, epoch=0, loss=loss)  # flushes (no collective) when due: timed too
        lib_report_ns.append(time.perf_counter_ns() - t0)

    def run_naive() -> None:
        loss = train_step()
        if naive is not None:
            naive.execute("INSERT INTO m VALUES (?, ?, ?)", ("loss", step, loss.item()))
            naive.commit()

    def run_mlflow(synchronous: bool) -> Callable[[], None]:
        def one() -> None:
            loss = train_step()
            if mlflow is not None:
                mlflow.log_metric("loss", loss.item(), step=step, synchronous=synchronous)

        return one

    modes: dict[str, Callable[[], Any]] = {
        "none": train_step,
        "ddpq": run_ddpq,
        "ddpq_ctx": run_ctx,
        "ddpq_lib": run_lib,
        "naive": run_naive,
    }
    if cfg["mlflow"]:
        modes["mlflow_sync"] = run_mlflow(True)
        modes["mlflow_async"] = run_mlflow(False)
    for _ in range(cfg["warmup"]):
        train_step()

    def _barrier() -> None:
        dist.barrier()

    def finish(name: str) -> None:
        if name == "ddpq" and sink.pending:
            sink.flush()  # the segment's tail: its cost belongs to ddpq
        if name == "ddpq_ctx":
            train_ctx.flush()
        if name == "ddpq_lib":
            lib_session.flush()
        if name == "mlflow_async" and mlflow is not None:
            mlflow.flush_async_logging()

    rates = interleaved_rates(
        modes, reps=cfg["reps"], steps=cfg["steps"], before=_barrier, finish=finish
    )
    sink.close()
    ctx_sink.close()
    lib_sink.close()
    if mlflow is not None:
        mlflow.end_run()
    if rank == 0:
        out = {
            "rates": rates,
            "report_ns": report_ns,
            "ctx_report_ns": ctx_report_ns,
            "written": getattr(sink, "written", None),
            "ctx_written": getattr(ctx_sink, "written", None),
            "lib_report_ns": lib_report_ns,
            "lib_written": getattr(lib_sink, "written", None),
        }
        Path(cfg["out"]).write_text(json.dumps(out))
    dist.barrier()  # tear down together (rank 1 once aborted in teardown while rank 0 closed)
    dist.destroy_process_group()


def run(size: str, *, workdir: Path | None = None, mlflow: bool | None = None) -> BenchResult:
    """Measure steps/s per mode (median over interleaved repetitions) and report() p99 (µs).

    Args:
        mlflow: include the MLflow anchors (None: when mlflow imports).
    """
    # 1,500 steps a repetition: several count-rule flushes (FLUSH_EVERY_POINTS) per segment,
    # as in training, not just the segment's tail flush.
    steps = pick(size, 20, 1500)
    reps = pick(size, 2, 5)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="ddpq-bench-"))
    url = sqlite_url(tmp)
    db = migrated(url)
    job_id, ctx_job_id, lib_job_id = active_jobs(db, 3)
    tokens = (
        attempt_token(db, job_id),
        attempt_token(db, ctx_job_id),
        attempt_token(db, lib_job_id),
    )
    db.dispose()
    use_mlflow = (import_mlflow() is not None) if mlflow is None else mlflow
    cfg = {
        "port": _free_port(),
        "job_id": job_id,
        "ctx_job_id": ctx_job_id,
        "token": tokens[0],
        "ctx_token": tokens[1],
        "lib_job_id": lib_job_id,
        "lib_token": tokens[2],
        "naive_path": str(tmp / "naive.db"),
        "mlflow": use_mlflow,
        "mlflow_uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "out": str(tmp / "reporting.json"),
        "steps": steps,
        "reps": reps,
        "warmup": pick(size, 5, 50),
    }
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with serve_api(url, tmp) as api_url:
        cfg["api_url"] = api_url
        mp.spawn(_rank_main, args=(cfg,), nprocs=2, join=True)
    data = json.loads(Path(cfg["out"]).read_text())
    rates: dict[str, list[float]] = data["rates"]
    res = BenchResult("reporting", size)
    med = {name: median(v) for name, v in rates.items()}
    paired = [d / n for d, n in zip(rates["ddpq"], rates["none"], strict=True)]
    p99_us = percentile(data["report_ns"], 99) / 1000
    ctx_p99_us = percentile(data["ctx_report_ns"], 99) / 1000
    ctx_paired = [d / n for d, n in zip(rates["ddpq_ctx"], rates["none"], strict=True)]
    lib_paired = [d / n for d, n in zip(rates["ddpq_lib"], rates["none"], strict=True)]
    lib_p99_us = percentile(data["lib_report_ns"], 99) / 1000
    res.figures = {
        "steps_per_rep": steps,
        "reps": reps,
        "steps_per_s_median": {k: round(v, 1) for k, v in med.items()},
        "report_call_p50_us": round(percentile(data["report_ns"], 50) / 1000, 2),
        "report_call_p99_us": round(p99_us, 2),
        "points_written": data["written"],
        "ctx_report_call_p50_us": round(percentile(data["ctx_report_ns"], 50) / 1000, 2),
        "ctx_report_call_p99_us": round(ctx_p99_us, 2),
        "ctx_points_written": data["ctx_written"],
        "lib_report_call_p50_us": round(percentile(data["lib_report_ns"], 50) / 1000, 2),
        "lib_report_call_p99_us": round(lib_p99_us, 2),
        "lib_points_written": data["lib_written"],
        "mlflow": use_mlflow,
    }
    res.ratios = {
        "ddpq_vs_none": round(median(paired), 4),
        "ddpq_ctx_vs_none": round(median(ctx_paired), 4),
        "ddpq_lib_vs_none": round(median(lib_paired), 4),
        "naive_vs_none": ratio(med["naive"], med["none"]),
        "mlflow_sync_vs_none": ratio(med.get("mlflow_sync"), med["none"]),
        "mlflow_async_vs_none": ratio(med.get("mlflow_async"), med["none"]),
    }
    res.goals = {
        "ddpq_vs_none>=0.99": median(paired) >= STEPS_RATIO_GOAL,
        "report_p99<=20us": p99_us <= REPORT_P99_GOAL_US,
        "ctx_report_p99<=20us": ctx_p99_us <= REPORT_P99_GOAL_US,
        "ddpq_lib_vs_none>=0.99": median(lib_paired) >= STEPS_RATIO_GOAL,
    }
    if not use_mlflow:
        res.notes.append("MLflow anchors not measured: mlflow not importable")
    res.notes.append(
        "2 ranks gloo CPU, MLP 32-64-1, batch 16; ddpq = the rank-0 ApiSink posting to a "
        "live `ddpq serve` (SQLite) over HTTP/1.1; it flushes every "
        "FLUSH_EVERY_POINTS reports (the trainer's count rule; its 2 s time rule not used); "
        "report_call = the Trainer's sink.report (flush not timed); ctx_report_call = a "
        "custom entrypoint's ctx.report(step, 0, loss=loss) into its own job (ddpq_ctx; "
        "the call that flushes is timed too); lib_report_call = a script's "
        "ddpq.report(step, epoch=0, loss=loss) through the process's session (ddpq_lib)"
    )
    return res


def main() -> None:
    """CLI: ``python -m bench.reporting --size tiny``."""
    args = parser(__doc__ or "").parse_args()
    res = run(args.size)
    text = json.dumps(res.as_dict(), indent=2)
    if args.json:
        args.json.write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
