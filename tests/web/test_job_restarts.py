"""A restarted job on its page, in headless Chromium: attempt 1 trained steps 1-7 and was lost,
attempt 2 resumed from the step-4 checkpoint. The page shows one stacked time bar per attempt
(attempt 1's lost work among its phases), a resume marker on the loss curve, attempt 1's
superseded points of steps 5-7, and the point that is rank 0's own value."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire
from service.store.attempts.tokens import mint_attempt_token
from service.store.jobs.crud import Transition, apply_transition

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

pytestmark = pytest.mark.slow


def _send(srv: Any, token: str, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(
        f"{srv.url}{API_PREFIX}{path}", json=body, headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code in (200, 204), r.text


def _points(srv: Any, token: str, steps: range, base: float, ranks: int = 2) -> None:
    rows = []
    for step in steps:
        time.sleep(0.01)  # each step its own moment
        rows.append(["loss", step, (step - 1) // 4, base / step, time.time(), ranks])
    _send(srv, token, wire.METRICS_PATH, {"points": rows})


def _token(srv: Any, job_id: int, attempt: int) -> str:
    with srv.db.session() as s:
        return mint_attempt_token(s, job_id, attempt)


@pytest.fixture(scope="module")
def restarted(live_server: Any) -> int:
    """Attempt 1: steps 1-7, lost; attempt 2: resumed from step 4, steps 5-12 (step 12 as
    rank 0's own value, as the flush after a rank failure writes it), succeeded."""
    srv = live_server
    job_id: int = srv.submit("restarted", priority=1000, max_restarts=2)["id"]
    srv.start(job_id)
    first = _token(srv, job_id, 1)
    _send(srv, first, wire.TIMELINE_PATH, {"resume_step": 0, "training_started_at_s": time.time()})
    _points(srv, first, range(1, 8), 2.0)
    _send(srv, first, wire.TIMELINE_PATH, {"checkpoint_stall_s": 0.05, "checkpoint_saves": 1})
    with srv.db.session() as s:
        t = Transition(job_id, JobState.RUNNING, JobState.QUEUED, "worker lost: lease expired")
        apply_transition(s, t)
    srv.start(job_id)
    second = _token(srv, job_id, 2)
    body = {"resume_step": 4, "restore_s": 0.02, "training_started_at_s": time.time()}
    _send(srv, second, wire.TIMELINE_PATH, body)
    _points(srv, second, range(5, 12), 1.5)
    _points(srv, second, range(12, 13), 1.5, ranks=0)
    srv.finish(job_id, JobState.SUCCEEDED)
    return job_id


def test_the_job_page_shows_each_attempts_time_bar_and_the_resume_on_the_curve(
    open_page: Any, restarted: int
) -> None:
    w = open_page(f"/jobs/{restarted}")
    page = w.page
    panel = page.locator("#goodput-panel")
    expect(panel).to_be_visible()
    expect(page.locator("#goodput-summary")).to_contain_text("goodput")
    expect(page.locator("#goodput-summary")).to_contain_text("3 steps lost to restarts")
    first = page.locator('.gp-bar[data-attempt="1"]')
    expect(first).to_have_attribute("data-lost-range", "5-7")
    lost = first.locator('.gp-seg[data-phase="lost"]')
    expect(lost).to_have_count(1)
    assert (lost.bounding_box() or {}).get("width", 0) > 0, "the lost segment has a width"
    expect(first.locator('.gp-seg[data-phase="productive"]')).to_have_count(1)
    expect(page.locator('.gp-bar[data-attempt="2"] .gp-seg[data-phase="lost"]')).to_have_count(0)
    expect(page.locator("#goodput-lost")).to_contain_text("steps 5–7")
    expect(page.locator("#goodput-interval")).to_contain_text("Young/Daly")

    loss = page.locator('.chart[data-metric="loss"]')
    expect(loss).to_have_attribute("data-resume-steps", "4")
    expect(loss).to_have_attribute("data-superseded-points", "3")
    expect(loss).to_have_attribute("data-rank0-points", "1")
    expect(loss).to_have_attribute("data-last-step", "12")
    expect(loss.locator(".u-legend")).to_contain_text("attempt 1 (superseded)")
    expect(loss.locator(".u-legend")).to_contain_text("loss (rank 0 only)")
    expect(loss.locator("canvas")).to_be_visible()
    w.screenshot("job-restarted")
