"""Fixtures for the dashboard tests: a real uvicorn server, a real SQLite database, headless
Chromium (Debian's /usr/bin/chromium driven by Playwright), and pages that record every
console error, page error and dialog so a test can fail on any of them."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.core.artifacts import checkpoint_path, rank_log_path
from service.core.config import Settings
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.store import migrate
from service.store.checkpoints.crud import record_checkpoint
from service.store.db import Database
from service.store.jobs.claims import claim_next_job
from service.store.jobs.crud import Transition, apply_transition
from service.store.metrics.points import MetricPoint, record_metrics
from service.store.workers.registry import register_worker
from tests.live import serve_app
from tests.waiting import wait_until

CHROMIUM = Path("/usr/bin/chromium")
INSTALL_HINT = "install the browser with: bash scripts/install-browser.sh"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
VIEWPORTS = {"desktop": DESKTOP, "phone": PHONE}


def _playwright_available() -> bool:
    return importlib.util.find_spec("playwright") is not None


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium for the session (skips when Chromium or Playwright is missing)."""
    if not CHROMIUM.exists() or not _playwright_available():
        pytest.skip(f"needs {CHROMIUM} and the playwright package; {INSTALL_HINT}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        yield chromium
        chromium.close()


@dataclass
class LiveServer:
    """A running ``create_app(settings)`` on a loopback port, its database, and helpers that
    play a worker's part through the real domain functions (for pages without a worker)."""

    url: str
    settings: Settings
    db: Database
    api: httpx.Client

    def submit(self, name: str, **spec: Any) -> dict[str, Any]:
        """POST a regression job named ``name`` (2 ranks unless ``spec`` says otherwise)."""
        body: dict[str, Any] = {
            "name": name,
            "task": "regression",
            "resources": {"nproc_per_node": 2},
            "training": {"max_steps": 50},
        }
        body.update(spec)
        res = self.api.post("/jobs", json=body)
        assert res.status_code == 201, f"submit {name!r}: {res.status_code} {res.text}"
        job: dict[str, Any] = res.json()
        return job

    def job_count(self) -> int:
        """How many jobs the API lists (up to 500): to check a refused submit stored none."""
        res = self.api.get("/jobs", params={"limit": 500})
        assert res.status_code == 200, res.text
        return len(res.json()["jobs"])

    def start(self, job_id: int, worker_id: str = "seed-worker") -> None:
        """Claim ``job_id`` as ``worker_id`` and move it to running (as a worker would)."""
        with self.db.session() as session:
            register_worker(
                session,
                worker_id=worker_id,
                host="seed-host",
                pid=os.getpid(),
                launcher="local",
                capacity={"slots": 4, "gpus": []},
            )
            job = claim_next_job(
                session, worker_id=worker_id, launcher="local", max_gpus_per_node=0, lease_s=3600
            )
            assert job is not None and job.id == job_id, "seeded jobs need the top priority"
            apply_transition(
                session,
                Transition(job_id, JobState.STARTING, JobState.RUNNING, "ranks started"),
                worker_id=worker_id,
            )

    def report(
        self,
        job_id: int,
        values: list[float],
        *,
        name: str = "loss",
        first_step: int = 1,
        total_steps: int | None = None,
    ) -> None:
        """Record ``values`` at consecutive steps from ``first_step``, plus progress."""
        points = [
            MetricPoint(name=name, step=first_step + i, value=v, epoch=(first_step + i) // 100)
            for i, v in enumerate(values)
        ]
        last = first_step + len(values) - 1
        progress = {
            "step": last,
            "total_steps": total_steps,
            "epoch": last // 100,
            "samples_per_s": 1234.5,
            "eta_s": 95.0,
        }
        with self.db.session() as session:
            record_metrics(session, job_id, 1, points, progress=progress)

    def write_log(self, job_id: int, rank: int, text: str, attempt: int = 1) -> None:
        """Append ``text`` to a rank's log file."""
        path = rank_log_path(self.settings.resolved_artifact_dir, job_id, attempt, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(text)

    def checkpoint(self, job_id: int, step: int, payload: bytes) -> None:
        """Write a checkpoint file for ``step`` and record it."""
        path = checkpoint_path(self.settings.resolved_artifact_dir, job_id, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload)
        with self.db.session() as session:
            record_checkpoint(
                session,
                job_id,
                1,
                step=step,
                epoch=0,
                path=str(path),
                size_bytes=len(payload),
                sha256=hashlib.sha256(payload).hexdigest(),
            )

    def finish(self, job_id: int, target: JobState, error: str | None = None) -> None:
        """Move a running job to a terminal ``target`` (with ``error`` text)."""
        with self.db.session() as session:
            apply_transition(
                session,
                Transition(job_id, JobState.RUNNING, target, f"seeded {target}"),
                worker_id="seed-worker",
                error=error,
            )

    def job(self, job_id: int) -> dict[str, Any]:
        """GET /jobs/{id} as JSON."""
        res = self.api.get(f"/jobs/{job_id}")
        assert res.status_code == 200, res.text
        job: dict[str, Any] = res.json()
        return job


@contextlib.contextmanager
def served(root: Path, **settings: Any) -> Iterator[LiveServer]:
    """A fresh SQLite database under ``root`` migrated to head, served by uvicorn, with the
    given ``Settings`` fields (e.g. ``auth="on"``)."""
    from service.app import create_app

    config = Settings(
        home=root / ".ddpq",
        database_url=f"sqlite:///{root / 'ddpq.db'}",
        artifact_dir=root / "artifacts",
        **settings,
    )
    db = Database.from_url(config.resolved_database_url)
    migrate.upgrade(db.engine)
    with serve_app(create_app(config)) as url:
        api = httpx.Client(base_url=f"{url}{API_PREFIX}", timeout=30)
        try:
            yield LiveServer(url=url, settings=config, db=db, api=api)
        finally:
            api.close()
            db.dispose()


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A fresh SQLite database migrated to head, served by uvicorn for one test module."""
    if importlib.util.find_spec("service.app") is None:
        pytest.skip("service.app (the REST API) is not there yet")
    with served(tmp_path_factory.mktemp("web")) as server:
        yield server


@dataclass
class WatchedPage:
    """A page plus everything the browser complained about while a test used it."""

    page: Any
    base_url: str
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    allowed: list[re.Pattern[str]] = field(default_factory=list)

    def goto(self, path: str) -> None:
        """Navigate to ``path`` on the live server."""
        self.page.goto(self.base_url + path)

    def allow_console(self, pattern: str) -> None:
        """Accept console errors matching ``pattern`` (e.g. the 422 a bad spec must get)."""
        self.allowed.append(re.compile(pattern))

    def unexpected(self) -> list[str]:
        """Console errors not allowed, page errors and dialogs, as readable lines."""
        console = [e for e in self.console_errors if not any(p.search(e) for p in self.allowed)]
        return (
            [f"console: {e}" for e in console]
            + [f"pageerror: {e}" for e in self.page_errors]
            + [f"dialog: {e}" for e in self.dialogs]
        )

    def screenshot(self, name: str) -> Path:
        """Save a full-page PNG under test-artifacts/web/ (git ignores it); returns its path."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def assert_clean(self) -> None:
        """Fail with the browser's own messages if anything went wrong on the page."""
        problems = self.unexpected()
        assert not problems, "the browser reported errors:\n" + "\n".join(problems)


OpenPage = Callable[..., WatchedPage]


@pytest.fixture
def open_page(browser: Any, live_server: LiveServer) -> Iterator[OpenPage]:
    """``open_page(path, viewport="desktop" | "phone")``: a new page at the live server's
    ``path`` that records console errors, uncaught errors and dialogs; each is checked after
    the test (``WatchedPage.assert_clean``)."""
    contexts: list[Any] = []
    watched: list[WatchedPage] = []

    def _open(path: str = "/", viewport: str = "desktop") -> WatchedPage:
        context = browser.new_context(
            viewport=VIEWPORTS[viewport], accept_downloads=True, service_workers="block"
        )
        context.set_default_timeout(15_000)
        contexts.append(context)
        page = context.new_page()
        w = WatchedPage(page=page, base_url=live_server.url)

        def on_console(msg: Any) -> None:
            if msg.type == "error":
                w.console_errors.append(f"{msg.text} @ {msg.location.get('url', '')}")

        def on_dialog(dialog: Any) -> None:
            w.dialogs.append(f"{dialog.type}: {dialog.message}")
            dialog.dismiss()

        page.on("console", on_console)
        page.on("pageerror", lambda exc: w.page_errors.append(str(exc)))
        page.on("dialog", on_dialog)
        watched.append(w)
        w.goto(path)
        return w

    yield _open
    try:
        for w in watched:
            w.assert_clean()
    finally:
        for context in contexts:
            context.close()


WaitFor = Callable[..., Any]


@pytest.fixture
def wait_for() -> WaitFor:
    """``wait_for(predicate, timeout_s=…, what="…")``: see ``wait_until``."""
    return wait_until
