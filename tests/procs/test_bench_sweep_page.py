"""The sweep page benchmark runs at its tiny size: every trial's curve comes back, within the
page's point budget, on both databases (figures not judged)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# bench/ is not an installed package (pyproject installs service*, worker*, migrations*).
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import sweep_page  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DDPQ_TEST_SKIP_PG") == "1", reason="DDPQ_TEST_SKIP_PG=1")
def test_sweep_page_tiny(tmp_path: Path) -> None:
    res = sweep_page.run("tiny", workdir=tmp_path)
    trials, points = res.figures["trials"], res.figures["points_per_trial"]
    for db in ("postgresql", "sqlite"):
        fig = res.figures[db]
        assert fig["metrics_rows"] == trials * points, fig
        assert fig["curve_trials"] == trials, f"{db}: every trial's curve in one call: {fig}"
        assert 0 < fig["curve_points"] <= sweep_page.POINT_BUDGET, fig
        ratio = res.ratios[f"{db}_page_p50_vs_goal"]
        assert isinstance(ratio, float) and ratio > 0, res.ratios
    assert set(res.goals) == {"postgresql_page<=1s", "sqlite_page<=1s"}
