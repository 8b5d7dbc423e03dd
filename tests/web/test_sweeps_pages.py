"""The sweep list and a sweep's page in headless Chromium against a real server with auth on:
counts by outcome, the trials table (sortable by any column, the objective's best row
highlighted, states live), every trial's curve of the chosen metric overlaid, the objective
against each axis, and another owner's sweep not shown."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.states import JobState
from service.store.sweeps import metrics as sweep_metrics
from tests.web.auth_pages import NOT_FOUND, bearer, live_server, sign_in, tokens
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

LRS = [0.001, 0.01, 0.1]
HIDDEN = [8, 16]


def submit_sweep(srv: LiveServer, token: str, name: str) -> dict[str, Any]:
    """A 3 × 2 grid over lr and hidden (6 trials, queued), minimising the last loss."""
    body = {
        "name": name,
        "base": {"name": name, "task": "regression", "training": {"max_steps": 50},
                 "priority": 1000},
        "axes": {"training.lr": {"grid": LRS}, "config.hidden": {"grid": HIDDEN}},
        "objective": {"metric": "loss", "mode": "min", "at": "last"},
    }  # fmt: skip
    res = srv.api.post("/sweeps", json=body, headers=bearer(token))
    assert res.status_code == 201, res.text
    sweep: dict[str, Any] = res.json()
    return sweep


def trial_rows(srv: LiveServer, token: str, sweep_id: int) -> list[dict[str, Any]]:
    res = srv.api.get(f"/sweeps/{sweep_id}/trials", headers=bearer(token))
    assert res.status_code == 200, res.text
    rows: list[dict[str, Any]] = res.json()["trials"]
    return rows


def column(page: Any, key: str) -> list[str]:
    """The trials table's texts of column ``key`` (its header's data-key), top to bottom."""
    heads = page.locator("#trials-head th").evaluate_all("ths => ths.map(th => th.dataset.key)")
    index = heads.index(key) + 1
    texts: list[str] = page.locator(f"#trials-body tr td:nth-child({index})").all_inner_texts()
    return texts


def expect_column(page: Any, key: str, texts: list[str]) -> None:
    """Wait until column ``key`` reads ``texts`` (a sort loads its page from the server)."""
    heads = page.locator("#trials-head th").evaluate_all("ths => ths.map(th => th.dataset.key)")
    index = heads.index(key) + 1
    # 15 s, not Playwright's 5: on a loaded 2-core box the server's sort can take seconds.
    cells = page.locator(f"#trials-body tr td:nth-child({index})")
    expect(cells).to_have_text(texts, timeout=15_000)


def test_sweep_list_and_page_show_trials_curves_and_the_best(
    open_page: OpenPage, live_server: LiveServer, tokens: dict[str, str]
) -> None:
    srv = live_server
    sweep = submit_sweep(srv, tokens["alice"], "lr-grid")
    theirs = submit_sweep(srv, tokens["bob"], "bobs-grid")
    rows = trial_rows(srv, tokens["alice"], sweep["id"])
    assert len(rows) == 6
    # Final losses: trial 3 ends lowest (the best); trial 5 stays queued with no points.
    finals = {0: 0.9, 1: 0.7, 2: 0.5, 3: 0.05, 4: 0.3}
    for pos, final in finals.items():
        job_id = rows[pos]["job_id"]
        srv.start(job_id)
        srv.report(job_id, [2.0, 1.0 + pos / 10, final], total_steps=50)
        if pos in (0, 1, 3):
            srv.finish(job_id, JobState.SUCCEEDED)
    srv.report(rows[4]["job_id"], [0.8], name="eval_loss", first_step=3, total_steps=50)
    # bob's trials stay queued behind alice's (srv.start claims by priority, then id).

    w = open_page("/sweeps")
    sign_in(w, tokens["alice"])
    page = w.page
    listed = page.locator("#sweeps-body tr")
    expect(listed).to_have_count(1)
    expect(listed.first).to_have_attribute("data-sweep-id", str(sweep["id"]))
    expect(listed.first.locator("td.trials")).to_contain_text("6 trials")
    expect(listed.first.locator('td.trials .badge[data-state="succeeded"]')).to_have_text(
        "3 succeeded"
    )
    expect(listed.first.locator('td.trials .badge[data-state="running"]')).to_have_text("2 running")
    expect(listed.first.locator("td.best")).to_contain_text("0.05")
    assert "bobs-grid" not in page.content()
    w.screenshot("sweeps-list")
    listed.first.locator("a.sweep-link").click()

    page.wait_for_url(f"**/sweeps/{sweep['id']}")
    best_job = rows[3]["job_id"]
    expect(page.locator("#trials-body tr")).to_have_count(6)
    expect(page.locator("#trials-body tr.best")).to_have_attribute("data-job-id", str(best_job))
    expect(page.locator("#trials-body tr.best td.objective")).to_have_text("0.05")
    expect(page.locator("#f-best")).to_contain_text(f"#{best_job}")
    # Every trial that reported loss is drawn, the best one on top.
    plot = page.locator("#curves-plot")
    expect(plot).to_have_attribute("data-runs", "5")
    expect(plot).to_have_attribute("data-points", "15")
    expect(plot).to_have_attribute("data-best", str(best_job))
    expect(page.locator("#metric-name")).to_have_value("loss")
    # The objective against each axis: one scatter per axis, a point per scored trial.
    for axis in ("training.lr", "config.hidden"):
        expect(page.locator(f'.scatter[data-axis="{axis}"] .plot')).to_have_attribute(
            "data-points", "5"
        )

    # Sorting: by the objective (missing last), then the other way, then by an axis.
    page.click('#trials-head th[data-key="objective"] button')
    expect(page.locator('#trials-head th[data-key="objective"]')).to_have_attribute(
        "aria-sort", "ascending"
    )
    expect_column(page, "objective", ["0.05", "0.3", "0.5", "0.7", "0.9", "–"])
    page.click('#trials-head th[data-key="objective"] button')
    expect_column(page, "objective", ["0.9", "0.7", "0.5", "0.3", "0.05", "–"])
    page.click('#trials-head th[data-key="axis:training.lr"] button')
    expect_column(page, "axis:training.lr", ["0.001", "0.001", "0.01", "0.01", "0.1", "0.1"])
    # From the keyboard too: the header keeps its focus across the re-sort and the polls.
    page.focus('#trials-head th[data-key="axis:config.hidden"] button')
    page.keyboard.press("Enter")
    page.keyboard.press("Enter")
    expect_column(page, "axis:config.hidden", ["16"] * 3 + ["8"] * 3)
    page.wait_for_timeout(2500)  # one poll later
    focused = page.evaluate("() => document.activeElement.closest('th').dataset.key")
    assert focused == "axis:config.hidden"
    # The best five trials open side by side on the compare page.
    best_five = [rows[p]["job_id"] for p in (3, 4, 2, 1, 0)]
    expect(page.locator("#compare-best")).to_have_attribute(
        "href", "/compare?jobs=" + ",".join(map(str, best_five))
    )

    page.check("#log-scale")
    expect(plot).to_have_attribute("data-runs", "5")
    page.uncheck("#log-scale")
    # Another metric: only the trials that reported it.
    page.select_option("#metric-name", "eval_loss")
    expect(plot).to_have_attribute("data-runs", "1")
    expect(plot).to_have_attribute("data-metric", "eval_loss")
    page.select_option("#metric-name", "loss")
    expect(plot).to_have_attribute("data-runs", "5")
    plot.scroll_into_view_if_needed()
    box = plot.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.4)
    expect(page.locator("#curves-readout")).to_contain_text(" at step ")
    w.screenshot("sweep-page-desktop")

    # States are live: a running trial that fails shows without a reload, and the sort holds.
    srv.finish(rows[2]["job_id"], JobState.FAILED, error="boom")
    failed_row = page.locator(f'#trials-body tr[data-job-id="{rows[2]["job_id"]}"]')
    expect(failed_row).to_have_attribute("data-outcome", "failed")
    expect(page.locator('#sweep-counts .badge[data-state="failed"]')).to_have_text("1 failed")
    expect_column(page, "axis:config.hidden", ["16"] * 3 + ["8"] * 3)
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)  # the charts follow their box's width on the next frame
    no_horizontal_overflow(page)
    w.screenshot("sweep-page-phone")

    # A trial's job links back to its sweep, on its page and in the job list.
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(f"{w.base_url}/jobs/{best_job}")
    expect(page.locator("#f-sweep")).to_have_text(f"sweep #{sweep['id']}")
    page.goto(w.base_url + "/")
    expect(page.locator(f'tr[data-job-id="{best_job}"] a.sweep-link')).to_have_attribute(
        "href", f"/sweeps/{sweep['id']}"
    )

    # bob's sweep is "not found" to alice, with nothing of it on the page.
    w.allow_console(NOT_FOUND)
    page.goto(f"{w.base_url}/sweeps/{theirs['id']}")
    expect(page.locator("#not-found")).to_be_visible()
    expect(page.locator("#sweep-body")).to_be_hidden()
    assert "bobs-grid" not in page.content()


def test_sweep_page_says_when_long_histories_are_sampled(
    open_page: OpenPage,
    live_server: LiveServer,
    tokens: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    srv = live_server
    for owner, token in tokens.items():  # no queued trial of another test ahead in the queue
        listed = srv.api.get("/sweeps", headers=bearer(token)).json()["sweeps"]
        for old in listed:
            if old["state"] == "running":
                res = srv.api.post(f"/sweeps/{old['id']}/cancel", headers=bearer(token))
                assert res.status_code == 202, f"{owner}: {res.text}"
    # The server runs in this process: a read budget of 5 points makes every long trial sampled.
    monkeypatch.setitem(sweep_metrics.MAX_SCANNED_POINTS, "sqlite", 5)
    sweep = submit_sweep(srv, tokens["alice"], "long-histories")
    rows = trial_rows(srv, tokens["alice"], sweep["id"])
    for row in rows[:2]:
        srv.start(row["job_id"])
        srv.report(row["job_id"], [1.0 / (1 + i) for i in range(1500)], total_steps=1500)

    w = open_page(f"/sweeps/{sweep['id']}")
    sign_in(w, tokens["alice"])
    plot = w.page.locator("#curves-plot")
    expect(plot).to_have_attribute("data-runs", "2")
    expect(w.page.locator("#curves-sampled")).to_be_visible()
    points = int(plot.get_attribute("data-points") or 0)
    assert 0 < points <= 2 * 1000, "at most the page's 1,000 points per trial (6 trials)"


def test_a_failed_trial_is_never_the_highlighted_best(
    open_page: OpenPage, live_server: LiveServer, tokens: dict[str, str]
) -> None:
    srv = live_server
    for token in tokens.values():  # no queued trial of another test ahead in the queue
        for old in srv.api.get("/sweeps", headers=bearer(token)).json()["sweeps"]:
            if old["state"] == "running":
                srv.api.post(f"/sweeps/{old['id']}/cancel", headers=bearer(token))
    sweep = submit_sweep(srv, tokens["alice"], "failed-not-best")
    rows = trial_rows(srv, tokens["alice"], sweep["id"])
    # Trial 0 reports the lowest loss, then fails; trial 1 runs on lower than trial 2 ended.
    for pos, final in {0: 0.01, 1: 0.2, 2: 0.4}.items():
        job_id = rows[pos]["job_id"]
        srv.start(job_id)
        srv.report(job_id, [1.0, final], total_steps=50)
    srv.finish(rows[0]["job_id"], JobState.FAILED, error="boom")
    srv.finish(rows[2]["job_id"], JobState.SUCCEEDED)

    w = open_page(f"/sweeps/{sweep['id']}")
    sign_in(w, tokens["alice"])
    page = w.page
    running = rows[1]["job_id"]
    expect(page.locator("#trials-body tr.best")).to_have_attribute("data-job-id", str(running))
    expect(page.locator("#f-best")).to_contain_text(f"#{running}, still running")
    expect(page.locator("#compare-best")).to_have_attribute(
        "href", f"/compare?jobs={running},{rows[2]['job_id']}"
    )
    page.goto(w.base_url + "/sweeps")
    expect(page.locator("#sweeps-body tr").first.locator("td.best")).to_contain_text("(running)")


# Each scatter's drawn points, in CSS pixels of its plot area, with that area's size.
SCATTER_POINTS_JS = """plot => {
  const u = plot.ddpqChart;
  const ratio = window.devicePixelRatio || 1;
  const width = u.bbox.width / ratio;
  const height = u.bbox.height / ratio;
  const points = [];
  for (let s = 1; s < u.data.length; s += 1) {
    u.data[s].forEach((y, i) => {
      if (y !== null && y !== undefined)
        points.push([u.valToPos(u.data[0][i], "x"), u.valToPos(y, "y")]);
    });
  }
  return {width: width, height: height, points: points};
}"""


def test_scatter_points_sit_inside_the_plot(
    open_page: OpenPage, live_server: LiveServer, tokens: dict[str, str]
) -> None:
    srv = live_server
    for token in tokens.values():  # no queued trial of another test ahead in the queue
        for old in srv.api.get("/sweeps", headers=bearer(token)).json()["sweeps"]:
            if old["state"] == "running":
                srv.api.post(f"/sweeps/{old['id']}/cancel", headers=bearer(token))
    sweep = submit_sweep(srv, tokens["alice"], "scatter-edges")
    rows = trial_rows(srv, tokens["alice"], sweep["id"])
    # lr spans two decades (a log x axis), hidden two values (a linear one); every trial scored.
    for pos, final in enumerate([0.9, 0.7, 0.5, 0.05, 0.3, 0.6]):
        job_id = rows[pos]["job_id"]
        srv.start(job_id)
        srv.report(job_id, [1.0, final], total_steps=50)
        srv.finish(job_id, JobState.SUCCEEDED)

    w = open_page(f"/sweeps/{sweep['id']}")
    sign_in(w, tokens["alice"])
    page = w.page
    for axis in ("training.lr", "config.hidden"):
        plot = page.locator(f'.scatter[data-axis="{axis}"] .plot')
        expect(plot).to_have_attribute("data-points", "6")
        drawn = plot.evaluate(SCATTER_POINTS_JS)
        assert len(drawn["points"]) == 6, drawn
        # Strictly inside, with room for the best point's marker (11 px across).
        margin = 6
        for x, y in drawn["points"]:
            assert margin < x < drawn["width"] - margin, (axis, drawn)
            assert margin < y < drawn["height"] - margin, (axis, drawn)
    w.screenshot("sweep-scatters")
