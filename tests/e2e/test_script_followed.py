"""Zero-change paths for a script that already saves and logs
(``examples/tutorial/train_tensorboard.py``: TensorBoard scalars, and ``snapshot.pt`` loaded
when it exists), run unchanged with ``checkpoints.path: snapshot.pt`` and
``metrics.tensorboard: runs``:

- its loss curve comes from its TensorBoard scalars, and each snapshot it writes is listed as
  a checkpoint with its sha256 and file name;
- it loses its host mid-run (network namespaces: API host + host B + host C, only the API
  port reachable; host B's disk deleted): attempt 2 on host C finds ``snapshot.pt`` restored,
  resumes at the next epoch, and every epoch's loss is stored once.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.client import DdpqClient
from tests.e2e.hosts import Cluster, Namespaces, reachable, wait_for

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "tutorial" / "train_tensorboard.py"
FOLLOW = {"checkpoints": {"path": "snapshot.pt"}, "metrics": {"tensorboard": "runs"}}
EPOCH_LINE = re.compile(r"^epoch (\d+) loss (\d+\.\d+)$", re.M)


def project(tmp_path: Path) -> Path:
    work = tmp_path / "project"
    work.mkdir()
    shutil.copy(SCRIPT, work / "train_tensorboard.py")
    return work


def submit(url: str, work: Path, *args: str) -> int:
    with DdpqClient(url) as client:
        job = client.run(["train_tensorboard.py", *args], workdir=work, nproc_per_node=2,
                         overrides={**FOLLOW, "training.keep_checkpoints": 20})  # fmt: skip
    return int(job["id"])


def losses(http: Any, job_id: int) -> dict[int, float]:
    r = http.get(f"/jobs/{job_id}/metrics", params={"name": "loss", "limit": 10000})
    assert r.status_code == 200, r.text
    points = r.json()["points"]
    steps = [p["step"] for p in points]
    assert len(steps) == len(set(steps)), f"one point per step: {steps}"
    return {p["step"]: p["value"] for p in points}


def printed(log: str) -> dict[int, float]:
    """The script's own ``epoch E loss L`` lines, as step (E + 1) → loss."""
    return {int(e) + 1: float(v) for e, v in EPOCH_LINE.findall(log)}


@pytest.mark.slow
def test_the_tutorial_script_gets_its_curve_and_checkpoints_unchanged(
    deployment: Any, tmp_path: Path
) -> None:
    dep = deployment
    dep.start_worker()
    job_id = submit(dep.url, project(tmp_path), "--epochs", "5", "--epoch-sleep", "0.3")
    job = dep.wait_state(job_id, ("succeeded",), 300)
    folder = dep.artifact_dir / "jobs" / str(job_id) / "attempt-1"
    log = (folder / "rank-0.log").read_text(errors="replace")
    curve = losses(dep.http, job_id)
    assert sorted(curve) == [1, 2, 3, 4, 5], dep.diagnostics(job_id)
    for step, value in printed(log).items():
        assert curve[step] == pytest.approx(value, abs=6e-5), "the scalar the script wrote"
    saved = dep.checkpoints(job_id)
    assert len(saved) == 5, f"one checkpoint per snapshot version: {saved}"
    assert {c["file_name"] for c in saved} == {"snapshot.pt"}
    final = (folder / "workspace" / "snapshot.pt").read_bytes()
    assert saved[0]["sha256"] == hashlib.sha256(final).hexdigest(), "the newest is the last"
    assert saved[0]["size_bytes"] == len(final)
    assert job["latest_metrics"]["loss"] == pytest.approx(curve[5])


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    ns = Namespaces()
    try:
        ns.create_hub()
    except (OSError, subprocess.SubprocessError) as exc:
        ns.destroy()
        pytest.skip(f"network namespaces cannot be made here ({exc}; needs root and `ip netns`)")
    try:
        yield ns
    finally:
        ns.destroy()


@contextlib.contextmanager
def cluster_of(tmp_path: Path, ns: Namespaces | None) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, f"sqlite:///{tmp_path / 'ddpq.db'}", netns=ns)
    try:
        yield cluster
    finally:
        cluster.close()


