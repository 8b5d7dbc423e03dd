"""The compare page in headless Chromium against a real server with auth on: jobs picked on the
job list open side by side, every metric's curves overlaid (one line per job that reported
it), and a table of only the spec fields that differ; another owner's job is not shown."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.states import JobState
from tests.web.auth_pages import NOT_FOUND, live_server, run_job, sign_in, tokens
from tests.web.conftest import LiveServer, OpenPage
from tests.web.test_pages import no_horizontal_overflow

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

__all__ = ["live_server", "tokens"]  # the module's fixtures (auth on)
pytestmark = pytest.mark.slow


def diff_rows(page: Any) -> dict[str, list[str]]:
    """The diff table as {field: [value per job]}."""
    rows: dict[str, list[str]] = {}
    for tr in page.locator("#diff-body tr").all():
        cells = tr.locator("td").all_inner_texts()
        rows[cells[0]] = cells[1:]
    return rows


def test_picked_jobs_open_side_by_side_with_only_the_differing_spec_fields(
    open_page: OpenPage, live_server: LiveServer, tokens: dict[str, str]
) -> None:
    srv = live_server
    slow = run_job(
        srv, tokens["alice"], "lr-small", {"loss": [2.0, 1.5, 1.2, 1.0]},
        training={"max_steps": 50, "lr": 0.001}, tags=["sweep"],
    )  # fmt: skip
    fast = run_job(
        srv, tokens["alice"], "lr-big", {"loss": [2.0, 1.0, 0.5], "eval_loss": [0.9, 0.7]},
        training={"max_steps": 50, "lr": 0.1}, tags=["sweep"],
    )  # fmt: skip
    other = run_job(srv, tokens["alice"], "not-picked", {"loss": [3.0]})

    w = open_page("/")
    sign_in(w, tokens["alice"])
    page = w.page
    expect(page.locator("#jobs-body tr")).to_have_count(3)
    link = page.locator("#compare-link")
    expect(link).to_be_hidden()
    page.check(f'input.pick[data-job-id="{slow["id"]}"]')
    expect(link).to_have_text("Compare 1 job")
    expect(link).to_have_attribute("aria-disabled", "true")
    page.check(f'input.pick[data-job-id="{fast["id"]}"]')
    expect(link).to_have_text("Compare 2 jobs")
    # The picks survive the list's re-render (a new job shows up on the next poll).
    run_job(srv, tokens["alice"], "arrives-later", {}, state=JobState.RUNNING)
    expect(page.locator("#jobs-body tr")).to_have_count(4)
    expect(page.locator(f'input.pick[data-job-id="{slow["id"]}"]')).to_be_checked()
    expect(page.locator(f'input.pick[data-job-id="{other["id"]}"]')).not_to_be_checked()
    link.click()

    page.wait_for_url(f"**/compare?jobs={slow['id']},{fast['id']}")
    expect(page.locator("#compare-legend li")).to_have_count(2)
    expect(page.locator("#compare-legend")).to_contain_text("lr-small")
    expect(page.locator("#compare-legend")).to_contain_text("lr-big")
    loss = page.locator('.chart[data-metric="loss"] .plot')
    expect(loss).to_have_attribute("data-runs", "2")
    expect(loss).to_have_attribute("data-points", "7")  # 4 + 3: every point of both jobs
    expect(loss.locator("canvas")).to_have_count(1)
    # A metric only one job reported is drawn for that job alone.
    expect(page.locator('.chart[data-metric="eval_loss"] .plot')).to_have_attribute(
        "data-runs", "1"
    )
    page.wait_for_function("document.body.dataset.loaded === '1'")
    rows = diff_rows(page)
    assert rows == {
        "name": ['"lr-small"', '"lr-big"'],
        "training.lr": ["0.001", "0.1"],
    }, "only the fields that differ, in both jobs' columns (tags, task, resources are equal)"
    heads = page.locator("#diff-head th").all_inner_texts()
    assert heads == ["Field", f"#{slow['id']}", f"#{fast['id']}"]

    # Hovering a curve names the job and the point under the cursor.
    box = loss.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
    expect(page.locator('.chart[data-metric="loss"] .readout')).to_contain_text(" at step ")
    # Log scale redraws every chart (no page errors: checked after the test).
    page.check("#log-scale")
    expect(loss).to_have_attribute("data-runs", "2")
    expect(loss.locator("canvas")).to_have_count(1)
    w.screenshot("compare-desktop")
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)  # the charts follow their box's width on the next frame
    no_horizontal_overflow(page)
    w.screenshot("compare-phone")


def test_compare_shows_no_other_owners_job(
    open_page: OpenPage, live_server: LiveServer, tokens: dict[str, str]
) -> None:
    srv = live_server
    mine = run_job(srv, tokens["alice"], "alice-run", {"loss": [1.0, 0.5]})
    mine2 = run_job(srv, tokens["alice"], "alice-run-2", {"loss": [1.0, 0.4]})
    theirs = run_job(srv, tokens["bob"], "bob-secret-run", {"loss": [9.0, 8.0]})

    w = open_page(f"/compare?jobs={mine['id']},{theirs['id']},{mine2['id']}")
    w.allow_console(NOT_FOUND)  # the API's answer for bob's job
    sign_in(w, tokens["alice"])
    page = w.page
    expect(page.locator("#compare-missing")).to_have_text(f"Not found: job {theirs['id']}.")
    expect(page.locator("#compare-legend li")).to_have_count(2)
    expect(page.locator('.chart[data-metric="loss"] .plot')).to_have_attribute("data-runs", "2")
    page.wait_for_function("document.body.dataset.loaded === '1'")
    assert "bob-secret-run" not in page.content()

    # No jobs picked: the page says how to pick them.
    page.goto(w.base_url + "/compare")
    expect(page.locator("#compare-empty")).to_be_visible()
    expect(page.locator("#compare-body")).to_be_hidden()
