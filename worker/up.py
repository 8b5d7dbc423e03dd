"""``ddpq up``: run the API and one local worker as child processes until Ctrl-C or
SIGTERM, and stop both cleanly (the worker requeues its running jobs). It is ready (its ready
line, the API's /readyz) once its worker has registered, so a job submitted then finds a
worker. The CLI migrates the database and mints the worker's token first
(``service.cli.main.up``); this module never opens the database.

The worker talks to the API over loopback with that token, exactly as a worker on another
host would: its environment holds no database URL. The API server (``python -m worker.up
serve-api``) and the worker are non-dumpable (``make_undumpable``): the first holds the
database URL, the second the worker token. The worker's ranks report to the API at
``settings.resolved_api_url``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from pydantic import SecretStr

from service.core.config import Settings, local_url
from service.core.wire import API_PREFIX
from worker.attempt import API_URL
from worker.errors import ChildExitedError, PortInUseError
from worker.main import ensure_logging, stop_on_signals
from worker.processes import make_undumpable, parent_death_preexec

log = logging.getLogger(__name__)

API_READY_TIMEOUT_S = 60.0
WORKER_READY_TIMEOUT_S = 60.0
WORKER_STOP_TIMEOUT_S = 60.0  # the worker stops and requeues its jobs (grace per job: 10 s)
API_STOP_TIMEOUT_S = 15.0


# What only API processes hold: a worker's environment never carries it.
API_ONLY_SETTINGS = frozenset({"database_url"})


def settings_env(settings: Settings, *, leave_out: frozenset[str] = frozenset()) -> dict[str, str]:
    """``settings`` as ``DDPQ_*`` environment variables, so child processes see the same
    configuration (lists as JSON, secrets in clear, unset values and the fields named in
    ``leave_out`` left out)."""
    env: dict[str, str] = {}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if value is None or name in leave_out:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, list | dict):
            value = json.dumps(value)
        env[f"DDPQ_{name.upper()}"] = str(value)
    return env


# Seconds the probe of a taken port waits for an answer (a local server answers in ms).
PROBE_TIMEOUT_S = 2.0


def running_ddpq_url(host: str, port: int) -> str | None:
    """The URL of a ddpq API that serves ``host:port`` already (it answers ddpq's own
    ``{API_PREFIX}/healthz`` with ``{"status": "ok"}``, which needs no token); None when
    whatever holds the port is something else or does not answer."""
    url = local_url(host, port)
    try:
        # This machine's own port: never through an HTTP(S)_PROXY from the environment.
        answer = httpx.get(f"{url}{API_PREFIX}/healthz", timeout=PROBE_TIMEOUT_S, trust_env=False)
        body = answer.json() if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return url if body == {"status": "ok"} else None


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` briefly (with SO_REUSEADDR, as uvicorn does) to see it is free.

    Raises:
        PortInUseError: another process listens there; when it is ddpq's API (a `ddpq up`
            or `ddpq serve` running already), the message gives its URL and says to use it
            or stop it first; else it says how to pick another port.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    taken: str | None = None  # why the bind failed
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            taken = exc.strerror or "address in use"
    if taken is None:
        return
    url = running_ddpq_url(host, port)
    if url is not None:
        raise PortInUseError(
            f"ddpq already runs at {url} (port {port} answers ddpq's API): use that one "
            f"(`ddpq submit SPEC` and `ddpq run -- train.py` reach it with DDPQ_API_URL={url}), "
            "or stop it first (Ctrl-C where it runs) and start `ddpq up` again"
        )
    raise PortInUseError(
        f"cannot serve on {host}:{port}: {taken}. Stop the process using it "
        "or choose another port (DDPQ_PORT or --port)."
    )


@dataclass
class Child:
    """A supervised child process."""

    name: str
    popen: subprocess.Popen[bytes]
    stop_timeout_s: float


def spawn(name: str, argv: list[str], env: dict[str, str], stop_timeout_s: float) -> Child:
    """Start ``argv`` in its own session (so a terminal's Ctrl-C reaches only us, and we
    decide the stop order), dying with us if we are killed."""
    popen = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=parent_death_preexec(signal.SIGTERM),
    )
    log.info("started %s (pid %d)", name, popen.pid)
    return Child(name, popen, stop_timeout_s)


def stop_child(child: Child) -> None:
    """SIGTERM the child's process group, SIGKILL it after its stop timeout, reap it."""
    timeout_s = child.stop_timeout_s
    if child.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.popen.pid, signal.SIGTERM)
        try:
            child.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", child.name, timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.popen.pid, signal.SIGKILL)
    child.popen.wait()


