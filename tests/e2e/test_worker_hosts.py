"""Workers that hold no database URL and cannot reach the database, end to end: the API and
PostgreSQL in one network namespace, two worker hosts in two others that reach the API's port.

Topology (``hosts.RootHub``): the API runs in the root namespace beside PostgreSQL, which
listens on the root's 127.0.0.1:5432 only. The API binds one address of the root, ``api_ip``
(10.2xx.0.1, on a veth pair of the root's own). Hosts B and C each run ``python -m worker.main``
in a network namespace of its own, linked to the root by a veth pair: a /32 at the host's end
and a route to ``api_ip`` alone (no default route, no IPv6, no route between B and C), each
host with an artifact directory of its own::

    host B ──veth── root namespace ──veth── host C
                    API on api_ip:<port>
                    PostgreSQL on 127.0.0.1:5432

No firewall here: a root listener on a wildcard address would answer at ``api_ip`` too, which
is why the test checks PostgreSQL's port at every address of the root rather than relying on
the routes.

One test (skipped, saying why, where namespaces cannot be made): the environment handed to
each worker holds no database URL; from each host the API's port connects and PostgreSQL's
port connects at no address of the root, and ``psql`` fails where it succeeds from the root;
short 1-rank regression jobs (slots=1 per host) all succeed, run on both hosts (their
``worker_id``), every loss step arrives through the metrics API and every job uploads a
checkpoint; meanwhile every process in the two namespaces (workers, torchrun, ranks) is
sampled and none holds ``DDPQ_DATABASE_URL`` or a ``postgresql`` string in its environment or
command line; afterwards no file the hosts wrote (nor the workers' output) holds the URL.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import make_url

from tests.e2e.hosts import Cluster, Host, RootHub, reachable, wait_for
from worker.processes import find_tagged_processes

REPO = Path(__file__).resolve().parents[2]
JOBS = 4
MAX_STEPS = 6


def short_regression(i: int) -> dict[str, Any]:
    """A 1-rank regression job of ``MAX_STEPS`` steps, ~1.5 s of training, a checkpoint every
    3 steps (uploaded: the host does not share the API's directory)."""
    spec: dict[str, Any] = yaml.safe_load((REPO / "examples" / "regression.yaml").read_text())
    spec["name"] = f"netns-host-{i}"
    spec["config"] = {**spec["config"], "sleep_per_step_ms": 250}
    spec["resources"] = {**spec["resources"], "nproc_per_node": 1}
    spec["training"] = {**spec["training"], "epochs": 1, "max_steps": MAX_STEPS,
                        "checkpoint_every_steps": 3}  # fmt: skip
    return spec


@contextlib.contextmanager
def cluster_on(tmp_path: Path, url: str, hub: RootHub) -> Iterator[Cluster]:
    """A Cluster in ``hub``, closed (no process of it left) at the end."""
    cluster = Cluster(tmp_path, url, netns=hub)
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


class NamespaceScan:
    """Samples every process in the given network namespaces (``/proc/<pid>/ns/net`` is
    the namespace's file, as ``ip netns pids`` finds them) until stopped: what it saw, and
    which held a forbidden string in its environment or command line."""

    def __init__(self, netns: list[str], needles: list[bytes], every_s: float = 0.2) -> None:
        self.inodes = {os.stat(f"/run/netns/{name}").st_ino: name for name in netns}
        self.needles, self.every_s = needles, every_s
        self.seen: dict[int, tuple[str, bytes]] = {}  # pid → (netns, its environ)
        self.offences: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> NamespaceScan:
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
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                netns = self.inodes.get(os.stat(f"/proc/{pid}/ns/net").st_ino)
                if netns is None:
                    continue
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:  # it exited meanwhile
                continue
            self.seen.setdefault(pid, (netns, environ))
            hits = [n.decode() for n in self.needles if n in environ or n in cmdline]
            if hits:
                argv = cmdline.replace(b"\0", b" ").decode(errors="replace")[:300]
                self.offences[pid] = f"{netns} pid {pid} ({argv}) holds {hits}"

    def job_processes(self, job_id: int) -> list[int]:
        """Pids seen whose environment names ``job_id`` (torchrun and its ranks)."""
        tag = f"DDPQ_JOB_ID={job_id}\0".encode()
        return [pid for pid, (_, env) in self.seen.items() if tag in env]


def root_ipv4_addresses() -> list[str]:
    """Every IPv4 address of the root namespace (the API's host)."""
    out = subprocess.run(["ip", "-4", "-j", "addr", "show"], check=True, capture_output=True,
                         text=True, timeout=30).stdout  # fmt: skip
    return sorted({a["local"] for link in json.loads(out) for a in link.get("addr_info", [])})


def psql(
    netns: str | None, host: str, port: int, user: str, dbname: str
) -> subprocess.CompletedProcess[str]:
    """``psql -c 'select 1'`` (3 s connect timeout), from ``netns`` (None: the root)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["PGCONNECT_TIMEOUT"] = "3"
    argv = ["psql", "-h", host, "-p", str(port), "-U", user, "-d", dbname, "-w",
            "-c", "select 1"]  # fmt: skip
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.run([*prefix, *argv], env=env, capture_output=True, text=True, timeout=30)


def files_holding(root: Path, needles: list[bytes]) -> tuple[int, list[str]]:
    """(how many files are under ``root``, those that hold one of ``needles``)."""
    count, found = 0, []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        count += 1
        data = path.read_bytes()
        hits = [n.decode() for n in needles if n in data]
        if hits:
            found.append(f"{path}: {hits}")
    return count, found


@pytest.mark.slow
def test_jobs_run_on_two_namespace_hosts_that_cannot_reach_the_database(
    tmp_path: Path, root_hub: RootHub, pg_schema_url: str
) -> None:
    url = make_url(pg_schema_url)
    pg_port = url.port or 5432
    # What must never reach a worker host: the URL itself (its schema is this test's own),
    # the variable that carries it, the dialect's name.
    needles = [pg_schema_url.encode(), b"DDPQ_DATABASE_URL", b"postgresql"]
    with cluster_on(tmp_path, pg_schema_url, root_hub) as cluster:
        hosts = [cluster.add_host("host-b"), cluster.add_host("host-c")]
        assert pg_schema_url.split("?")[0] in cluster.base.resolved_database_url

        # The environment handed to each worker: the API's URL and a worker token, no database.
        for host in hosts:
            env = cluster.worker_env(host)
            assert "DDPQ_DATABASE_URL" not in env
            bad = {k: v for k, v in env.items()
                   for s in ("postgresql", "sqlite", ".db", pg_schema_url) if s in v}  # fmt: skip
            assert not bad, f"{host.name}'s worker environment names a database: {bad}"
            assert env["DDPQ_API_URL"] == host.api_url and env["DDPQ_WORKER_TOKEN"], env

        check_network(cluster, hosts, str(url.host), pg_port, url.username or "postgres",
                      url.database or "test")  # fmt: skip

        procs = {host.name: cluster.start_worker(host) for host in hosts}
        by_pid = {procs[h.name].popen.pid: h for h in hosts}
        live = wait_for(lambda: live_workers(cluster, by_pid), 120, "both workers to register")
        with NamespaceScan([str(h.netns) for h in hosts], needles) as scan:
            ids = [cluster.submit(short_regression(i)) for i in range(JOBS)]
            jobs = [cluster.wait_state(job_id, ("succeeded",), 240) for job_id in ids]
        scan.sample()

        ran_on: dict[int, Host] = {}
        for job in jobs:
            assert job["attempt"] == 1 and job["error"] is None, job
            host = live.get(job["worker_id"])
            assert host is not None, f"job {job['id']} ran on {job['worker_id']}, not {live}"
            ran_on[job["id"]] = host
            steps = [p["step"] for p in loss_points(cluster, job["id"])]
            assert steps == list(range(1, MAX_STEPS + 1)), (
                f"job {job['id']}: loss steps {steps} through the metrics API\n"
                f"{cluster.diagnostics(job['id'])}"
            )
            assert cluster.checkpoints(job["id"]), f"job {job['id']} uploaded no checkpoint"
            log = cluster.rank_log(host, job["id"], 1)
            assert "checkpoint transport: upload" in log, log[-3000:]
        assert {h.name for h in ran_on.values()} == {"host-b", "host-c"}, (
            f"jobs ran on {sorted(h.name for h in ran_on.values())}: both hosts must run some"
        )

        # Every process of the two hosts, ranks included: no database URL anywhere.
        assert not scan.offences, "\n".join(scan.offences.values())
        for job_id in ids:
            assert scan.job_processes(job_id), (
                f"the scan saw no process of job {job_id} in the worker namespaces "
                f"(it saw {len(scan.seen)} processes): it proves nothing about the ranks"
            )
        assert set(by_pid) <= set(scan.seen), "the scan must see both workers"

    # After the workers stopped: nothing the hosts wrote, nor what the workers printed,
    # holds the URL.
    for host in hosts:
        count, found = files_holding(host.artifact_dir.parent, needles)
        assert count > JOBS, f"{host.name} wrote only {count} files: the scan proves nothing"
        assert not found, f"{host.name}'s files hold the database URL: {found}"
    for proc in procs.values():
        data = proc.log_path.read_bytes()
        assert not [n for n in needles if n in data], f"{proc.name}'s output names the database"


def check_network(
    cluster: Cluster, hosts: list[Host], pg_host: str, pg_port: int, user: str, dbname: str
) -> None:
    """From each host: the API's port connects; PostgreSQL's port at no address of the root
    (the API's host), and ``psql`` fails there; the same ``psql`` from the root succeeds."""
    root = psql(None, pg_host, pg_port, user, dbname)
    assert root.returncode == 0, f"psql from the root must reach PostgreSQL: {root.stderr}"
    api_ip = cluster.url.split("//")[1].split(":")[0]
    addresses = root_ipv4_addresses()
    assert api_ip in addresses and "127.0.0.1" in addresses, addresses
    for host in hosts:
        assert host.netns is not None
        assert reachable(host.netns, api_ip, cluster.port), f"{host.name} must reach the API"
        open_at = [a for a in addresses if reachable(host.netns, a, pg_port)]
        assert not open_at, f"{host.name} reaches PostgreSQL's port {pg_port} at {open_at}"
        denied = psql(host.netns, api_ip, pg_port, user, dbname)
        assert denied.returncode != 0, f"psql from {host.name} connected: {denied.stdout}"
        assert "(1 row)" not in denied.stdout, denied.stdout


def live_workers(cluster: Cluster, by_pid: dict[int, Host]) -> dict[str, Host] | None:
    """Worker id → host once every worker of ``by_pid`` is registered and live."""
    r = cluster.http.get("/workers")
    assert r.status_code == 200, r.text
    live = {w["id"]: by_pid[w["pid"]] for w in r.json()["workers"]
            if w["pid"] in by_pid and w["status"] == "live"}  # fmt: skip
    for proc in cluster.procs:
        if proc.name.startswith("worker-") and proc.popen.poll() is not None:
            raise AssertionError(f"{proc.name} exited:\n{proc.output()}")
    return live if len(live) == len(by_pid) else None


def loss_points(cluster: Cluster, job_id: int) -> list[dict[str, Any]]:
    r = cluster.http.get(f"/jobs/{job_id}/metrics", params={"name": "loss", "limit": 5000})
    assert r.status_code == 200, r.text
    points: list[dict[str, Any]] = r.json()["points"]
    return points
