"""A sweep too large to show whole, in headless Chromium against a real server with auth on:
the trials table comes a page at a time, sorted on the server; the curves are the best
trials' plus the ones ticked in the table; each poll reads only the trials that changed
(never the whole table again), and a trial that becomes the best moves to the top from the
poll alone; a trial that falls off the first page makes it read the page again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import update

from service.core.states import JobState
from service.store.metrics.points import MetricPoint, record_metrics
from service.store.models import Job
from tests.web.auth_pages import bearer, sign_in, tokens
from tests.web.conftest import LiveServer, OpenPage, served
from tests.web.test_sweeps_pages import expect_column

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

__all__ = ["tokens"]  # the module's fixtures (auth on)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """As ``auth_pages.live_server`` (auth on), with room for a 120-trial sweep in a minute."""
    root = tmp_path_factory.mktemp("web-paging")
    with served(root, auth="on", submissions_per_minute=1000) as server:
        yield server


LRS = [round(0.001 * (i + 1), 4) for i in range(12)]
HIDDEN = list(range(8, 18))  # 12 × 10 = 120 trials: past the page's 100-curve and 50-row marks
SCORED = 110  # trials that report a loss; the last 10 stay queued


def loss_of(position: int) -> float:
    """A loss per trial, all different, not in position order."""
    return round(0.01 + (position * 37 % SCORED) / 100, 2)


def seed(srv: LiveServer, token: str) -> tuple[int, list[dict[str, Any]]]:
    body = {
        "name": "many-trials",
        "base": {"name": "many", "task": "regression", "training": {"max_steps": 50},
                 "priority": 1000},
        "axes": {"training.lr": {"grid": LRS}, "config.hidden": {"grid": HIDDEN}},
        "objective": {"metric": "loss", "mode": "min", "at": "last"},
    }  # fmt: skip
    res = srv.api.post("/sweeps", json=body, headers=bearer(token))
    assert res.status_code == 201, res.text
    sweep_id = int(res.json()["id"])
    res = srv.api.get(f"/sweeps/{sweep_id}/trials", headers=bearer(token))
    rows: list[dict[str, Any]] = res.json()["trials"]
    assert len(rows) == 120
    ids = [r["job_id"] for r in rows[:SCORED]]
    with srv.db.session() as session:  # running, as a worker would have them
        session.execute(
            update(Job).where(Job.id.in_(ids)).values(state=JobState.RUNNING.value, attempt=1)
        )
    for pos in range(SCORED):
        report(srv, rows[pos]["job_id"], [1.0, loss_of(pos)])
    return sweep_id, rows


def report(srv: LiveServer, job_id: int, values: list[float], first_step: int = 1) -> None:
    points = [MetricPoint(name="loss", step=first_step + i, value=v) for i, v in enumerate(values)]
    with srv.db.session() as session:
        record_metrics(session, job_id, 1, points, progress={"step": first_step + len(values) - 1})


def test_a_large_sweep_pages_sorts_and_polls_only_what_changed(
    open_page: OpenPage, live_server: LiveServer, tokens: dict[str, str]
) -> None:
    srv = live_server
    sweep_id, rows = seed(srv, tokens["alice"])
    by_loss = sorted(range(SCORED), key=loss_of)

    w = open_page(f"/sweeps/{sweep_id}")
    trial_reads: list[tuple[str, int]] = []
    w.page.on(
        "response",
        lambda r: (
            trial_reads.append((r.url, len(r.body())))
            if "/trials" in r.url and r.status == 200
            else None
        ),
    )
    sign_in(w, tokens["alice"])
    page = w.page
    body = page.locator("#trials-body tr")
    expect(body).to_have_count(50)
    expect(page.locator("#trials-range")).to_have_text("1–50 of 120")
    expect(page.locator("#trials-prev")).to_be_disabled()
    expect_column(page, "position", [str(p) for p in range(50)])

    page.click("#trials-next")
    expect(page.locator("#trials-range")).to_have_text("51–100 of 120")
    expect_column(page, "position", [str(p) for p in range(50, 100)])
    page.click("#trials-next")
    expect(page.locator("#trials-range")).to_have_text("101–120 of 120")
    expect(body).to_have_count(20)
    expect(page.locator("#trials-next")).to_be_disabled()

    # Sorted on the server: the best first, from the first page again; then the worst.
    page.click('#trials-head th[data-key="objective"] button')
    expect(page.locator("#trials-range")).to_have_text("1–50 of 120")
    expect_column(page, "position", [str(p) for p in by_loss[:50]])
    page.click('#trials-head th[data-key="objective"] button')
    expect_column(page, "position", [str(p) for p in by_loss[::-1][:50]])

    # The curves: the best ten trials' only (120 are too many to overlay)...
    plot = page.locator("#curves-plot")
    best_ten = [rows[p]["job_id"] for p in by_loss[:10]]
    expect(plot).to_have_attribute("data-jobs", ",".join(map(str, best_ten)))
    expect(plot).to_have_attribute("data-runs", "10")
    expect(page.locator("#curves-title")).to_contain_text("best 10")
    # ...plus a trial ticked in the table (here the worst one).
    worst = rows[by_loss[-1]]["job_id"]
    page.check(f'#trials-body input.pick[data-job-id="{worst}"]')
    expect(plot).to_have_attribute("data-runs", "11")
    expect(plot).to_have_attribute("data-jobs", ",".join(map(str, [*best_ten, worst])))

    # A trial becomes the best: the next polls bring it (and only what changed).
    page.click('#trials-head th[data-key="objective"] button')  # best first again
    expect_column(page, "position", [str(p) for p in by_loss[:50]])
    trial_reads.clear()
    report(srv, rows[by_loss[-1]]["job_id"], [0.001], first_step=10)
    first = page.locator("#trials-body tr").first
    expect(first).to_have_attribute("data-job-id", str(worst), timeout=10_000)
    expect(first).to_have_class("best")
    expect(page.locator("#f-best")).to_contain_text(f"#{worst}")
    page.wait_for_timeout(2500)  # another poll or two
    assert trial_reads, "the page polls the trials that changed"
    for url, size in trial_reads:
        assert "changed_since=" in url or "limit=50&offset=0" in url, (
            f"a poll read more than a page or the changes: {url}"
        )
        assert size < 50_000, f"{url} sent {size} bytes"
    # (A trial that improves into the page needs no page read: the page re-sorts the rows
    # it holds with the changed ones. Not asserted here: a poll that races the sort click
    # above may read the page once; bench/sweep_trials counts the page reads.)
    w.screenshot("sweep-page-many-trials")

    # The best trial gets worse past the page's last row: only the server knows which trial
    # takes its place, so the page is read again, in the server's order.
    trial_reads.clear()
    report(srv, rows[by_loss[0]]["job_id"], [9.0], first_step=11)
    expect_column(page, "position", [str(p) for p in [by_loss[-1], *by_loss[1:50]]])
    assert any("limit=50&offset=0" in url for url, _ in trial_reads), trial_reads
