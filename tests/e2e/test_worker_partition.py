"""A partition, end to end: a job's worker is cut off from the API for twice the lease, and
the job still runs on one host at a time, resumes from its newest checkpoint elsewhere and
stores each step once.

Topology (``hosts.RootHub``, PostgreSQL): the API in the root namespace beside PostgreSQL,
hosts B and C each in a network namespace of its own, reaching only the API's port; lease
``LEASE_S`` (40 s), heartbeat 0.3 s, so the worker's lease fence holds (its stop budget, the
local launcher's 10 s grace + a call's 7 s timeout + a tick + 2 s, is under half the lease).

Timeline (t = the cut):

- B's worker claims a 1-rank regression job (~64 s of steps, a checkpoint every 20 steps,
  every checkpoint kept); C's worker starts once B holds it, so C can only take attempt 2.
- Once two checkpoints are committed, B's veth end goes down inside B's namespace
  (``Cluster.cut``): B, its worker and its ranks reach nothing. (A checkpoint is committed
  only once the loss points of the steps it covers are stored, so a cut right after a commit
  loses no point: attempt 2 resumes after it.)
- t ≈ 20.7 s: B's fence stops attempt 1's ranks ("lease not renewed for"), the API unaware.
- t ≈ 40 s: the API's reaper finds the lease lapsed and requeues the job (``worker_lost``);
  C claims attempt 2, which downloads the newest checkpoint and resumes after it.
- t = 80 s: ``Cluster.heal``; B's worker reaches the API again while attempt 2 still runs
  on C: it holds nothing, claims nothing, and the job goes on to succeed on C.

Throughout, every process on the box whose environment names the job (and one of the two
hosts' artifact directories) is sampled every 0.2 s with its ``DDPQ_ATTEMPT``: no sample may
hold two attempts. Skipped, saying why, where namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.hosts import Cluster, Host, RootHub, wait_for
from tests.e2e.jobs_http import Proc
from worker.api_client import CONNECT_TIMEOUT_S, READ_TIMEOUT_S
from worker.control.fences import DEFAULT_CANCEL_GRACE_S
from worker.decisions import stop_budget_for
from worker.processes import find_tagged_processes

REPO = Path(__file__).resolve().parents[2]
LEASE_S = 40.0
HEARTBEAT_S = 0.3
EPOCHS = 10  # × 32 steps (1024 samples, batch 32, one rank) × 200 ms: ~64 s of training
CHECKPOINT_EVERY = 20
FENCE_LOG = "lease not renewed for"


def long_regression() -> dict[str, Any]:
    """A 1-rank regression job of ``EPOCHS`` × 32 steps, 200 ms each, a checkpoint every
    ``CHECKPOINT_EVERY`` steps, all kept (the test compares the list before and after)."""
    spec: dict[str, Any] = yaml.safe_load((REPO / "examples" / "regression.yaml").read_text())
    spec["name"] = "partitioned"
    spec["config"] = {**spec["config"], "sleep_per_step_ms": 200}
    spec["resources"] = {**spec["resources"], "nproc_per_node": 1}
    spec["training"] = {**spec["training"], "epochs": EPOCHS, "keep_checkpoints": 100,
                        "checkpoint_every_steps": CHECKPOINT_EVERY}  # fmt: skip
    return spec


@dataclass(frozen=True)
class Sample:
    """One scan: when (``time.time()``) and which hosts ran processes of which attempt."""

    at: float
    attempts: dict[int, frozenset[str]]


class AttemptScan:
    """Samples, every ``every_s`` seconds until stopped, every process on the box whose
    environment holds ``DDPQ_JOB_ID=<job_id>`` and the artifact directory of one of
    ``hosts`` (other tests' jobs have ids too), by its ``DDPQ_ATTEMPT``."""

    def __init__(self, job_id: int, hosts: list[Host], every_s: float = 0.2) -> None:
        self.job_tag = f"DDPQ_JOB_ID={job_id}".encode()
        self.dirs = {f"DDPQ_ARTIFACT_DIR={h.artifact_dir}".encode(): h.name for h in hosts}
        self.every_s = every_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> AttemptScan:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> None:
        at = time.time()
        seen: dict[int, set[str]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    entries = set(f.read().split(b"\0"))
            except OSError:  # it exited meanwhile (a zombie reads as empty: not alive)
                continue
            if self.job_tag not in entries:
                continue
            host = next((name for tag, name in self.dirs.items() if tag in entries), None)
            attempt = next((e for e in entries if e.startswith(b"DDPQ_ATTEMPT=")), None)
            if host is not None and attempt is not None:
                seen.setdefault(int(attempt.split(b"=", 1)[1]), set()).add(host)
        self.samples.append(Sample(at, {a: frozenset(h) for a, h in seen.items()}))

    def times_of(self, attempt: int) -> list[float]:
        """When samples saw processes of ``attempt``."""
        return [s.at for s in self.samples if attempt in s.attempts]


@contextlib.contextmanager
def partition_cluster(tmp_path: Path, url: str, hub: RootHub) -> Iterator[Cluster]:
    """A Cluster in ``hub`` with the lease ``LEASE_S``, closed (no process of it left)."""
    cluster = Cluster(tmp_path, url, netns=hub, lease_s=LEASE_S)
    try:
        yield cluster
    finally:
        cluster.close()
        needles = [f"DDPQ_ARTIFACT_DIR={h.artifact_dir}".encode() for h in cluster.hosts]
        wait_for(
            lambda: not any(find_tagged_processes(frozenset({n})) for n in needles),
            30,
            "no rank process to be left",
        )


def worker_id_of(cluster: Cluster, proc: Proc) -> str | None:
    """The id of ``proc``'s worker once it is registered and live."""
    if proc.popen.poll() is not None:
        raise AssertionError(f"{proc.name} exited:\n{proc.output()}")
    r = cluster.http.get("/workers")
    assert r.status_code == 200, r.text
    for w in r.json()["workers"]:
        if w["pid"] == proc.popen.pid and w["status"] == "live":
            return str(w["id"])
    return None


def two_checkpoints(cluster: Cluster, job_id: int) -> bool:
    """Two checkpoints of the job are committed."""
    return len(cluster.checkpoints(job_id)) >= 2


def running_attempt(cluster: Cluster, job_id: int) -> int | None:
    """The job's attempt while it is ``running``."""
    job = cluster.job(job_id)
    return int(job["attempt"]) if job["state"] == "running" else None


def waited(
    cluster: Cluster, job_id: int, predicate: Callable[[], Any], timeout_s: float, what: str
) -> Any:
    """``wait_for``, failing with the cluster's diagnostics (logs) for ``job_id``."""
    try:
        return wait_for(predicate, timeout_s, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.diagnostics(job_id)}") from None


def log_of(proc: Proc, start: int = 0) -> str:
    """``proc``'s whole output from byte ``start`` (``Proc.output`` keeps only its tail)."""
    return proc.log_path.read_bytes()[start:].decode(errors="replace")


@pytest.mark.slow
def test_a_partitioned_worker_never_runs_its_job_beside_the_requeued_attempt(
    tmp_path: Path, root_hub: RootHub, pg_schema_url: str
) -> None:
    budget_s = stop_budget_for(
        LEASE_S, DEFAULT_CANCEL_GRACE_S + CONNECT_TIMEOUT_S + READ_TIMEOUT_S, HEARTBEAT_S
    )
    assert budget_s < LEASE_S / 2, f"the fence's budget {budget_s} s must fit in the lease"
    with partition_cluster(tmp_path, pg_schema_url, root_hub) as cluster:
        host_b, host_c = cluster.add_host("host-b"), cluster.add_host("host-c")
        worker_b = cluster.start_worker(host_b)
        id_b = wait_for(lambda: worker_id_of(cluster, worker_b), 120, "worker B to register")
        job_id = cluster.submit(long_regression())
        with AttemptScan(job_id, [host_b, host_c]) as scan:
            job = cluster.wait_state(job_id, ("running",), 180)
            assert job["worker_id"] == id_b, job
            worker_c = cluster.start_worker(host_c)
            id_c = wait_for(lambda: worker_id_of(cluster, worker_c), 120, "worker C to register")
            waited(cluster, job_id, lambda: two_checkpoints(cluster, job_id), 180,
                   "two checkpoints")  # fmt: skip

            cluster.cut(host_b)
            cut_at = time.time()
            before = cluster.checkpoints(job_id)
            newest = max(c["step"] for c in before)
            fence_line = waited(
                cluster, job_id, lambda: re.search(rf".*{FENCE_LOG}.*", log_of(worker_b)),
                LEASE_S, f"worker B to log {FENCE_LOG!r} (its lease fence)",
            )  # fmt: skip
            fenced_after_s = time.time() - cut_at
            waited(cluster, job_id, lambda: running_attempt(cluster, job_id) == 2, 2 * LEASE_S,
                   "attempt 2 to run")  # fmt: skip
            time.sleep(max(0.0, cut_at + 2 * LEASE_S - time.time()))

            healed_log_at = worker_b.log_path.stat().st_size
            cluster.heal(host_b)
            healed_at = time.time()
            back = "ticks succeed again"
            waited(cluster, job_id, lambda: back in log_of(worker_b, healed_log_at), 60,
                   "worker B to reach the API after the heal")  # fmt: skip
            waited(cluster, job_id, lambda: worker_id_of(cluster, worker_b) == id_b, 30,
                   "worker B to be live again")  # fmt: skip
            after_heal = cluster.job(job_id)
            job = cluster.wait_state(job_id, ("succeeded",), 300)
            scan.sample()

        diagnostics = cluster.diagnostics(job_id)
        timeline = (
            f"cut at {cut_at:.1f}; fence logged {fenced_after_s:.1f} s after the cut "
            f"(budget {budget_s} s); healed at +{healed_at - cut_at:.1f} s"
        )

        # One host at a time: no sample holds two attempts' processes; both were seen.
        both = [s for s in scan.samples if len(s.attempts) > 1]
        assert not both, (
            f"{len(both)} samples saw two attempts alive at once, first at "
            f"+{both[0].at - cut_at:.1f} s: {both[0].attempts}; {timeline}\n{diagnostics}"
        )
        seen_1, seen_2 = scan.times_of(1), scan.times_of(2)
        assert seen_1 and seen_2, (
            f"the scan ({len(scan.samples)} samples) saw attempt 1 in {len(seen_1)} and "
            f"attempt 2 in {len(seen_2)}: it proves nothing unless it saw both\n{diagnostics}"
        )
        hosts_of = {a: {h for s in scan.samples for h in s.attempts.get(a, ())} for a in (1, 2)}
        assert hosts_of == {1: {"host-b"}, 2: {"host-c"}}, hosts_of

        # The fence stopped attempt 1 on B before the API's lease lapsed (the requeue).
        assert fence_line is not None
        assert f"job_id={job_id} attempt=1 {FENCE_LOG}" in fence_line.group(0), fence_line[0]
        assert fenced_after_s < LEASE_S - budget_s + 5, timeline
        events = cluster.events(job_id)
        lost = [e for e in events if e["kind"] == "worker_lost"]
        # The requeue is attempt 2's first event (queued), the claim its second.
        assert len(lost) == 1 and lost[0]["attempt"] == 2, lost
        lapsed_at = datetime.fromisoformat(lost[0]["created_at"]).timestamp()
        assert max(seen_1) < lapsed_at < min(seen_2), (
            f"attempt 1's processes last seen at +{max(seen_1) - cut_at:.1f} s, the lease "
            f"lapsed (worker_lost) at +{lapsed_at - cut_at:.1f} s, attempt 2's processes first "
            f"seen at +{min(seen_2) - cut_at:.1f} s; {timeline}"
        )

        # The job's history: B's attempt lost with its lease, C's attempt ran to the end.
        changes = [(e["kind"], e["attempt"], e["worker_id"]) for e in events
                   if e["from_state"] != e["to_state"]]  # fmt: skip
        kinds = [kind for kind, _, _ in changes]
        assert kinds == ["submitted", "claimed", "launched", "worker_lost", "claimed",
                         "launched", "succeeded"], changes  # fmt: skip
        assert changes[1][1:] == (1, id_b) and changes[4][1:] == (2, id_c), (changes, id_b, id_c)
        assert (job["attempt"], job["worker_id"]) == (2, id_c), job

        # Attempt 2 resumed from the newest checkpoint committed before the partition;
        # attempt 1 committed none after it; every step is stored once.
        entries = cluster.checkpoints(job_id)
        assert max(c["step"] for c in entries if c["attempt"] == 1) == newest, entries
        r = cluster.http.get(f"/jobs/{job_id}/goodput")
        assert r.status_code == 200, r.text
        resumed = {a["attempt"]: a["resume_step"] for a in r.json()["attempts"]}
        assert resumed.get(2) == newest, f"attempt 2 resumed from {resumed}, not {newest}"
        steps, first_of_2 = cluster.loss_steps(job_id)
        total = job["progress"]["total_steps"]
        assert total == EPOCHS * 32, job["progress"]
        assert first_of_2 == newest + 1, (
            f"attempt 2's first loss at step {first_of_2}, not after the newest checkpoint "
            f"{newest}\n{diagnostics}"
        )
        missing = sorted(set(range(1, total + 1)) - set(steps))
        assert steps == list(range(1, total + 1)), (
            f"one loss row per step across attempts; missing {missing[:20]}, {len(steps)} rows "
            f"for {total} steps\n{diagnostics}"
        )
        log_c = cluster.rank_log(host_c, job_id, 2)
        assert f"checkpoint step={newest} not on this host; downloading" in log_c, log_c[-3000:]

        # B after the heal: alive, holding nothing, claiming nothing, while attempt 2 ran on.
        assert (after_heal["state"], after_heal["attempt"]) == ("running", 2), (
            f"the job must still run on C when B comes back: {after_heal}; {timeline}"
        )
        assert worker_b.popen.poll() is None, f"worker B exited:\n{log_of(worker_b)[-8000:]}"
        b_after = log_of(worker_b, healed_log_at)
        for word in ("claimed", "requeueing", "Traceback", "attempt=2"):
            assert word not in b_after, f"worker B after the heal logged {word!r}:\n{b_after}"
        assert log_of(worker_b).count(f"job_id={job_id} attempt=1 claimed") == 1
