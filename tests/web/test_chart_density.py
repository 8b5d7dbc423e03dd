"""A long metric history on the job page, in headless Chromium against a real server and
SQLite: a 7,500-point series draws a line without a marker on every point, and a series
whose every point is rank 0's own value is one curve with one legend entry."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.metrics.points import RANK0_ONLY
from service.store.metrics.points import MetricPoint, record_metrics

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

pytestmark = pytest.mark.slow

STEPS = 7500

# Each series of the metric's chart: its label and whether uPlot draws its markers now.
SERIES_JS = """plot => {
  const u = plot.ddpqChart;
  return u.series.slice(1).map((s, i) => {
    const show = s.points && s.points.show;
    return {label: s.label, markers: Boolean(typeof show === "function" ? show(u, i + 1) : show)};
  });
}"""


def test_a_long_series_draws_no_markers_and_one_legend_entry(
    open_page: Any, live_server: Any
) -> None:
    srv = live_server
    job_id = srv.submit("long-history", priority=1000)["id"]
    srv.start(job_id)

    def history(name: str, rank0: Any) -> list[MetricPoint]:
        return [
            MetricPoint(
                name=name, step=s, value=1.0 / s, epoch=s // 1000,
                ranks=RANK0_ONLY if rank0(s) else 2,
            )
            for s in range(1, STEPS + 1)
        ]  # fmt: skip

    # loss: rank 0's own values throughout (not averaged); grad_norm: every other step.
    points = history("loss", lambda s: True) + history("grad_norm", lambda s: s % 2 == 0)
    with srv.db.session() as session:
        record_metrics(session, job_id, 1, points, progress={"step": STEPS, "total_steps": STEPS})

    w = open_page(f"/jobs/{job_id}")
    page = w.page
    loss = page.locator('.chart[data-metric="loss"]')
    expect(loss.locator("canvas")).to_be_visible()
    expect(loss).to_have_attribute("data-last-step", str(STEPS))
    expect(loss.locator(".u-legend .u-series")).to_have_count(2)  # step, loss
    assert loss.locator(".u-legend .u-series th").all_inner_texts() == ["step", "loss"]
    assert loss.locator(".plot").evaluate(SERIES_JS) == [{"label": "loss", "markers": False}]
    expect(loss.locator("h3 .latest")).to_contain_text("rank 0's own values")
    expect(loss).to_have_attribute("data-rank0-only", "true")

    grad = page.locator('.chart[data-metric="grad_norm"]')
    expect(grad).to_have_attribute("data-last-step", str(STEPS))
    expect(grad).to_have_attribute("data-rank0-only", "false")
    # Rank 0's points among averaged ones: marked red, but by a line, not a ring per point.
    assert grad.locator(".plot").evaluate(SERIES_JS) == [
        {"label": "grad_norm (rank 0 only)", "markers": False},
        {"label": "grad_norm", "markers": False},
    ]
    w.screenshot("chart-long-history")
