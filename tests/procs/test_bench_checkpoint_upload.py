"""Benchmark #8 (checkpoint uploads) runs at its tiny size and produces its ratios (figures
not judged: a shared 2-core box says nothing about speed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import checkpoint_upload  # noqa: E402


@pytest.mark.slow
def test_checkpoint_upload_tiny(tmp_path: Path) -> None:
    res = checkpoint_upload.run("tiny", workdir=tmp_path)
    keys = ["stall_upload_vs_shared"]
    for phase in ("same_host", "api_niced"):
        keys += [f"upload_vs_plain_copy_{phase}", f"training_during_upload_vs_without_{phase}"]
        assert len(res.figures[phase]["upload_s"]) == res.figures["reps"], "every upload"
    for key in keys:
        value = res.ratios.get(key)
        assert isinstance(value, float) and value > 0, f"{key}: {value!r} in {res.ratios}"
    assert set(res.goals) == {"upload>=0.5_copy", "training>=0.9_during_upload",
                              "stall_unchanged"}  # fmt: skip
