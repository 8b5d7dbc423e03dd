"""Collectives of the runtime in two real gloo processes: the stop vote (every rank stops at the
same step), the sink's averaged flush (through the real attempt API), and the resume-step
broadcast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from service.core.config import Settings
from service.store.db import Database
from service.store.metrics.points import query_points
from tests.rank_api import live_api, mint_token, rank_environ, running_job
from worker.runtime.distributed import DistContext, StopVote, broadcast_int
from worker.runtime.metrics.sink import make_sink
from worker.runtime.topology import RankEnv

WORLD_SIZE = 2
STEPS = 8
STOP_RANK, STOP_AT_STEP = 1, 3


def _rank_main(rank: int, store_path: str, environ: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE
    )
    ctx = DistContext(
        rank, rank, WORLD_SIZE, torch.device("cpu"), "ddp", "gloo", dist.new_group(backend="gloo")
    )
    rank_vars = {"RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE)}
    sink = make_sink(RankEnv.from_environ({**json.loads(environ), **rank_vars}), ctx)
    vote = StopVote(ctx)
    stopped_at = None
    for step in range(1, STEPS + 1):
        sink.report(step, 0, torch.tensor(float(step + rank)))  # mean over ranks: step + 0.5
        decision = vote.collect()
        vote.launch(rank == STOP_RANK and step >= STOP_AT_STEP, False)
        if decision.stop:
            stopped_at = step
            break
    vote.close()
    sink.flush()
    sink.close()
    resume_step = broadcast_int(41 if rank == 0 else -1, ctx)
    Path(out_dir, f"rank-{rank}.json").write_text(
        json.dumps({"stopped_at": stopped_at, "resume_step": resume_step})
    )
    dist.destroy_process_group()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def _with_repo_on_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the repository on PYTHONPATH: a rank run as ``python <this file>`` has
    only this file's folder on sys.path, and imports ``tests.rank_api``."""
    repo = str(Path(__file__).resolve().parents[2])
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))}


def test_two_ranks_stop_together_and_flush_the_mean(
    db: Database, settings: Settings, tmp_path: Path
) -> None:
    job_id, attempt = running_job(db)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with live_api(settings) as api:
        environ = rank_environ(api.url, mint_token(db, job_id, attempt), job_id, attempt)
        args = [str(tmp_path / "store"), json.dumps(environ), str(tmp_path)]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, str(rank), *args], env=_with_repo_on_path(env)
            )
            for rank in range(WORLD_SIZE)
        ]
        codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0] * WORLD_SIZE
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD_SIZE)]
    # Rank 1 raised its flag at step 3; the vote is read one step later, on every rank.
    assert [r["stopped_at"] for r in results] == [STOP_AT_STEP + 1] * WORLD_SIZE
    assert [r["resume_step"] for r in results] == [41] * WORLD_SIZE
    with db.session(write=False) as s:
        points, _ = query_points(s, job_id, "loss")
    assert [p.step for p in points] == list(range(1, STOP_AT_STEP + 2))
    assert [p.value for p in points] == [step + 0.5 for step in range(1, STOP_AT_STEP + 2)]


if __name__ == "__main__":  # one rank, started by the test above
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
