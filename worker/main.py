"""``run_worker``: build a worker from settings and run it until SIGTERM/SIGINT.

A worker reaches only the API (``DDPQ_API_URL``, or ``--api``) with a worker token
(``DDPQ_WORKER_TOKEN``); it refuses to start with a database URL set. Also runnable as
``python -m worker.main [--api URL] [--launcher local] [--gpus 0,1|none|auto] [--slots N]``
(what ``ddpq up`` and the end-to-end tests start).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

from service.core.config import Settings
from service.core.errors import (
    ControlPlaneUnavailableError,
    WorkerTokenMismatchError,
    WorkerTokenRefusedError,
)
from service.core.launchers import launcher_names, uses_host_gpus
from service.core.wire import API_PREFIX
from service.core.wire.worker import WORKER_TOKEN_PREFIX
from worker.api_client import ApiRecords
from worker.errors import LaunchError, WorkerConfigError
from worker.launchers.registry import make_launcher
from worker.loop import WorkerLoop
from worker.processes import make_undumpable

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def make_worker_id() -> str:
    """``<host>-<pid>-<6 random hex digits>``: unique per worker process."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def detect_gpus() -> list[int]:
    """GPU ids this host exposes: ``CUDA_VISIBLE_DEVICES`` if set to integers, else the
    ``/dev/nvidia<N>`` device files (no CUDA import)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        parts = [p.strip() for p in visible.split(",") if p.strip()]
        if all(p.isdigit() for p in parts):
            return [int(p) for p in parts]
    ids = [p.name.removeprefix("nvidia") for p in Path("/dev").glob("nvidia[0-9]*")]
    return sorted(int(i) for i in ids if i.isdigit())


def parse_gpus(text: str) -> list[int] | None:
    """``"0,1"`` → ``[0, 1]``; ``"none"`` → ``[]``; ``"auto"`` or ``""`` → None (detect).

    Raises:
        ValueError: anything else (the message shows the accepted forms).
    """
    text = text.strip().lower()
    if text in ("", "auto"):
        return None
    if text == "none":
        return []
    try:
        ids = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--gpus {text!r}: use a list like 0,1 or 'none' or 'auto'") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"--gpus {text!r}: ids must be distinct and ≥ 0")
    return ids


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Set ``stop`` on SIGTERM/SIGINT while inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _handler(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def ensure_logging() -> None:
    """INFO logs to stderr unless the application configured logging already; httpx's own
    line per request (several a second from a worker's heartbeats and claims) only from
    WARNING up."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        logging.getLogger("httpx").setLevel(logging.WARNING)


def worker_credentials(settings: Settings) -> tuple[str, str]:
    """The API URL and worker token a worker runs with: ``settings.resolved_api_url`` (its
    root: a trailing ``/api/v1`` is dropped) and ``DDPQ_WORKER_TOKEN``.

    Raises:
        WorkerConfigError: a database URL is set (a worker must not hold it; the message says
            what to set instead), no worker token is, it is not a worker token, or the API
            URL is not an http(s) URL of a server's root.
    """
    if settings.database_url:
        raise WorkerConfigError(
            "DDPQ_DATABASE_URL is set: a worker talks only to the API and must not hold the "
            "database's credentials (the ranks it runs are users' code). Unset it here and "
            "give the worker DDPQ_API_URL (or --api) and DDPQ_WORKER_TOKEN (`ddpq token "
            "create --worker` where the database is reachable)."
        )
    token = settings.worker_token.get_secret_value() if settings.worker_token else ""
    if not token:
        raise WorkerConfigError(
            "no worker token: set DDPQ_WORKER_TOKEN to a token from `ddpq token create "
            "--worker [--name HOST]` (run where the database is reachable), and DDPQ_API_URL "
            "(or --api) to the API's URL"
        )
    api_url = settings.resolved_api_url
    parsed = urlsplit(api_url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise WorkerConfigError(
            f"the API URL {api_url!r} is not an http(s) URL: pass --api (or DDPQ_API_URL) like "
            "http://api-host:8000"
        )
    if parsed.path.rstrip("/") == API_PREFIX:  # the URL `ddpq up` prints for the API itself
        api_url = api_url[: -len(parsed.path)]
    elif parsed.path.strip("/"):
        raise WorkerConfigError(
            f"the API URL {api_url!r} has a path: pass the server's root, like "
            f"http://api-host:8000 (not …{parsed.path})"
        )
    if not token.startswith(WORKER_TOKEN_PREFIX):
        raise WorkerConfigError(
            f"DDPQ_WORKER_TOKEN is not a worker token (those start with {WORKER_TOKEN_PREFIX}): "
            "create one with `ddpq token create --worker`; a user's token does not open the "
            "worker API"
        )
    return api_url, token


def run_worker(
    settings: Settings,
    *,
    launcher: str = "local",
    gpus: list[int] | None = None,
    slots: int = 1,
    stop: threading.Event | None = None,
) -> None:
    """Run a worker until SIGTERM/SIGINT (or ``stop`` is set), then shut down cleanly:
    stop claiming, stop held jobs' processes and requeue them, mark the worker stopped.
    A Slurm worker instead adopts the Slurm jobs of lost or stopped workers as it runs, and
    at shutdown leaves its own running in Slurm for the next Slurm worker to adopt.

    Args:
        settings: the API's URL (``resolved_api_url``), the worker token, the artifact dir,
            the heartbeat interval (seconds); the lease is the API's (each answer says it).
        launcher: ``"local"`` (torchrun on this host) or ``"slurm"``.
        gpus: GPU ids this worker may hand out to local jobs; ``[]`` for none; None to
            detect them (``detect_gpus``).
        slots: how many jobs it runs at once.
        stop: set it to stop the worker from another thread.
    The process makes itself non-dumpable first (``worker.processes.make_undumpable``): it
    holds the worker token, and its ranks (the same user, unless ``DDPQ_RANK_USERS``) must
    not read it from ``/proc/<worker pid>/environ`` or its memory. The ranks get the API's
    URL (the worker's own: set ``DDPQ_API_URL`` on a worker that does not run beside the
    API) and a per-attempt token the claim brought, never the worker token.

    Raises:
        WorkerConfigError: a database URL is set, or no worker token (``worker_credentials``).
        WorkerTokenRefusedError / WorkerTokenMismatchError: the API refused the token (e.g.
            revoked); the ranks of the worker's jobs were stopped first.
        LaunchError: unknown launcher; ``DDPQ_RANK_USERS`` (or ``DDPQ_RANK_USER``) set but
            not running as root, or a user it names does not exist; users' code allowed with
            auth on but neither set.
    """
    ensure_logging()
    api_url, token = worker_credentials(settings)
    make_undumpable()
    user_code_here = uses_host_gpus(launcher) and settings.user_code == "allow"
    mapped = settings.rank_user_map.configured
    if user_code_here and settings.auth_enabled and not mapped:
        # With auth on, several people's scripts run here: never as the worker's user, who
        # holds the database URL and every job's files.
        raise LaunchError(
            "DDPQ_USER_CODE=allow with auth on runs users' own scripts on this host: set "
            "DDPQ_RANK_USERS (each owner's unprivileged Unix user, e.g. "
            '\'{"alice": "alice", "*": "ddpq-rank"}\') and run the worker as root, so they '
            "cannot reach the worker's credentials nor each other's files, or set "
            "DDPQ_USER_CODE=deny"
        )
    if uses_host_gpus(launcher) and os.geteuid() == 0 and not mapped:
        # Root's ranks are root too: CAP_SYS_PTRACE reads any /proc/<pid>/environ, dumpable
        # or not, and every file; only another Unix user keeps them out.
        log.warning(
            "this worker runs as root without DDPQ_RANK_USERS: its ranks (users' code) run "
            "as root and can read the worker's environment (its worker token) and every job's "
            "files; set DDPQ_RANK_USERS (owner → unprivileged Unix user) or DDPQ_RANK_USER "
            "(README, Security model)"
        )
    stop = stop or threading.Event()
    if gpus is None:
        gpus = detect_gpus() if uses_host_gpus(launcher) else []
    built = make_launcher(launcher, settings)
    records = ApiRecords(api_url, token, make_worker_id(), built.name, lease_s=settings.lease_s)
    log.info("worker API: %s", api_url)
    loop = WorkerLoop(
        settings,
        records,
        built,
        host=socket.gethostname(),
        pid=os.getpid(),
        slots=slots,
        gpus=gpus,
    )
    try:
        _first_registration(loop)
        with stop_on_signals(stop):
            loop.run(stop)
    finally:
        records.close()


def _first_registration(loop: WorkerLoop) -> None:
    """Register once before the loop starts, so that a token the API refuses stops the worker
    at start with a clear message (a token revoked later stops it as it runs). An API
    that does not answer yet is left to the loop, which retries.

    Raises:
        WorkerConfigError: the API refused the token, or the id belongs to another token.
    """
    try:
        loop.register()
    except (WorkerTokenRefusedError, WorkerTokenMismatchError) as exc:
        raise WorkerConfigError(str(exc.detail)) from None
    except ControlPlaneUnavailableError as exc:
        log.warning("API not reachable yet (%s); retrying", exc)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m worker.main``: parse flags, then ``run_worker`` with ``Settings()``."""
    parser = argparse.ArgumentParser(prog="python -m worker.main", description=__doc__)
    parser.add_argument("--api", default=None, help="the API's URL (default: DDPQ_API_URL)")
    parser.add_argument("--launcher", choices=launcher_names(), default="local")
    parser.add_argument("--gpus", default="auto", help="0,1 | none | auto (default)")
    parser.add_argument("--slots", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        gpus = parse_gpus(args.gpus)
    except ValueError as exc:
        parser.error(str(exc))
    settings = Settings()
    if args.api:
        settings = settings.model_copy(update={"api_url": args.api})
    try:
        run_worker(settings, launcher=args.launcher, gpus=gpus, slots=args.slots)
    except (WorkerConfigError, WorkerTokenRefusedError, WorkerTokenMismatchError) as exc:
        parser.exit(2, f"worker: {exc.detail}\n")


if __name__ == "__main__":
    main()
