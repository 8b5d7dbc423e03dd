"""In headless Chromium against a real server and SQLite: the submit form previews what would
run (the dry run: launch plan, queue, warnings) and stores nothing; a queued job's page says
where it waits and which workers could run it."""

from __future__ import annotations

from typing import Any

import pytest

from service.store.workers.registry import register_worker

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

pytestmark = pytest.mark.slow


def test_submit_form_previews_the_plan_and_stores_nothing(open_page: Any, live_server: Any) -> None:
    before = live_server.job_count()
    w = open_page("/submit")
    page = w.page
    page.fill('[name="name"]', "previewed")
    page.click("#preview-form")
    expect(page.locator("#preview")).to_be_visible()
    plan = page.locator("#preview-plans pre")
    expect(plan).to_contain_text("# ddpq job 0 attempt 1 via local")
    expect(plan).to_contain_text("export DDPQ_ATTEMPT_TOKEN=***")
    expect(plan).to_contain_text("-m worker.runtime.agent --standalone")
    expect(page.locator("#preview-queue")).to_contain_text("Queue: no live worker")
    expect(page.locator("#preview-warnings")).to_contain_text("no worker of launcher local")
    assert live_server.job_count() == before, "a preview stores nothing"
    w.screenshot("submit-preview-desktop")
    w.assert_clean()


def test_job_page_says_where_a_queued_job_waits(open_page: Any, live_server: Any) -> None:
    with live_server.db.session() as s:
        register_worker(s, worker_id="tiny-box", host="h", pid=1, launcher="local",
                        capacity={"slots": 1, "gpus": []})  # fmt: skip
    ahead = live_server.submit("ahead-of-it", priority=7)
    job = live_server.submit("waits-for-gpus", resources={"nproc_per_node": 1,
                                                          "gpus_per_node": 1})  # fmt: skip
    w = open_page(f"/jobs/{job['id']}")
    reason = w.page.locator("#queue-reason")
    expect(reason).to_contain_text("Waiting: waiting for a worker with 1 free GPU")
    expect(reason).to_contain_text("Worker tiny-box (local): never: has 0 GPUs")
    assert ahead["id"] < job["id"]
    w.screenshot("job-queue-reason-desktop")
    w.assert_clean()
