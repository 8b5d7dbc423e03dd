"""Hosts that share no filesystem, for end-to-end tests: an API and workers, each with an
artifact directory of its own, optionally each in a network namespace of its own (``ip netns``
+ veth pairs, as root) so that a worker host reaches nothing but the API's port.

Topology with ``Namespaces``: the API's namespace is the hub; every worker namespace and the
test process (the root namespace) get a veth pair to it, a /30 each, no forwarding. A worker's
only route leads to the API's namespace, where only the API listens. The database is a SQLite
file (a file, not a port: the workers and the API open it through the one kernel) or, on
loopback, PostgreSQL.

Topology with ``RootHub``: the root namespace is the hub, so the API runs beside PostgreSQL
(which listens on the root's 127.0.0.1) and the database may be PostgreSQL. The API binds one
address of the root, ``api_ip`` (a /32 on a veth pair of the root's own, as the kernel here has
no dummy links); each worker namespace gets a veth pair to the root with a /32 at its end and a
route to ``api_ip`` alone: no other address of the root, and no other namespace, is routed to.
No IPv6 on these links. There is no firewall: a root listener on a wildcard address answers at
``api_ip`` too (PostgreSQL listens on loopback only, and the tests check it cannot be reached).

A partition (``cut``/``heal``, either topology): a worker host's end of its veth pair is set
down inside the host's namespace, so the host reaches nothing (a connect fails at once: the
kernel drops the link's routes), the API and the other hosts carry on; ``heal`` sets it up and
puts back the routes the kernel dropped.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy import func, select

from service.core.config import Settings
from service.core.wire import API_PREFIX
from service.store import migrate
from service.store.db import Database
from service.store.models import Metric
from tests.e2e.jobs_http import JobsOverHttp, Proc, wait_for
from tests.workers import mint_worker_token, worker_environ
from worker.processes import find_tagged_processes
from worker.up import settings_env

REPO = Path(__file__).resolve().parents[2]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Namespaces:
    """Network namespaces wired as a star around the API's (see the module docstring).

    Raises (``create``):
        OSError / subprocess.CalledProcessError: namespaces cannot be made here (not root,
            no ``ip``, a sandbox without CAP_SYS_ADMIN): the caller skips.
    """

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.subnet = 100 + secrets.randbelow(100)  # 10.<subnet>.<link>.0/30
        self.names: list[str] = []
        self.links = 0
        # A worker namespace → its end of the veth pair and the routes to put back on heal.
        self.ends: dict[str, tuple[str, list[list[str]]]] = {}

    def _ns(self, role: str) -> str:
        name = f"ddpq15-{self.tag}-{role}"
        _ip("netns", "add", name)
        self.names.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def create_hub(self) -> str:
        """The API's namespace (made once); returns its name."""
        if not getattr(self, "hub", None):
            self.hub = self._ns("api")
        return self.hub

    def _link(self, other: str | None) -> tuple[str, str]:
        """A veth pair hub ↔ ``other`` (None: the root namespace); returns (hub IP, other IP)."""
        self.links += 1
        n = self.links
        hub_end, other_end = f"d15{self.tag}h{n}", f"d15{self.tag}o{n}"
        _ip("link", "add", hub_end, "type", "veth", "peer", "name", other_end)
        _ip("link", "set", hub_end, "netns", self.hub)
        hub_ip, other_ip = f"10.{self.subnet}.{n}.1", f"10.{self.subnet}.{n}.2"
        _ip("-n", self.hub, "addr", "add", f"{hub_ip}/30", "dev", hub_end)
        _ip("-n", self.hub, "link", "set", hub_end, "up")
        if other is not None:
            _ip("link", "set", other_end, "netns", other)
            _ip("-n", other, "addr", "add", f"{other_ip}/30", "dev", other_end)
            _ip("-n", other, "link", "set", other_end, "up")
            self.ends[other] = (other_end, [])  # a /30: its prefix route comes back by itself
        else:
            _ip("addr", "add", f"{other_ip}/30", "dev", other_end)
            _ip("link", "set", other_end, "up")
        return hub_ip, other_ip

    def api_endpoint(self) -> tuple[str | None, str, str, int]:
        """Where the API runs: (its namespace, None for the root; the address it binds; the
        address the test process reaches it at; its port)."""
        return self.create_hub(), "0.0.0.0", self.root_link(), 8000

    def root_link(self) -> str:
        """Link the root namespace (the test) to the hub; returns the hub's IP on it (the
        root's end is ``root_ip``)."""
        hub_ip, self.root_ip = self._link(None)
        return hub_ip

    def worker_ns(self, role: str) -> tuple[str, str]:
        """A worker host's namespace linked to the hub; returns (name, the API's IP from it)."""
        name = self._ns(role)
        return name, self._link(name)[0]

    def cut(self, netns: str) -> None:
        """Partition worker namespace ``netns`` from everything: its veth end down."""
        dev, _ = self.ends[netns]
        _ip("-n", netns, "link", "set", dev, "down")

    def heal(self, netns: str) -> None:
        """Undo ``cut``: the veth end up again, with the routes that went down with it."""
        dev, routes = self.ends[netns]
        _ip("-n", netns, "link", "set", dev, "up")
        for route in routes:
            _ip("-n", netns, "route", "replace", *route)

    def destroy(self) -> None:
        """Delete every namespace (their veth ends, and so the pairs, go with them)."""
        for name in reversed(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


class RootHub(Namespaces):
    """Worker namespaces wired as a star around the root namespace, the API's (see the module
    docstring): the API binds ``api_ip``, the only address of the root a worker routes to.

    Raises (``create_hub``):
        OSError / subprocess.CalledProcessError: namespaces cannot be made here: the caller
            skips.
    """

    def __init__(self) -> None:
        super().__init__()
        self.subnet = 200 + secrets.randbelow(50)  # apart from Namespaces' 10.100-199
        self.api_ip = f"10.{self.subnet}.0.1"
        self.root_ends: list[str] = []

    def _veth(self, name: str, peer: str) -> None:
        """A veth pair in the root, both ends without IPv6 (no link-local address)."""
        _ip("link", "add", name, "type", "veth", "peer", "name", peer)
        self.root_ends.append(name)
        for end in (name, peer):
            _ip("link", "set", end, "addrgenmode", "none")

    def create_hub(self) -> str:
        """The root's link that holds ``api_ip`` (made once); returns its name."""
        if not getattr(self, "hub", None):
            name = f"d25{self.tag}api"
            self._veth(name, f"d25{self.tag}apx")
            _ip("addr", "add", f"{self.api_ip}/32", "dev", name)
            _ip("link", "set", f"d25{self.tag}apx", "up")
            _ip("link", "set", name, "up")
            self.hub = name
        return self.hub

    def api_endpoint(self) -> tuple[str | None, str, str, int]:
        self.create_hub()
        return None, self.api_ip, self.api_ip, _free_port()

    def root_link(self) -> str:
        raise NotImplementedError("the test process is in the hub already: use api_ip")

    def _link(self, other: str | None) -> tuple[str, str]:
        """A veth pair root ↔ ``other``: a /32 at ``other``'s end, a route each way between
        it and ``api_ip``; returns (``api_ip``, ``other``'s IP)."""
        if other is None:
            raise ValueError("the root is the hub: link a worker namespace")
        self.create_hub()
        self.links += 1
        n = self.links
        root_end, other_end = f"d25{self.tag}h{n}", f"d25{self.tag}o{n}"
        self._veth(root_end, other_end)
        _ip("link", "set", other_end, "netns", other)
        other_ip = f"10.{self.subnet}.{n}.2"
        _ip("link", "set", root_end, "up")
        _ip("route", "add", f"{other_ip}/32", "dev", root_end, "src", self.api_ip)
        _ip("-n", other, "addr", "add", f"{other_ip}/32", "dev", other_end)
        _ip("-n", other, "link", "set", other_end, "up")
        route = [f"{self.api_ip}/32", "dev", other_end, "src", other_ip]
        _ip("-n", other, "route", "add", *route)
        self.ends[other] = (other_end, [route])  # the kernel drops it when the link goes down
        return self.api_ip, other_ip

    def destroy(self) -> None:
        """Delete every namespace and the root's links (each pair goes with either end)."""
        super().destroy()
        for name in self.root_ends:
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)


