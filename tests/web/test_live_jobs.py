"""Real jobs through the dashboard: a worker subprocess runs 2-rank regression jobs (torchrun,
gloo on CPU) that are submitted from the form and cancelled from the job page."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.workers import mint_worker_token

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

pytestmark = pytest.mark.slow

STEPS = 40  # optimizer steps of the submitted job; one loss point per step
JOB_TIMEOUT_S = 240.0  # generous: torchrun start-up on a busy 2-core machine


@pytest.fixture(scope="module")
def worker(live_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``python -m worker.main`` against the live server (one slot, no GPUs, a worker
    token)."""
    if importlib.util.find_spec("worker.main") is None:
        pytest.skip("worker.main is not there yet")
    settings = live_server.settings
    env = {k: v for k, v in os.environ.items() if k != "DDPQ_DATABASE_URL"}
    env.update(
        DDPQ_HOME=str(settings.home),
        DDPQ_WORKER_TOKEN=mint_worker_token(settings.resolved_database_url),
        DDPQ_ARTIFACT_DIR=str(settings.resolved_artifact_dir),
        DDPQ_API_URL=live_server.url,
        DDPQ_HEARTBEAT_INTERVAL_S="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.main", "--launcher", "local", "--slots", "1"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a log file, for failure messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as exc:
        return f"<no log: {exc}>"


def test_form_submission_runs_to_success_while_the_curve_grows(
    open_page: Any, live_server: Any, worker: Path, wait_for: Any
) -> None:
    w = open_page("/submit")
    page = w.page
    page.fill("#in-name", "form-regression")
    page.select_option("#in-task", "regression")
    page.fill('[data-path="resources.nproc_per_node"]', "2")
    page.fill('[data-path="training.epochs"]', "3")  # 3 × 16 steps, capped by max_steps
    page.fill('[data-path="training.max_steps"]', str(STEPS))
    page.fill('[data-path="training.log_every_steps"]', "1")
    page.fill('[data-path="training.checkpoint_every_steps"]', "20")
    regression = page.locator('fieldset[data-task="regression"]')
    regression.locator("details.fault-injection summary").click()  # the knob is folded away
    regression.locator('input[data-path="config.sleep_per_step_ms"]').fill("150")
    page.click("#submit-form")
    page.wait_for_url("**/jobs/*")
    job_id = int(page.url.rsplit("/", 1)[1])
    expect(page.locator("#job-name")).to_have_text("form-regression")
    spec = live_server.job(job_id)["spec"]
    assert spec["resources"]["nproc_per_node"] == 2
    assert spec["training"]["max_steps"] == STEPS

    loss = page.locator('.chart[data-metric="loss"]')
    seen: set[int] = set()

    def finished() -> bool:
        if loss.count():
            seen.add(int(loss.get_attribute("data-points") or 0))
        return page.locator("#job-state").text_content() in ("succeeded", "failed", "cancelled")

    try:
        wait_for(finished, timeout_s=JOB_TIMEOUT_S, what=f"job {job_id} to finish")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; worker log:\n{tail(worker)}") from None
    state = page.locator("#job-state").text_content()
    assert state == "succeeded", (
        f"job ended {state}: {live_server.job(job_id).get('error')}\n{tail(worker)}"
    )
    expect(loss).to_have_attribute("data-points", str(STEPS))
    growing = sorted(n for n in seen if 0 < n < STEPS)
    assert growing, f"the curve never showed a partial history (saw {sorted(seen)} points)"
    api_points = live_server.api.get(f"/jobs/{job_id}/metrics", params={"name": "loss"}).json()
    assert [p["step"] for p in api_points["points"]] == list(range(1, STEPS + 1))

    expect(page.locator("#progress-text")).to_contain_text(f"step {STEPS} / {STEPS}")
    expect(page.locator("#log-text")).not_to_be_empty()
    expect(page.locator("#checkpoints-body tr").first).to_be_visible()
    expect(page.locator('#timeline li[data-to-state="succeeded"]')).to_have_count(1)
    w.screenshot("job-real-succeeded-desktop")
    page.set_viewport_size({"width": 390, "height": 844})
    w.screenshot("job-real-succeeded-phone")
    w.goto("/")
    expect(page.locator(f'tr[data-job-id="{job_id}"] .badge')).to_have_text("succeeded")
    w.screenshot("list-real-phone")
    page.set_viewport_size({"width": 1280, "height": 800})
    w.screenshot("list-real-desktop")


def test_cancel_from_the_job_page_ends_the_job_cancelled(
    open_page: Any, live_server: Any, worker: Path, wait_for: Any
) -> None:
    job = live_server.submit(
        "cancel-me",
        training={"epochs": 10_000, "max_steps": 100_000, "log_every_steps": 5},
        config={"sleep_per_step_ms": 100},
    )
    w = open_page(f"/jobs/{job['id']}")
    page = w.page
    try:
        expect(page.locator('.chart[data-metric="loss"] canvas')).to_be_visible(
            timeout=JOB_TIMEOUT_S * 1000
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nworker log:\n{tail(worker)}") from None
    expect(page.locator("#job-state")).to_have_text("running")
    w.screenshot("job-real-running-desktop")
    page.click("#cancel-button")
    page.click("#cancel-yes")
    expect(page.locator("#job-state")).to_have_text("cancelled", timeout=60_000)
    expect(page.locator("#cancel-note")).to_contain_text("This job was cancelled")
    expect(page.locator("#cancel-box")).to_be_hidden()
    assert live_server.job(job["id"])["state"] == "cancelled"
    expect(page.locator('#timeline li[data-to-state="cancelled"]')).to_have_count(1)
