"""Checkpoints without a shared filesystem, end to end: real API, real workers, real 2-rank
gloo jobs, each worker host with an artifact directory of its own.

A 2-rank job checkpoints on host B (transport ``auto`` finds B does not share the API's
directory and uploads); the user's download of a checkpoint matches its sha256; then worker B
stops, B's directory is deleted, and a worker on host C (an empty directory) resumes the job
from the uploaded checkpoint: it succeeds as attempt 2, every loss step stored exactly once.

- in network namespaces (``ip netns``): API, B and C each in its own, only the API's port
  reachable from B and C, SQLite, the filesystem store (skipped, saying why, where namespaces
  cannot be made; the loopback variants below run anyway);
- on loopback with disjoint directories: the filesystem store on SQLite, and the database
  store (``DDPQ_CHECKPOINT_STORE=database``) on SQLite and on PostgreSQL.

``init_from``: a 2-rank job's checkpoint starts a 1-rank job on another host (first loss
close to the source's last); into a 2-node Slurm job in tests/slurm/.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.hosts import Cluster, Namespaces, reachable, wait_for
from worker.processes import find_tagged_processes

REPO = Path(__file__).resolve().parents[2]


def regression(**training: Any) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((REPO / "examples" / "regression.yaml").read_text())
    spec["config"] = {**spec["config"], "sleep_per_step_ms": 150}
    spec["training"] = {**spec["training"], "epochs": 4, "checkpoint_every_steps": 5,
                        "keep_checkpoints": 2, **training}  # fmt: skip
    return spec


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    ns = Namespaces()
    try:
        ns.create_hub()
    except (OSError, subprocess.SubprocessError) as exc:
        ns.destroy()
        pytest.skip(
            f"network namespaces cannot be made here ({exc}; needs root and `ip netns`): "
            "the loopback variants with disjoint artifact directories cover the rest"
        )
    try:
        yield ns
    finally:
        ns.destroy()


@contextlib.contextmanager
def cluster_of(tmp_path: Path, url: str, store: str, ns: Namespaces | None) -> Iterator[Cluster]:
    """A Cluster for the test, closed (no process of it left) at the end."""
    cluster = Cluster(tmp_path, url, store=store, netns=ns)
    try:
        yield cluster
    finally:
        cluster.close()
        dirs = [h.artifact_dir for h in cluster.hosts]
        wait_for(lambda: not any(tagged(d) for d in dirs), 30, "no rank process to be left")


def tagged(artifact_dir: Path) -> list[int]:
    return find_tagged_processes(frozenset({f"DDPQ_ARTIFACT_DIR={artifact_dir}".encode()}))


def resume_on_another_host(cluster: Cluster) -> None:
    """The scenario of the module docstring, on ``cluster``."""
    host_b, host_c = cluster.add_host("host-b"), cluster.add_host("host-c")
    if host_b.netns is not None:
        assert reachable(host_b.netns, host_b.api_url.split("//")[1].split(":")[0], cluster.port)
        root_ip = cluster.netns.root_ip if cluster.netns is not None else "127.0.0.1"
        assert not reachable(host_b.netns, root_ip, 5432), "B must reach no other port"
    worker_b = cluster.start_worker(host_b)
    # Every checkpoint kept: the downloads below must not race the job's retention.
    job_id = cluster.submit(regression(keep_checkpoints=20))
    cluster.wait_state(job_id, ("running",), 180)
    entries = wait_for(lambda: cluster.checkpoints(job_id), 180, "a first uploaded checkpoint")
    log_b = cluster.rank_log(host_b, job_id, 1)
    assert "checkpoint transport: upload" in log_b, log_b[-3000:]

    # Stop host B while the job still has most of its steps to go (a loaded box is slow to
    # download); the checkpoints stay downloadable from the API.
    worker_b.signal(signal.SIGTERM)
    assert worker_b.popen.wait(120) == 0, worker_b.output()
    job = cluster.job(job_id)
    assert (job["state"], job["attempt"]) == ("queued", 2), job
    newest = cluster.checkpoints(job_id)[0]
    entry = entries[0]
    r = cluster.http.get(f"/jobs/{job_id}/checkpoints/{entry['step']}/file")
    assert r.status_code == 200, r.text[:500]
    assert hashlib.sha256(r.content).hexdigest() == entry["sha256"], "download verifies"
    assert len(r.content) == entry["size_bytes"]
    out = cluster.tmp_path / "downloaded.pt"
    cli = subprocess.run(
        [sys.executable, "-c", "from service.cli.main import main; main()", "checkpoints",
         str(job_id), "--download", str(entry["step"]), "-o", str(out)],
        env={**os.environ, "DDPQ_API_URL": cluster.url}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert hashlib.sha256(out.read_bytes()).hexdigest() == entry["sha256"], "the CLI's too"

    shutil.rmtree(host_b.artifact_dir.parent)  # host B is gone, with every file it wrote

    cluster.start_worker(host_c)
    job = cluster.wait_state(job_id, ("succeeded",), 300)
    assert job["attempt"] == 2, job
    steps, first_of_2 = cluster.loss_steps(job_id)
    total = job["progress"]["total_steps"]
    assert first_of_2 is not None and first_of_2 == newest["step"] + 1, (
        f"attempt 2 resumes after the newest committed checkpoint {newest['step']}, "
        f"first loss of attempt 2 at {first_of_2}\n{cluster.diagnostics(job_id)}"
    )
    missing = sorted(set(range(1, total + 1)) - set(steps))
    assert steps == list(range(1, total + 1)), (
        f"one loss row per step across hosts; missing {missing[:20]}, {len(steps)} rows for "
        f"{total} steps\n{cluster.diagnostics(job_id)}"
    )
    log_c = cluster.rank_log(host_c, job_id, 2)
    assert f"checkpoint step={newest['step']} not on this host; downloading" in log_c, log_c


@pytest.mark.slow
def test_resume_on_another_network_namespace_host(tmp_path: Path, namespaces: Namespaces) -> None:
    """API, host B and host C in three network namespaces; only the API port reachable."""
    with cluster_of(tmp_path, f"sqlite:///{tmp_path / 'ddpq.db'}", "filesystem",
                    namespaces) as cluster:  # fmt: skip
        resume_on_another_host(cluster)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["filesystem", "database"])
def test_resume_on_another_host_over_loopback_sqlite(tmp_path: Path, store: str) -> None:
    """Loopback, disjoint artifact directories, SQLite; both checkpoint stores."""
    with cluster_of(tmp_path, f"sqlite:///{tmp_path / 'ddpq.db'}", store, None) as cluster:
        resume_on_another_host(cluster)


@pytest.mark.slow
def test_resume_on_another_host_database_store_postgres(tmp_path: Path, pg_schema_url: str) -> None:
    """Loopback, disjoint artifact directories, checkpoints in PostgreSQL rows."""
    with cluster_of(tmp_path, pg_schema_url, "database", None) as cluster:
        resume_on_another_host(cluster)


@pytest.mark.slow
def test_init_from_a_2_rank_checkpoint_into_a_1_rank_job_on_another_host(tmp_path: Path) -> None:
    """Job 1 (2 ranks, host B) trains to its end; job 2 (1 rank, host C, an empty directory)
    starts from job 1's latest checkpoint (downloaded through INIT_FILE_PATH): its first loss
    is close to job 1's last, far from job 1's first, and it succeeds."""
    with cluster_of(tmp_path, f"sqlite:///{tmp_path / 'ddpq.db'}", "filesystem",
                    None) as cluster:  # fmt: skip
        host_b, host_c = cluster.add_host("host-b"), cluster.add_host("host-c")
        worker_b = cluster.start_worker(host_b)
        source = cluster.submit(regression(epochs=6, checkpoint_every_steps=None))
        cluster.wait_state(source, ("succeeded",), 300)
        worker_b.stop(90)
        losses = metric_values(cluster, source, "loss")
        first, last = losses[0][1], losses[-1][1]
        assert last < 0.8 * first, f"the source job must learn something: {first} → {last}"

        spec = regression(epochs=1, checkpoint_every_steps=None)
        spec["resources"] = {**spec["resources"], "nproc_per_node": 1}
        spec["init_from"] = {"job": source, "step": "latest", "mode": "weights_only"}
        cluster.start_worker(host_c)
        target = cluster.submit(spec)
        job = cluster.wait_state(target, ("succeeded",), 300)
        assert job["attempt"] == 1
        start = metric_values(cluster, target, "loss")[0]
        assert start[0] == 1, "weights_only starts at step 1"
        assert abs(start[1] - last) < 0.5 * abs(first - last), (
            f"first loss {start[1]} of the init_from job should be near the source's last "
            f"{last} (source started at {first})\n{cluster.diagnostics(target)}"
        )
        log_c = cluster.rank_log(host_c, target, 1)
        assert "init_from job" in log_c and "downloading" in log_c, log_c[-3000:]


def metric_values(cluster: Cluster, job_id: int, name: str) -> list[tuple[int, float]]:
    r = cluster.http.get(f"/jobs/{job_id}/metrics", params={"name": name, "limit": 5000})
    assert r.status_code == 200, r.text
    return [(p["step"], float(p["value"])) for p in r.json()["points"]]
