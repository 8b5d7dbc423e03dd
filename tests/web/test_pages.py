"""Dashboard pages in headless Chromium against a real server and SQLite, with jobs seeded
through the real domain functions (no worker here: test_live_jobs.py runs real jobs)."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from service.cli.job_data import checkpoints_table
from service.cli.output import progress_line
from service.core.states import JobState
from service.core.wire import API_PREFIX

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

pytestmark = pytest.mark.slow

XSS_NAMES = [
    "<img src=x onerror=alert(1)>",
    "<script>alert(2)</script>",
    '"><svg onload=alert(3)>',
]
UNPROCESSABLE = r"status of 422"


def loss_curve(n: int, start: int = 1) -> list[float]:
    """A decreasing, wiggly loss for steps ``start … start + n - 1``."""
    return [
        2.0 * math.exp(-s / 300) + 0.05 * math.sin(s / 3) ** 2 + 0.01
        for s in range(start, start + n)
    ]


@pytest.fixture(scope="module")
def seeded(live_server: Any) -> dict[str, int]:
    """Jobs in several states; the running one has 5,000 points, logs and checkpoints."""
    srv = live_server
    ids: dict[str, int] = {}
    ids["queued"] = srv.submit("waiting-for-a-worker")["id"]
    done = srv.submit("digits-baseline", task="digits", priority=1000)["id"]
    srv.start(done)
    srv.report(done, loss_curve(120), total_steps=120)
    srv.report(done, [0.5 + i / 300 for i in range(120)], name="eval_accuracy", total_steps=120)
    srv.finish(done, JobState.SUCCEEDED)
    ids["succeeded"] = done
    failed = srv.submit("exploding-lr", priority=1000)["id"]
    srv.start(failed)
    srv.report(failed, [1.0, 3.0, 40.0, float("inf"), float("nan")], total_steps=50)
    srv.write_log(failed, 0, "step 4 loss=inf\nTraceback (most recent call last):\n  ...\n")
    srv.finish(
        failed,
        JobState.FAILED,
        error="rank 0 exited with code 1: RuntimeError: loss is NaN at step 5\n<b>not bold</b>",
    )
    ids["failed"] = failed
    running = srv.submit("regression-long", priority=1000, training={"max_steps": 6000})["id"]
    srv.start(running)
    srv.report(running, loss_curve(5000), total_steps=6000)
    speed = [100.0 + (s % 50) for s in range(1, 5001)]
    srv.report(running, speed, name="samples_per_s", total_steps=6000)
    log = "".join(f"rank 0 step {s} loss {v:.4f}\n" for s, v in enumerate(loss_curve(200), 1))
    srv.write_log(running, 0, log)
    srv.write_log(running, 1, "rank 1 up\n")
    srv.checkpoint(running, 1000, b"checkpoint-1000")
    srv.checkpoint(running, 2000, b"checkpoint-2000" * 100)
    ids["running"] = running
    return ids


def no_horizontal_overflow(page: Any) -> None:
    """The page fits its viewport's width (no sideways scrolling of the whole page)."""
    overflow = page.evaluate(
        "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert overflow <= 1, f"page is {overflow}px wider than the viewport; fix the CSS"


@pytest.mark.parametrize("viewport", ["desktop", "phone"])
def test_pages_render_without_console_errors(
    open_page: Any, seeded: dict[str, int], viewport: str
) -> None:
    w = open_page("/", viewport)
    expect(w.page.locator(f'tr[data-job-id="{seeded["running"]}"]')).to_be_visible()
    expect(w.page.locator("#jobs-body tr")).to_have_count(4)
    no_horizontal_overflow(w.page)
    w.screenshot(f"list-seeded-{viewport}")

    for state in ("running", "failed", "succeeded", "queued"):
        w.goto(f"/jobs/{seeded[state]}")
        expect(w.page.locator("#job-state")).to_have_text(state)
        expect(w.page.locator("body[data-loaded]")).to_have_count(1)
        if state != "queued":
            expect(w.page.locator('.chart[data-metric="loss"] canvas')).to_be_visible()
        no_horizontal_overflow(w.page)
        w.screenshot(f"job-{state}-{viewport}")

    for path, ready in (("/submit", "#in-name"), ("/workers", "#workers-body tr")):
        w.goto(path)
        expect(w.page.locator(ready).first).to_be_visible()
        no_horizontal_overflow(w.page)
        w.screenshot(f"{path.strip('/')}-{viewport}")


def test_unknown_job_is_a_404_page_with_a_link_back(open_page: Any, seeded: dict[str, int]) -> None:
    w = open_page("/")
    w.allow_console(r"status of 404")
    response = w.page.goto(w.base_url + "/jobs/987654")
    assert response is not None and response.status == 404
    expect(w.page.locator("#not-found-page")).to_contain_text("Job 987654 was not found")
    expect(w.page.locator("#charts")).to_have_count(0)  # no empty panels
    expect(w.page.locator("#cancel-box")).to_have_count(0)
    w.page.get_by_role("link", name="Back to the job list").click()
    expect(w.page.locator(f'tr[data-job-id="{seeded["queued"]}"]')).to_be_visible()


def test_queued_job_says_why_it_waits(open_page: Any, seeded: dict[str, int]) -> None:
    w = open_page(f"/jobs/{seeded['queued']}")
    expect(w.page.locator("#job-state")).to_have_text("queued")
    reason = w.page.locator("#queue-reason")
    expect(reason).to_be_visible()
    expect(reason).to_have_text(re.compile(r"^Waiting: (no live worker|waiting for) "))
    w.goto(f"/jobs/{seeded['running']}")
    expect(w.page.locator("body[data-loaded]")).to_have_count(1)
    expect(w.page.locator("#queue-reason")).to_be_hidden()


def test_job_page_loads_history_downsampled_then_follows_new_points(
    open_page: Any, live_server: Any, seeded: dict[str, int]
) -> None:
    job_id = seeded["running"]
    w = open_page(f"/jobs/{job_id}")
    page = w.page
    loss = page.locator('.chart[data-metric="loss"]')
    expect(loss).to_have_attribute("data-last-step", "5000")
    first = int(loss.get_attribute("data-points") or 0)
    assert 0 < first <= 2000, f"5,000 points should load downsampled to ≤ 2,000, got {first}"
    expect(page.locator('.chart[data-metric="samples_per_s"] canvas')).to_be_visible()
    expect(page.locator("#progress-text")).to_contain_text("step 5000 / 6000")
    expect(page.locator("#progress-text")).to_contain_text("ETA 1 min 35 s")
    # The dashboard and the CLI show the same epoch for the same job (epoch_number, 1-based).
    api_job = live_server.api.get(f"/jobs/{job_id}").json()
    assert api_job["progress"]["epoch"] == 50 and api_job["progress"]["epoch_number"] == 51
    assert "· epoch 51 ·" in progress_line(api_job), progress_line(api_job)
    expect(page.locator("#progress-text")).to_contain_text("epoch 51 ·")

    live_server.report(job_id, loss_curve(10, start=5001), first_step=5001, total_steps=6000)
    expect(loss).to_have_attribute("data-last-step", "5010")
    assert int(loss.get_attribute("data-points") or 0) == first + 10
    expect(page.locator("#progress-text")).to_contain_text("step 5010 / 6000")

    page.locator("#log-scale").check()
    expect(loss.locator("canvas")).to_be_visible()

    # Logs: rank 0's tail, following new output; then rank 1's.
    log = page.locator("#log-text")
    expect(log).to_contain_text("rank 0 step 200 loss")
    live_server.write_log(job_id, 0, "rank 0 <b>step 5010</b> done\n")
    expect(log).to_contain_text("rank 0 <b>step 5010</b> done")
    assert log.locator("b").count() == 0
    page.locator("#log-rank").select_option("1")
    expect(log).to_have_text("rank 1 up\n")

    # Checkpoints with working download links.
    rows = page.locator("#checkpoints-body tr")
    expect(rows).to_have_count(2)
    # Epoch 0 is shown as epoch 1 (epoch_number), as the CLI's checkpoints table shows it.
    ckpts = live_server.api.get(f"/jobs/{job_id}/checkpoints").json()["checkpoints"]
    assert {(c["epoch"], c["epoch_number"]) for c in ckpts} == {(0, 1)}, ckpts
    cli_row = checkpoints_table(job_id, ckpts).columns[1]._cells
    assert [str(c) for c in cli_row] == ["1", "1"], cli_row
    expect(page.locator('#checkpoints-body tr[data-step="1000"] td').nth(1)).to_have_text("1")
    href = page.locator('#checkpoints-body tr[data-step="1000"] a').get_attribute("href")
    assert href == f"{API_PREFIX}/jobs/{job_id}/checkpoints/1000/file"
    with page.expect_download() as download:
        page.locator('#checkpoints-body tr[data-step="1000"] a').click()
    with open(download.value.path(), "rb") as f:
        assert f.read() == b"checkpoint-1000"

    events = page.locator("#timeline li")
    expect(events).to_have_count(3)
    expect(events.nth(2)).to_have_attribute("data-to-state", "running")


def test_failed_job_shows_error_panel_as_text(open_page: Any, seeded: dict[str, int]) -> None:
    w = open_page(f"/jobs/{seeded['failed']}")
    panel = w.page.locator("#error-panel")
    expect(panel).to_be_visible()
    expect(w.page.locator("#error-text")).to_have_text(
        "rank 0 exited with code 1: RuntimeError: loss is NaN at step 5\n<b>not bold</b>"
    )
    assert panel.locator("b").count() == 0
    loss = w.page.locator('.chart[data-metric="loss"]')
    expect(loss).to_have_attribute("data-points", "5")
    expect(loss.locator(".latest")).to_have_text("latest NaN at step 5")
    expect(w.page.locator("#cancel-box")).to_be_hidden()


def test_names_and_texts_with_markup_render_as_text(open_page: Any, live_server: Any) -> None:
    ids = [live_server.submit(name, priority=1000)["id"] for name in XSS_NAMES]
    target = ids[0]
    live_server.start(target)
    live_server.report(target, [1.0, 0.5], name="<img src=y onerror=alert(4)>")
    live_server.write_log(target, 0, "<script>alert(5)</script>\n")

    w = open_page("/")
    page = w.page
    for job_id, name in zip(ids, XSS_NAMES, strict=True):
        expect(page.locator(f'tr[data-job-id="{job_id}"] a.job-link')).to_have_text(name)
    assert page.locator("main img, main svg, main script").count() == 0

    w.goto(f"/jobs/{target}")
    expect(page.locator("#job-name")).to_have_text(XSS_NAMES[0])
    expect(page.locator("#log-text")).to_have_text("<script>alert(5)</script>\n")
    chart = page.locator(".chart").filter(has_text="<img src=y onerror=alert(4)>")
    expect(chart).to_have_count(1)
    expect(page.locator("#spec-json")).to_contain_text('"name": "<img src=x onerror=alert(1)>"')
    assert page.locator("main img, main script").count() == 0
    assert page.title().startswith(XSS_NAMES[0])
    page.wait_for_timeout(500)  # give any injected handler time to fire
    assert w.dialogs == [], f"markup in data ran as code: {w.dialogs}"
    live_server.finish(target, JobState.CANCELLED)
    for job_id in ids[1:]:
        assert live_server.api.post(f"/jobs/{job_id}/cancel").status_code == 202


def test_bad_spec_in_form_shows_field_errors_and_stores_nothing(
    open_page: Any, live_server: Any
) -> None:
    before = live_server.job_count()
    w = open_page("/submit")
    w.allow_console(UNPROCESSABLE)
    page = w.page
    page.select_option("#in-task", "regression")
    page.fill('[data-path="resources.nproc_per_node"]', "0")
    page.fill('[data-path="training.epochs"]', "two")
    regression = page.locator('fieldset[data-task="regression"]')
    regression.locator('input[data-path="config.hidden"]').fill("-3")
    page.click("#submit-form")
    nproc_error = page.locator('[data-error-for="resources.nproc_per_node"]')
    expect(nproc_error).to_contain_text("greater than or equal to 1")
    expect(page.locator('[data-error-for="training.epochs"]')).to_contain_text("valid integer")
    expect(page.locator('.field.invalid[data-field="resources.nproc_per_node"]')).to_have_count(1)
    w.screenshot("submit-errors-desktop")
    assert page.url.endswith("/submit")
    assert live_server.job_count() == before, "a rejected spec must not be stored"

    # The task's own config schema is checked once the spec's shape is right.
    page.fill('[data-path="resources.nproc_per_node"]', "2")
    page.fill('[data-path="training.epochs"]', "1")
    page.click("#submit-form")
    hidden_error = regression.locator('[data-error-for="config.hidden"]')
    expect(hidden_error).to_contain_text("greater than or equal to 1")
    expect(nproc_error).to_have_text("")
    expect(page.locator('[data-error-for="training.epochs"]')).to_have_text("")

    # Cross-field rule: the server's message lands next to the field it names.
    regression.locator('input[data-path="config.hidden"]').fill("8")
    page.fill('[data-path="resources.gpus_per_node"]', "1")
    page.click("#submit-form")
    expect(nproc_error).to_contain_text("one GPU per rank")
    expect(hidden_error).to_have_text("")
    assert live_server.job_count() == before


def test_pasted_spec_errors_then_success(open_page: Any, live_server: Any) -> None:
    before = live_server.job_count()
    w = open_page("/submit")
    w.allow_console(UNPROCESSABLE)
    page = w.page
    page.click("#tab-paste")
    errors = page.locator("#paste-errors")

    page.fill("#spec-text", "name: [unclosed\ntask: regression\n")
    page.click("#submit-paste")
    expect(errors).to_contain_text("not valid YAML/JSON at line")

    page.fill("#spec-text", "name: pasted\ntask: regression\nresources:\n  nproc_per_node: 0\n")
    page.click("#submit-paste")
    expect(errors.locator('li[data-path="resources.nproc_per_node"]')).to_contain_text(
        "resources.nproc_per_node: Input should be greater than or equal to 1"
    )
    page.fill("#spec-text", '{"name": "pasted", "task": "nope", "colour": "red"}')
    page.click("#submit-paste")
    expect(errors.locator('li[data-path="colour"]')).to_have_count(1)
    page.set_viewport_size({"width": 390, "height": 844})
    w.screenshot("submit-paste-errors-phone")
    assert live_server.job_count() == before

    page.fill(
        "#spec-text",
        "name: pasted-yaml\ntask: regression\nresources:\n  nproc_per_node: 2\n"
        "training:\n  max_steps: 5\ntags: [web]\n",
    )
    page.click("#submit-paste")
    page.wait_for_url("**/jobs/*")
    expect(page.locator("#job-name")).to_have_text("pasted-yaml")
    job_id = int(page.url.rsplit("/", 1)[1])
    assert live_server.job(job_id)["spec"]["tags"] == ["web"]
    assert live_server.job_count() == before + 1
    assert live_server.api.post(f"/jobs/{job_id}/cancel").status_code == 202


def test_list_filters_pages_and_updates_live(open_page: Any, live_server: Any) -> None:
    ids = [live_server.submit(f"bulk-{i:02d}")["id"] for i in range(27)]
    w = open_page("/")
    page = w.page
    rows = page.locator("#jobs-body tr")
    expect(rows).to_have_count(25)
    expect(rows.first).to_have_attribute("data-job-id", str(ids[-1]))
    page.click("#page-older")
    expect(page.locator(f'tr[data-job-id="{ids[1]}"]')).to_be_visible()
    assert "cursor=" in page.url
    page.click("#page-newest")
    expect(rows.first).to_have_attribute("data-job-id", str(ids[-1]))

    # New and changed jobs show up without a reload while anything is live.
    fresh = live_server.submit("arrived-later")["id"]
    expect(rows.first).to_have_attribute("data-job-id", str(fresh))
    assert live_server.api.post(f"/jobs/{ids[-1]}/cancel").status_code == 202
    expect(page.locator(f'tr[data-job-id="{ids[-1]}"] .badge')).to_have_text("cancelled")

    page.select_option("#state-filter", "cancelled")
    expect(page.locator("#jobs-body tr .badge").first).to_have_text("cancelled")
    states = page.locator("#jobs-body tr").evaluate_all("rows => rows.map(r => r.dataset.state)")
    assert states and set(states) == {"cancelled"}, states
    assert "state=cancelled" in page.url
    for job_id in [*ids[:-1], fresh]:
        live_server.api.post(f"/jobs/{job_id}/cancel")


def test_cancel_asks_for_confirmation_then_shows_cancelled(
    open_page: Any, live_server: Any
) -> None:
    job_id = live_server.submit("to-be-cancelled", priority=1000)["id"]
    live_server.start(job_id)
    w = open_page(f"/jobs/{job_id}")
    page = w.page
    expect(page.locator("#job-state")).to_have_text("running")
    page.click("#cancel-button")
    expect(page.locator("#cancel-confirm")).to_be_visible()
    page.click("#cancel-no")
    expect(page.locator("#cancel-confirm")).to_be_hidden()
    assert live_server.job(job_id)["cancel_requested"] is False

    page.click("#cancel-button")
    page.click("#cancel-yes")
    expect(page.locator("#cancel-note")).to_contain_text("Cancel requested")
    expect(page.locator("#cancel-box")).to_be_hidden()
    assert live_server.job(job_id)["cancel_requested"] is True
    live_server.finish(job_id, JobState.CANCELLED)  # what the worker does next
    expect(page.locator("#job-state")).to_have_text("cancelled")
    expect(page.locator("#cancel-note")).to_contain_text("This job was cancelled")


def test_workers_page_shows_capacity_jobs_and_heartbeat(
    open_page: Any, seeded: dict[str, int]
) -> None:
    w = open_page("/workers")
    row = w.page.locator('tr[data-worker-id="seed-worker"]')
    expect(row).to_contain_text("4 slots · no GPUs")
    expect(row.locator(f'a[href="/jobs/{seeded["running"]}"]')).to_have_text(
        f"#{seeded['running']}"
    )
    expect(row.locator(".badge")).to_have_text(re.compile("live|lost"))
