"""Collectives of the runtime in two real gloo processes: the stop vote (every rank stops at the
same step), the sink's averaged flush, and the resume-step broadcast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from service.core.spec import JobSpec
from service.core.states import JobState
from service.store.claims import claim_next_job
from service.store.db import Database
from service.store.jobs import Transition, apply_transition, submit_job
from service.store.metrics import query_points
from service.store.workers import register_worker
from worker.runtime.distributed import DistContext, StopVote, broadcast_int
from worker.runtime.sink import make_sink

WORLD_SIZE = 2
STEPS = 8
STOP_RANK, STOP_AT_STEP = 1, 3


def _rank_main(rank: int, store_path: str, db_url: str, job_id: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE
    )
    ctx = DistContext(
        rank, rank, WORLD_SIZE, torch.device("cpu"), "ddp", "gloo", dist.new_group(backend="gloo")
    )
    db = Database.from_url(db_url)
    sink = make_sink(rank, ctx, db, job_id, 1)
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
    db.dispose()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_two_ranks_stop_together_and_flush_the_mean(db: Database, tmp_path: Path) -> None:
    with db.session() as s:
        register_worker(s, worker_id="w", host="h", pid=1, launcher="local", capacity={})
        submit_job(s, JobSpec(name="t", task="regression"), owner="o")
    with db.session() as s:
        job = claim_next_job(s, worker_id="w", launcher="local", max_gpus_per_node=0, lease_s=600)
        assert job is not None
        job_id = job.id
    with db.session() as s:
        apply_transition(s, Transition(job_id, JobState.STARTING, JobState.RUNNING))

    db_url = db.engine.url.render_as_string(hide_password=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [str(tmp_path / "store"), db_url, str(job_id), str(tmp_path)]
    procs = [
        subprocess.Popen([sys.executable, __file__, str(rank), *args], env=env)
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
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