def lose_the_host_and_resume(cluster: Cluster, tmp_path: Path) -> None:
    host_b, host_c = cluster.add_host("host-b"), cluster.add_host("host-c")
    if host_b.netns is not None:
        api_ip = host_b.api_url.split("//")[1].split(":")[0]
        assert reachable(host_b.netns, api_ip, cluster.port)
        root_ip = cluster.netns.root_ip if cluster.netns is not None else "127.0.0.1"
        assert not reachable(host_b.netns, root_ip, 5432), "B reaches no other port"
    worker_b = cluster.start_worker(host_b)
    epochs = 8
    job_id = submit(cluster.url, project(tmp_path), "--epochs", str(epochs), "--epoch-sleep", "1")
    cluster.wait_state(job_id, ("running",), 180)
    wait_for(lambda: len(cluster.checkpoints(job_id)) >= 2, 180, "two snapshots uploaded")
    worker_b.signal(signal.SIGTERM)
    assert worker_b.popen.wait(120) == 0, worker_b.output()
    job = cluster.job(job_id)
    assert (job["state"], job["attempt"]) == ("queued", 2), job
    log_b = cluster.rank_log(host_b, job_id, 1)
    shutil.rmtree(host_b.artifact_dir.parent)  # host B is gone, with every file it wrote

    newest = cluster.checkpoints(job_id)[0]
    cluster.start_worker(host_c)
    job = cluster.wait_state(job_id, ("succeeded",), 300)
    assert job["attempt"] == 2, job
    log_c = cluster.rank_log(host_c, job_id, 2)
    resumed = re.search(r"resuming from snapshot at epoch (\d+)", log_c)
    assert resumed is not None, f"attempt 2 found snapshot.pt restored:\n{log_c[-3000:]}"
    epochs_run = int(resumed[1])
    assert epochs_run >= 2, "it resumes after the epochs the snapshots held"
    logs_c = log_c + cluster.rank_log(host_c, job_id, 2, rank=1)  # the lock's first takes it
    assert f"restored snapshot.pt from the checkpoint of step {newest['step']}" in logs_c
    curve = losses(cluster.http, job_id)
    assert sorted(curve) == list(range(1, epochs + 1)), (
        f"every epoch's loss once across hosts: {sorted(curve)}\n{cluster.diagnostics(job_id)}"
    )
    first_of_c = min(printed(log_c))
    assert first_of_c == epochs_run + 1, "host C trained from the next epoch on"
    for step, value in {**printed(log_b), **printed(log_c)}.items():
        if step in curve:
            assert curve[step] == pytest.approx(value, abs=6e-5)


@pytest.mark.slow
def test_a_followed_snapshot_survives_losing_the_host_network_namespaces(
    tmp_path: Path, namespaces: Namespaces
) -> None:
    with cluster_of(tmp_path, namespaces) as cluster:
        lose_the_host_and_resume(cluster, tmp_path)


@pytest.mark.slow
def test_a_followed_snapshot_survives_losing_the_host_loopback(tmp_path: Path) -> None:
    with cluster_of(tmp_path, None) as cluster:
        lose_the_host_and_resume(cluster, tmp_path)


CRASHING = """
import io, os, signal, time
import torch

epochs_run = 0
if os.path.exists("snapshot.pt"):
    epochs_run = torch.load("snapshot.pt")["EPOCHS_RUN"]
    print(f"resuming from snapshot at epoch {epochs_run}", flush=True)
for epoch in range(epochs_run, 4):
    time.sleep(0.6)
    state = {"EPOCHS_RUN": epoch + 1, "w": torch.full((50_000,), float(epoch))}
    if epoch == 2 and os.environ["DDPQ_ATTEMPT"] == "1":  # killed half-way through a save
        buffer = io.BytesIO()
        torch.save(state, buffer)
        with open("snapshot.pt", "wb") as fh:
            fh.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            fh.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save(state, "snapshot.pt")
    print(f"saved epoch {epoch}", flush=True)
"""


@pytest.mark.slow
def test_a_snapshot_cut_short_by_a_crash_is_never_a_checkpoint(
    deployment: Any, tmp_path: Path
) -> None:
    """The OOM killer ends the script half-way through ``torch.save``: the kernel closes the
    file anyway. That version must not become the checkpoint attempt 2 starts from."""
    dep = deployment
    dep.start_worker()
    work = tmp_path / "crash"
    work.mkdir()
    (work / "crash.py").write_text(CRASHING)
    with DdpqClient(dep.url) as client:
        job = client.run(["crash.py"], workdir=work, nproc_per_node=1,
                         checkpoint_path="snapshot.pt", overrides={"max_restarts": 1})  # fmt: skip
    job_id = int(job["id"])
    job = dep.wait_state(job_id, ("succeeded",), 300)
    assert job["attempt"] == 2, job
    log2 = (dep.artifact_dir / "jobs" / str(job_id) / "attempt-2" / "rank-0.log").read_text()
    assert "resuming from snapshot at epoch 2" in log2, dep.diagnostics(job_id)
    sizes = {c["size_bytes"] for c in dep.checkpoints(job_id)}
    assert all(size > 150_000 for size in sizes), f"no half file among {sizes}"