def reachable(netns: str, host: str, port: int) -> bool:
    """Whether a TCP connect from ``netns`` to ``host:port`` succeeds (within 3 s)."""
    code = (
        "import socket,sys\n"
        f"s=socket.socket(); s.settimeout(3)\n"
        f"sys.exit(0 if s.connect_ex(({host!r},{port}))==0 else 1)\n"
    )
    argv = ["ip", "netns", "exec", netns, sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0


@dataclass
class Host:
    """A worker host: its artifact directory, and its namespace (None: loopback)."""

    name: str
    artifact_dir: Path
    netns: str | None = None
    api_url: str = ""


class Cluster(JobsOverHttp):
    """One API (its own artifact directory) and worker hosts, on one database.

    Args:
        tmp_path: where directories and logs go.
        database_url: the database (SQLite file; PostgreSQL on loopback or with ``RootHub``).
        store: ``DDPQ_CHECKPOINT_STORE`` of the API.
        netns: a ``Namespaces`` (or ``RootHub``) to put the API and hosts in (None: all on
            loopback).
        lease_s: the API's lease (seconds): a worker's jobs are requeued this long after its
            last renewal.
    """

    def __init__(
        self, tmp_path: Path, database_url: str, *, store: str = "filesystem",
        netns: Namespaces | None = None, lease_s: float = 15,
    ) -> None:  # fmt: skip
        self.tmp_path, self.netns = tmp_path, netns
        self.procs: list[Proc] = []
        self.hosts: list[Host] = []
        self.base = Settings(
            home=tmp_path / "api" / ".ddpq", database_url=database_url,
            artifact_dir=tmp_path / "api" / "artifacts", auth="off",
            heartbeat_interval_s=0.3, lease_s=lease_s, allowed_entrypoints=["examples.*:*"],
            checkpoint_store=store,  # type: ignore[arg-type]
        )  # fmt: skip
        self.db = Database.from_url(self.base.resolved_database_url)
        migrate.upgrade(self.db.engine)
        if netns is not None:
            api_ns, bind, host, port = netns.api_endpoint()
        else:
            api_ns, bind, host, port = None, "127.0.0.1", "127.0.0.1", _free_port()
        self.base = self.base.model_copy(update={"port": port})
        env = self._env(self.base)
        argv = [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app",
                "--host", bind, "--port", str(port), "--no-access-log"]  # fmt: skip
        self.api = self._spawn("api", argv, env, api_ns)
        self.url = f"http://{host}:{port}"
        self.port = port
        self.http = httpx.Client(base_url=self.url + API_PREFIX, timeout=30, trust_env=False)
        wait_for(self._ready, 90, "the API to answer /readyz")

    @staticmethod
    def _env(settings: Settings) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDPQ_")}
        return {**env, **settings_env(settings), "PYTHONUNBUFFERED": "1"}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], netns: str | None) -> Proc:
        proc = Proc(name, argv, env, self.tmp_path / f"{name}-{len(self.procs)}.log", netns)
        self.procs.append(proc)
        return proc

    def _ready(self) -> bool:
        if self.api.popen.poll() is not None:
            raise AssertionError(f"the API exited:\n{self.api.output()}")
        try:
            return httpx.get(self.url + "/readyz", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def add_host(self, name: str) -> Host:
        """A worker host with an empty artifact directory of its own (and namespace)."""
        host = Host(name, self.tmp_path / name / "artifacts")
        if self.netns is not None:
            host.netns, api_ip = self.netns.worker_ns(name)
            host.api_url = f"http://{api_ip}:{self.port}"
        else:
            host.api_url = self.url
        self.hosts.append(host)
        return host

    def worker_env(self, host: Host) -> dict[str, str]:
        """The environment of a worker on ``host``: its own artifact dir, the API by its URL
        and a worker token; no database URL."""
        settings = self.base.model_copy(
            update={"artifact_dir": host.artifact_dir, "api_url": host.api_url}
        )
        if not getattr(self, "worker_token", None):
            self.worker_token = mint_worker_token(self.db)
        base = {k: v for k, v in os.environ.items() if not k.startswith("DDPQ_")}
        return {**worker_environ(settings, self.worker_token, base), "PYTHONUNBUFFERED": "1"}

    def start_worker(self, host: Host, **extra: str) -> Proc:
        """``python -m worker.main`` on ``host``, with ``worker_env(host)`` (and ``extra``)."""
        env = {**self.worker_env(host), **extra}
        argv = [sys.executable, "-m", "worker.main", "--slots", "1", "--gpus", "none"]
        return self._spawn(f"worker-{host.name}", argv, env, host.netns)

    def cut(self, host: Host) -> None:
        """Partition ``host`` (in a namespace) from the API and every other host."""
        assert self.netns is not None and host.netns is not None, "a partition needs namespaces"
        self.netns.cut(host.netns)

    def heal(self, host: Host) -> None:
        """End ``cut(host)``: it reaches the API again."""
        assert self.netns is not None and host.netns is not None, "a partition needs namespaces"
        self.netns.heal(host.netns)

    # -- the API, as a user sees it --------------------------------------------------------------
    def loss_steps(self, job_id: int) -> tuple[list[int], int | None]:
        """Every stored ``loss`` step of the job, sorted, and the first step attempt 2 wrote."""
        with self.db.session(write=False) as s:
            steps = s.scalars(
                select(Metric.step).where(Metric.job_id == job_id, Metric.name == "loss")
            ).all()
            first_of_2 = s.scalar(
                select(func.min(Metric.step)).where(
                    Metric.job_id == job_id, Metric.name == "loss", Metric.attempt == 2
                )
            )
        return sorted(steps), first_of_2

    def rank_log(self, host: Host, job_id: int, attempt: int, rank: int = 0) -> str:
        path = host.artifact_dir / "jobs" / str(job_id) / f"attempt-{attempt}" / f"rank-{rank}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def processes(self, job_id: int) -> list[int]:
        """Live processes of ``job_id`` on any host of this cluster."""
        found: list[int] = []
        for host in self.hosts:
            needles = {f"DDPQ_ARTIFACT_DIR={host.artifact_dir}".encode(),
                       f"DDPQ_JOB_ID={job_id}".encode()}  # fmt: skip
            found += find_tagged_processes(frozenset(needles))
        return found

    def diagnostics(self, job_id: int) -> str:
        parts = [f"--- {p.name} ({p.log_path.name})\n{p.output()}" for p in self.procs]
        for host in self.hosts:
            for log in sorted((host.artifact_dir / "jobs" / str(job_id)).glob("attempt-*/*.log")):
                parts.append(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(90)
        self.http.close()
        self.db.dispose()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
