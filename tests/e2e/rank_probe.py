"""A custom entrypoint for the e2e tests: trains nothing, reports a few steps, then writes what
the rank process has loaded (``probe-rank-<rank>.json`` in the attempt directory) and reports
it as a metric, so a test can prove that ranks hold no database machinery."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from service.core import artifacts
from worker import attempt as contract
from worker.runtime.train.context import TrainContext


def loaded() -> dict[str, bool]:
    """Whether SQLAlchemy or psycopg is imported in this process, and whether it has a
    database URL in its environment."""
    return {
        "sqlalchemy": any(m == "sqlalchemy" or m.startswith("sqlalchemy.") for m in sys.modules),
        "psycopg": any(m.split(".")[0] in ("psycopg", "psycopg2") for m in sys.modules),
        "database_url": contract.DATABASE_URL in os.environ,
    }


def train(ctx: TrainContext) -> dict[str, float]:
    """Report loss at steps 1..3 (every rank, as a training loop does), flush, then probe."""
    for step in range(1, 4):
        ctx.report(step, 0, loss=torch.tensor(float(step)))
    ctx.sink.flush()  # a collective: the sink's thread has done real I/O by the probe
    probe = loaded()
    root = Path(os.environ[contract.ARTIFACT_DIR])  # where the worker said the rank writes
    folder = artifacts.attempt_dir(root, ctx.job_id, ctx.attempt)
    contract.write_json_atomic(folder / f"probe-rank-{ctx.rank}.json", dict(probe))
    ctx.report(3, 0, sqlalchemy_loaded=float(probe["sqlalchemy"]))
    return {"sqlalchemy_loaded": float(probe["sqlalchemy"])}
