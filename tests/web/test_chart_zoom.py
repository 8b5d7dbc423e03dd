"""Zooming into a long run's chart in headless Chromium (real server, SQLite): the page asks
the server for the zoomed step range's own curve (from the write-time rollups) and draws every
point of it, where the first load held only the whole run's min/max buckets."""

from __future__ import annotations

import math
from typing import Any

import pytest

from service.store.metrics.points import MetricPoint, record_metrics

try:
    from playwright.sync_api import expect
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip(
        "needs playwright; install with: bash scripts/install-browser.sh", allow_module_level=True
    )

pytestmark = pytest.mark.slow

STEPS = 40_000
LO, HI = 20_000, 20_400


def test_a_zoomed_range_is_fetched_again_at_full_detail(open_page: Any, live_server: Any) -> None:
    srv = live_server
    job_id = srv.submit("zoom", priority=1000)["id"]
    srv.start(job_id)
    points = [MetricPoint("loss", s, math.sin(s / 300) + (9.0 if s == 20_123 else 0.0), 0)
              for s in range(1, STEPS + 1)]  # fmt: skip
    with srv.db.session() as session:
        record_metrics(session, job_id, 1, points, progress={"step": STEPS, "total_steps": STEPS})

    page = open_page(f"/jobs/{job_id}").page
    loss = page.locator('.chart[data-metric="loss"]')
    expect(loss).to_have_attribute("data-last-step", str(STEPS))
    plot = loss.locator(".plot")
    held = plot.evaluate(f"p => p.ddpqChart.data[0].filter(x => x >= {LO} && x <= {HI}).length")
    assert held < 100, f"the first load is the whole run downsampled, not every point: {held}"
    plot.evaluate(f"p => p.ddpqChart.setScale('x', {{min: {LO}, max: {HI}}})")
    expect(loss).to_have_attribute("data-zoom", f"{LO}-{HI}", timeout=10_000)
    got = plot.evaluate(
        f"""p => {{
          const u = p.ddpqChart;
          const xs = u.data[0], ys = u.data[u.data.length - 1];
          const inside = xs.map((x, i) => [x, ys[i]]).filter(([x]) => x >= {LO} && x <= {HI});
          return {{held: inside.length, spike: inside.some(([x, y]) => x === 20123 && y > 7.5),
                   min: u.scales.x.min, max: u.scales.x.max}};
        }}"""
    )
    assert got["held"] == HI - LO + 1, f"every step of the zoomed range: {got}"
    assert got["spike"], f"the range spike is drawn: {got}"
    assert (got["min"], got["max"]) == (LO, HI), f"the chart stays zoomed: {got}"