def wait_until_ready(child: Child, url: str, timeout_s: float) -> None:
    """Poll ``url`` until it answers 200.

    Raises:
        ChildExitedError: the child exited first, or ``timeout_s`` seconds passed.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.popen.poll() is not None:
            raise ChildExitedError(
                f"the {child.name} exited with code {child.popen.returncode} before it was "
                "ready; see its output above"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise ChildExitedError(f"the {child.name} did not answer {url} within {timeout_s:.0f} s")


def _print_line(text: str) -> None:
    print(text, flush=True)  # user-facing output of the `ddpq up` command


def worker_env(settings: Settings, worker_token: str, base: dict[str, str]) -> dict[str, str]:
    """The environment of a worker process: ``base`` (e.g. ``os.environ``) without a database
    URL, ``settings`` as ``DDPQ_*`` variables (but the database URL), the worker token, and
    the API URL its ranks report to."""
    env = {k: v for k, v in base.items() if k != "DDPQ_DATABASE_URL"}
    return {
        **env,
        **settings_env(settings, leave_out=API_ONLY_SETTINGS),
        "DDPQ_WORKER_TOKEN": worker_token,
        API_URL: settings.resolved_api_url,
    }


def run_up(
    settings: Settings,
    *,
    worker_token: str,
    announce: Callable[[str], None] = _print_line,
    stop: threading.Event | None = None,
) -> None:
    """Serve the API on ``settings.host:port`` and run one local worker with
    ``worker_token`` (a worker token: the worker reaches the API over loopback, as any
    worker does), until SIGTERM/SIGINT (or ``stop``); then stop the worker (it requeues
    running jobs), then the API. No child process outlives this call. The database must be
    migrated already.

    Raises:
        PortInUseError: the port is taken.
        ChildExitedError: the API or the worker exited on its own.
    """
    ensure_logging()
    make_undumpable()
    stop = stop or threading.Event()
    check_port_free(settings.host, settings.port)
    _run_children(settings, worker_token, announce, stop)


def _run_children(
    settings: Settings, worker_token: str, announce: Callable[[str], None], stop: threading.Event
) -> None:
    # The API's /readyz waits for a live local worker (expect_worker), as the ready line
    # below does. The API needs no worker token; the worker gets no database URL.
    api_env = {
        **{k: v for k, v in os.environ.items() if k != "DDPQ_WORKER_TOKEN"},
        **settings_env(settings, leave_out=frozenset({"worker_token"})),
        "DDPQ_EXPECT_WORKER": "local",
    }
    env = worker_env(settings, worker_token, dict(os.environ))
    py = sys.executable
    api_argv = [py, "-m", "worker.up", "serve-api", settings.host, str(settings.port)]
    children: list[Child] = []
    failed: Child | None = None
    with stop_on_signals(stop):
        try:
            children.append(spawn("API server", api_argv, api_env, API_STOP_TIMEOUT_S))
            url = settings.resolved_api_url
            wait_until_ready(children[0], f"{url}/healthz", API_READY_TIMEOUT_S)
            worker_argv = [py, "-m", "worker.main", "--launcher", "local", "--gpus", "auto"]
            children.append(spawn("worker", worker_argv, env, WORKER_STOP_TIMEOUT_S))
            # /readyz answers 200 once a live local worker has registered: this one.
            wait_until_ready(children[1], f"{url}/readyz", WORKER_READY_TIMEOUT_S)
            announce(f"ddpq is up: dashboard {url}/  ·  API {url}{API_PREFIX}  ·  docs {url}/docs")
            announce("Press Ctrl-C to stop.")
            while not stop.wait(0.5):
                failed = next((c for c in children if c.popen.poll() is not None), None)
                if failed is not None:
                    break
        finally:
            for child in reversed(children):  # the worker first: it requeues running jobs
                stop_child(child)
    if failed is not None:
        raise ChildExitedError(
            f"the {failed.name} exited with code {failed.popen.returncode}; ddpq stopped"
        )
    announce("ddpq stopped.")


def serve_api(host: str, port: int) -> None:
    """Serve ``service.app:create_app`` with uvicorn on ``host:port``, non-dumpable (the API
    holds the database URL, and ranks of the same user run beside it)."""
    import uvicorn

    make_undumpable()
    uvicorn.run("service.app:create_app", factory=True, host=host, port=port, access_log=False)


if __name__ == "__main__":
    # ``python -m worker.up serve-api HOST PORT``: the API child of ``run_up``.
    if len(sys.argv) != 4 or sys.argv[1] != "serve-api":
        sys.exit("usage: python -m worker.up serve-api HOST PORT")
    serve_api(sys.argv[2], int(sys.argv[3]))
