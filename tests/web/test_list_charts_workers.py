"""The job list's columns and name/tag filter, the charts' legend, x axis and smoothing, and
the workers page's stopped workers, in headless Chromium against a real server and SQLite
(jobs and workers seeded through the real domain functions)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update

from service.core.states import JobState
from service.store.metrics.points import MetricPoint, record_metrics
from service.store.models import Worker, utcnow
from service.store.workers.registry import register_worker, stop_worker

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

pytestmark = pytest.mark.slow

DURATION = re.compile(r"^\d+ (s|min \d+ s)$")


def test_list_shows_task_tags_duration_and_main_metric_and_filters_by_text(
    open_page: Any, live_server: Any
) -> None:
    srv = live_server
    digits = srv.submit("mnist-like", task="digits", tags=["vision", "baseline"], priority=1000)
    srv.start(digits["id"])
    srv.report(digits["id"], [0.9, 0.4], total_steps=2)
    srv.report(digits["id"], [0.5, 0.8125], name="eval_accuracy", total_steps=2)
    srv.finish(digits["id"], JobState.SUCCEEDED)
    running = srv.submit("regression-running", tags=["nightly"], priority=1000)
    srv.start(running["id"])
    srv.report(running["id"], [2.0, 1.0, 0.25], total_steps=50)
    queued = srv.submit("waiting", tags=["vision-2"])

    w = open_page("/")
    page = w.page
    done_row = page.locator(f'tr[data-job-id="{digits["id"]}"]')
    expect(done_row.locator("td.task")).to_have_text("digits")
    expect(done_row.locator("td.tags .tag")).to_have_text(["vision", "baseline"])
    expect(done_row.locator('td.metric[data-metric="eval_accuracy"]')).to_contain_text("0.8125")
    expect(done_row.locator("td.duration")).to_have_text(DURATION)
    run_row = page.locator(f'tr[data-job-id="{running["id"]}"]')
    expect(run_row.locator('td.metric[data-metric="loss"]')).to_contain_text("0.25")
    expect(run_row.locator("td.duration")).to_have_text(DURATION)
    wait_row = page.locator(f'tr[data-job-id="{queued["id"]}"]')
    expect(wait_row.locator("td.duration")).to_have_text("–")
    expect(wait_row.locator("td.metric")).to_contain_text("–")
    w.screenshot("list-columns-desktop")

    # A name substring (any case), filtered by the server: the URL keeps it.
    page.fill("#text-filter", "REGRESSION")
    rows = page.locator("#jobs-body tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-job-id", str(running["id"]))
    assert "q=REGRESSION" in page.url
    # An exact tag: "vision" is not "vision-2".
    page.fill("#text-filter", "vision")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-job-id", str(digits["id"]))
    page.fill("#text-filter", "")
    expect(rows).to_have_count(3)
    # Clicking a tag filters by it; the state filter still applies on top.
    wait_row.locator("td.tags .tag").click()
    expect(page.locator("#text-filter")).to_have_value("vision-2")
    expect(rows).to_have_count(1)
    page.select_option("#state-filter", "succeeded")
    expect(page.locator("#jobs-empty")).to_contain_text("matching")
    expect(rows).to_have_count(0)
    page.fill("#text-filter", "mnist")
    expect(rows).to_have_count(1)
    # Reloading keeps both filters.
    page.reload()
    expect(page.locator("#text-filter")).to_have_value("mnist")
    expect(rows).to_have_count(1)
    srv.finish(running["id"], JobState.CANCELLED)
    srv.api.post(f"/jobs/{queued['id']}/cancel")


def legend_values(chart: Any) -> list[str]:
    values: list[str] = chart.locator(".u-legend .u-series .u-value").all_inner_texts()
    return values


def test_chart_legend_shows_the_latest_point_and_follows_axis_and_smoothing(
    open_page: Any, live_server: Any
) -> None:
    srv = live_server
    job_id = srv.submit("noisy", priority=1000)["id"]
    srv.start(job_id)
    t0 = utcnow() - timedelta(minutes=10)
    # 300 steps, 100 per epoch, one second apart; the loss alternates around a falling line.
    values = [1.0 / s + (0.2 if s % 2 else -0.2) + 0.5 for s in range(1, 301)]
    points = [
        MetricPoint(
            name="loss", step=s, value=v, epoch=(s - 1) // 100, time=t0 + timedelta(seconds=s)
        )
        for s, v in zip(range(1, 301), values, strict=True)
    ]
    with srv.db.session() as session:
        record_metrics(session, job_id, 1, points, progress={"step": 300, "total_steps": 300})

    w = open_page(f"/jobs/{job_id}")
    page = w.page
    chart = page.locator('.chart[data-metric="loss"]')
    expect(chart.locator("canvas")).to_be_visible()
    expect(chart).to_have_attribute("data-last-step", "300")
    latest = f"{values[-1]:.4g}".rstrip("0").rstrip(".")
    assert legend_values(chart) == ["300", latest], "the newest point, not --"

    # Hovering shows that point; leaving shows the newest one again.
    box = chart.locator(".u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] / 2)
    expect(chart.locator(".u-legend .u-series .u-value").first).not_to_have_text("300")
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] + 200)
    expect(chart.locator(".u-legend .u-series .u-value").first).to_have_text("300")
    assert "--" not in legend_values(chart)

    page.select_option("#x-axis", "epoch")
    expect(chart).to_have_attribute("data-x", "epoch")
    # Step 300 is the 100th of epoch 2's 100 steps: 2.99 epochs done.
    assert legend_values(chart) == ["2.99", latest]
    expect(chart.locator(".u-legend .u-series th").first).to_have_text("epochs done")
    page.select_option("#x-axis", "time")
    expect(chart).to_have_attribute("data-x", "time")
    assert legend_values(chart)[0] == f"{299 / 60:.1f} min", "minutes since the first point"

    page.select_option("#x-axis", "step")
    page.select_option("#smoothing", "0.9")
    expect(chart).to_have_attribute("data-smoothing", "0.9")
    labels = chart.locator(".u-legend .u-series th").all_inner_texts()
    assert labels == ["step", "loss (raw)", "loss (EMA 0.9)"], labels
    step, raw, smooth = legend_values(chart)
    assert (step, raw) == ("300", latest), "the raw curve stays, with its own legend value"
    acc = weight = 0.0
    for v in values:
        acc, weight = 0.9 * acc + 0.1 * v, 0.9 * weight + 0.1
    assert smooth == f"{acc / weight:.4g}".rstrip("0").rstrip("."), smooth
    assert abs(float(smooth) - float(raw)) > 0.1, "smoothing evens out the alternation"
    w.screenshot("chart-smoothed")
    page.select_option("#smoothing", "0")
    expect(chart).to_have_attribute("data-smoothing", "0")
    assert len(legend_values(chart)) == 2
    srv.finish(job_id, JobState.CANCELLED)


def test_workers_page_hides_stopped_workers_until_asked_and_old_ones_are_pruned(
    open_page: Any, live_server: Any, wait_for: Any
) -> None:
    with live_server.db.session() as session:
        for worker_id in ("alive-w", "stopped-w", "ancient-w"):
            register_worker(
                session,
                worker_id=worker_id,
                host="h",
                pid=1,
                launcher="local",
                capacity={"slots": 1, "gpus": []},
            )
        stop_worker(session, "stopped-w")
        stop_worker(session, "ancient-w")
        long_ago = utcnow() - timedelta(days=8)
        session.execute(
            update(Worker)
            .where(Worker.id == "ancient-w")
            .values(stopped_at=long_ago, heartbeat_at=long_ago, started_at=long_ago)
        )
    w = open_page("/workers")
    page = w.page
    expect(page.locator('tr[data-worker-id="alive-w"]')).to_be_visible()
    expect(page.locator('tr[data-worker-id="stopped-w"]')).to_have_count(0)
    page.check("#show-stopped")
    stopped = page.locator('tr[data-worker-id="stopped-w"]')
    expect(stopped).to_be_visible()
    expect(stopped.locator(".badge")).to_have_text("stopped")
    assert "stopped=1" in page.url
    # The API's reaper (every heartbeat_interval_s, 5 s) deletes rows stopped over 7 days ago.
    wait_for(
        lambda: (
            "ancient-w" not in [x["id"] for x in live_server.api.get("/workers").json()["workers"]]
        ),
        timeout_s=30,
        what="the reaper to prune the worker stopped 8 days ago",
    )
    expect(page.locator('tr[data-worker-id="ancient-w"]')).to_have_count(0, timeout=20_000)
    expect(stopped).to_be_visible()
    page.uncheck("#show-stopped")
    expect(stopped).to_have_count(0)
    expect(page.locator("#stopped-count")).to_have_text("(1)")
