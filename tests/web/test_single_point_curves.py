"""Curves of a single point (an eval metric reported once per epoch, a 1-epoch trial) in
headless Chromium against a real server with auth on: drawn as visible markers on the sweep
page, the compare page and the job page, also when every curve's point is at one step. The
checks read the chart's own canvas: a line through one point draws no pixel at all."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.states import JobState
from tests.web.auth_pages import bearer, live_server, run_job, sign_in, tokens
from tests.web.conftest import LiveServer, OpenPage

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

__all__ = ["live_server", "tokens"]  # the module's fixtures (auth on)
pytestmark = pytest.mark.slow

EVAL_STEP = 50  # the end of the one epoch: every trial's eval point is at this step

# Each drawn series of a uPlot chart: its points (x, y pairs), the size of its markers, and
# how many pixels of the plot area are drawn in its own colour (markers or lines).
DRAWN_JS = """plot => {
  const u = plot.ddpqChart;
  const probe = document.createElement("canvas").getContext("2d", {willReadFrequently: true});
  function rgb(color) {
    probe.clearRect(0, 0, 1, 1);
    probe.fillStyle = color;
    probe.fillRect(0, 0, 1, 1);
    return Array.from(probe.getImageData(0, 0, 1, 1).data.slice(0, 3));
  }
  const b = u.bbox;
  const m = 8 * (window.devicePixelRatio || 1);  // markers may reach past the plot's edge
  const pixels = u.ctx.getImageData(b.left - m, b.top - m, b.width + 2 * m, b.height + 2 * m).data;
  return u.series.slice(1).map((s, i) => {
    const si = i + 1;
    const cols = u.mode === 2 ? u.data[si] : [u.data[0], u.data[si]];
    const points = cols[0].map((x, k) => [x, cols[1][k]]).filter((p) => p[1] !== null);
    const want = rgb(s._stroke || s.stroke(u, si));
    let painted = 0;
    for (let k = 0; k < pixels.length; k += 4) {
      if (pixels[k + 3] < 200) continue;
      const d = Math.abs(pixels[k] - want[0]) + Math.abs(pixels[k + 1] - want[1]) +
        Math.abs(pixels[k + 2] - want[2]);
      if (d < 24) painted += 1;
    }
    return {label: s.label, points: points, size: s.points.size, painted: painted,
            xRange: [u.scales.x.min, u.scales.x.max]};
  });
}"""


def drawn(page: Any, selector: str) -> list[dict[str, Any]]:
    """What the uPlot chart in ``selector`` (a .plot element) drew, per series."""
    plot = page.locator(selector)
    plot.wait_for(state="attached")
    page.wait_for_function(
        "sel => { const p = document.querySelector(sel); return p && p.ddpqChart; }", arg=selector
    )
    result: list[dict[str, Any]] = plot.evaluate(DRAWN_JS)
    return result


def assert_visible_points(series: list[dict[str, Any]], where: str) -> None:
    """Every series drew its single point as a marker one can see (≥ 5 px across)."""
    for s in series:
        assert len(s["points"]) == 1, f"{where}: {s['label']} should hold its one point: {s}"
        assert s["size"] >= 5, f"{where}: {s['label']}'s markers are too small to see: {s}"
        # A 5 px marker paints ~20 pixels; a line through one point paints none.
        assert s["painted"] >= 12, (
            f"{where}: {s['label']}'s single point is not drawn (a line needs two points: "
            f"draw it as a marker with uPlot's points options): {s}"
        )
        lo, hi = s["xRange"]
        assert lo <= s["points"][0][0] <= hi, f"{where}: the point is off the plot: {s}"


def test_a_one_epoch_sweeps_eval_curves_are_visible_points(
    open_page: OpenPage, live_server: LiveServer, tokens: dict[str, str]
) -> None:
    srv = live_server
    body = {
        "name": "one-epoch",
        "base": {"name": "one-epoch", "task": "regression", "priority": 1000,
                 "training": {"epochs": 1, "max_steps": EVAL_STEP}},
        "axes": {"training.lr": {"grid": [0.001, 0.01, 0.1]}},
        "objective": {"metric": "eval_loss", "mode": "min", "at": "last"},
    }  # fmt: skip
    res = srv.api.post("/sweeps", json=body, headers=bearer(tokens["alice"]))
    assert res.status_code == 201, res.text
    sweep = res.json()
    trials = srv.api.get(f"/sweeps/{sweep['id']}/trials", headers=bearer(tokens["alice"]))
    rows = trials.json()["trials"]
    for pos, final in enumerate([0.5, 0.2, 0.8]):
        job_id = rows[pos]["job_id"]
        srv.start(job_id)
        srv.report(job_id, [2.0 + pos, 1.5 + pos, 1.0 + pos], total_steps=EVAL_STEP)
        srv.report(job_id, [final], name="eval_loss", first_step=EVAL_STEP, total_steps=EVAL_STEP)
        srv.finish(job_id, JobState.SUCCEEDED)

    w = open_page(f"/sweeps/{sweep['id']}")
    sign_in(w, tokens["alice"])
    page = w.page
    plot = page.locator("#curves-plot")
    expect(plot).to_have_attribute("data-metric", "eval_loss")  # the objective's metric
    expect(plot).to_have_attribute("data-runs", "3")
    expect(plot).to_have_attribute("data-points", "3")
    series = drawn(page, "#curves-plot")
    assert [s["points"][0][0] for s in series] == [EVAL_STEP] * 3, series
    lo, hi = series[0]["xRange"]
    assert lo < EVAL_STEP < hi, f"curves all at one step need an x range around it: {series}"
    assert_visible_points(series, "sweep page")
    w.screenshot("sweep-single-points")

    # The compare page: every picked job is drawn, a job with one point as well.
    ids = [rows[pos]["job_id"] for pos in range(3)]
    page.goto(f"{w.base_url}/compare?jobs={','.join(map(str, ids))}")
    chart = '.chart[data-metric="eval_loss"] .plot'
    expect(page.locator(chart)).to_have_attribute("data-runs", "3")
    assert_visible_points(drawn(page, chart), "compare page")
    # Curves of several points keep their lines (no marker needed, none drawn over them).
    loss = drawn(page, '.chart[data-metric="loss"] .plot')
    assert [len(s["points"]) for s in loss] == [3, 3, 3], loss
    assert all(s["painted"] > 0 for s in loss), loss
    w.screenshot("compare-single-points")

    # The job page: its one eval point too.
    page.goto(f"{w.base_url}/jobs/{ids[1]}")
    assert_visible_points(drawn(page, '.chart[data-metric="eval_loss"] .plot'), "job page")


def test_a_job_with_one_point_is_compared_with_longer_ones(
    open_page: OpenPage, live_server: LiveServer, tokens: dict[str, str]
) -> None:
    srv = live_server
    short = run_job(srv, tokens["alice"], "one-point", {"loss": [0.9]})
    long = run_job(srv, tokens["alice"], "four-points", {"loss": [2.0, 1.5, 1.2, 1.0]})

    w = open_page(f"/compare?jobs={short['id']},{long['id']}")
    sign_in(w, tokens["alice"])
    page = w.page
    chart = '.chart[data-metric="loss"] .plot'
    expect(page.locator(chart)).to_have_attribute("data-runs", "2")
    expect(page.locator(chart)).to_have_attribute("data-points", "5")
    one, four = drawn(page, chart)
    assert_visible_points([one], "compare page")
    assert len(four["points"]) == 4 and four["painted"] > 0, four
