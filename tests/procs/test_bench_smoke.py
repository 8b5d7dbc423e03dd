"""Each benchmark runs at its tiny size and produces its ratio fields (figures not judged)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

# bench/ is not an installed package (pyproject installs service*, worker*, migrations*).
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import (  # noqa: E402
    api,
    checkpoint,
    claims,
    hostile,
    ingest,
    launch,
    reporting,
    rollups,
    scale,
)
from bench.common import BenchResult  # noqa: E402

NEEDS_PG = os.environ.get("DDPQ_TEST_SKIP_PG") == "1"
skip_no_pg = pytest.mark.skipif(NEEDS_PG, reason="DDPQ_TEST_SKIP_PG=1")


def _measured(res: BenchResult, *keys: str) -> None:
    for key in keys:
        value = res.ratios.get(key)
        assert isinstance(value, float) and value > 0, (
            f"{res.name}: ratio {key!r} should be a positive number, got {value!r}; "
            f"all ratios: {res.ratios}"
        )
    assert res.goals, f"{res.name}: no goal verdicts"


@pytest.mark.slow
def test_reporting_tiny(tmp_path: Path) -> None:
    res = reporting.run("tiny", workdir=tmp_path, mlflow=False)
    _measured(res, "ddpq_vs_none", "naive_vs_none")
    fig = res.figures
    # Every report()ed point reached the database (steps × reps on rank 0).
    assert fig["points_written"] == fig["steps_per_rep"] * fig["reps"], fig
    assert fig["report_call_p99_us"] > 0
    assert fig["lib_points_written"] == fig["steps_per_rep"] * fig["reps"], "ddpq.report's too"


@pytest.mark.slow
@skip_no_pg
def test_claims_tiny(tmp_path: Path) -> None:
    res = claims.run("tiny", workdir=tmp_path)
    _measured(res, "sqlite_vs_goal", "postgresql_vs_goal")
    for dialect in ("sqlite", "postgresql"):
        fig = res.figures[dialect]
        assert fig["duplicates"] == 0 and fig["claims"] == res.figures["jobs"], fig
        assert fig["starting_rows"] == res.figures["jobs"], fig


@pytest.mark.slow
@skip_no_pg
def test_rollups_tiny(tmp_path: Path) -> None:
    res = rollups.run("tiny", workdir=tmp_path)
    _measured(res, "sqlite_ingest_cost_with_vs_without", "postgresql_read_time_vs_rollups")
    for dialect in ("sqlite", "postgresql"):
        fig = res.figures[dialect]
        assert 2 < fig["chart_points"] <= rollups.CHART_MAX_POINTS, fig
        assert fig["rollup_rows"] > 0, fig


@pytest.mark.slow
@skip_no_pg
def test_ingest_tiny() -> None:
    _measured(ingest.run("tiny"), "ddpq_vs_plain_b50")


@pytest.mark.slow
def test_checkpoint_tiny(tmp_path: Path) -> None:
    res = checkpoint.run("tiny", workdir=tmp_path)
    _measured(res, "ddpq_vs_torch_save", "ddpq_vs_dcp_async_save")
    assert all(v > 0 for v in res.figures["stall_s_median"].values()), res.figures


@pytest.mark.slow
def test_launch_tiny(tmp_path: Path) -> None:
    res = launch.run("tiny", workdir=tmp_path)
    _measured(res, "ddpq_vs_bare")
    assert res.figures["seconds_median"]["bare"] > 0


@pytest.mark.slow
@skip_no_pg
def test_api_tiny(tmp_path: Path) -> None:
    res = api.run("tiny", workdir=tmp_path)
    _measured(res, "get_job_vs_goal")
    assert res.figures["poll_p99_ms"] > 0


@pytest.mark.slow
@skip_no_pg
def test_scale_tiny(tmp_path: Path) -> None:
    res = scale.run("tiny", workdir=tmp_path)
    _measured(res, "stored_vs_sent", "lag_p99_vs_goal")
    # The tiny run's load lasts 5 s: on a busy box no poll may be answered inside it, and the
    # poll ratio is then None (said so), not a made-up number.
    assert "poll_p99_vs_goal" in res.ratios, res.ratios
    fig = res.figures
    # Exactly once is a correctness check, not a timing: it must hold on any machine.
    assert res.goals["exactly_once"], fig
    assert fig["points_stored"] == fig["points_sent"] > 0, fig
    assert fig["missing"] == fig["duplicates"] == 0, fig


@pytest.mark.slow
@skip_no_pg
def test_sweeps_tiny(tmp_path: Path) -> None:
    from bench import sweeps

    res = sweeps.run("tiny", workdir=tmp_path)
    _measured(res, "sqlite_sweep_vs_single_posts", "postgresql_sweep_vs_goal")
    assert res.goals["sqlite_all_trials_stored"] and res.goals["postgresql_all_trials_stored"]


@pytest.mark.slow
@skip_no_pg
def test_sweep_trials_tiny(tmp_path: Path) -> None:
    from bench import sweep_trials

    res = sweep_trials.run("tiny", workdir=tmp_path)
    _measured(res, "sqlite_first_load_vs_old", "postgresql_poll_bytes_vs_old")
    for db in ("sqlite", "postgresql"):
        fig = res.figures[db]
        # Each poll brought the running trials that reported (not the whole table).
        assert fig["poll_changed_trials_max"] == res.figures["running_trials"], fig
        assert fig["poll_bytes_max"] < fig["old_poll_bytes"], fig


@pytest.mark.slow
def test_workspace_tiny(tmp_path: Path) -> None:
    from bench import workspace

    res = workspace.run("tiny", workdir=tmp_path)
    _measured(res, "upload_vs_tar_sha256", "resubmit_s_vs_0.5s", "first_line_vs_bare_torchrun")
    fig = res.figures
    # Correctness, not timing: a fresh tree sends every byte, an unchanged one none.
    assert all(u["sent_bytes"] == fig["tree"]["bytes"] for u in fig["upload"]), fig["upload"]
    assert fig["resubmit_sent_bytes_max"] == 0, fig["resubmit"]


@pytest.mark.slow
def test_followed_tiny(tmp_path: Path) -> None:
    from bench import followed

    res = followed.run("tiny", workdir=tmp_path)
    _measured(res, "followed_vs_plain_epoch_s", "import_ddpq_ms_vs_50ms")
    # Correctness, not timing: a followed run records snapshot versions, a plain run none (tiny
    # epochs last milliseconds: versions faster than their copy count as one).
    fig = res.figures
    assert fig["checkpoints_per_run"]["plain"] == [0], fig
    assert 1 <= fig["checkpoints_per_run"]["followed"][0] <= fig["epochs"], fig
    assert fig["import_ddpq_loads_torch"] is False


# The fleet's error texts that only say the box was overloaded (``bench.worker_fleet``).
OVERLOAD = re.compile(r"^(claim 503|transition 503|transport (TimeoutError|ConnectionResetError))")


def _fleet_errors(fleet: Any) -> list[str]:
    """Every run's first error answers, for the assertion's message."""
    found: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            found.extend(str(e) for e in x.get("first_errors") or ())
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(fleet)
    return found


@pytest.mark.slow
@skip_no_pg
def test_worker_api_tiny(tmp_path: Path) -> None:
    from bench import worker_api

    res = worker_api.run("tiny", workdir=tmp_path)
    _measured(res, "sqlite_long_poll_vs_poll_p50", "postgresql_long_poll_vs_poll_p50")
    _measured(res, "api_db_connections_max_vs_pools")
    # Correctness, not timing: every submitted job reached its waiting worker (run() raises
    # otherwise), every queued job was claimed exactly once with no error answer, and the
    # API never held more database connections than its two pools allow.
    assert res.goals["fleet_no_duplicates"], res.figures["fleet"]
    # An overloaded 2-core box may answer 503 or time a request out (the fleet retries; the
    # count is a figure of the bench); any other error answer (a 4xx, a 500) is a defect.
    errors = _fleet_errors(res.figures["fleet"])
    assert res.goals["fleet_no_errors"] or all(OVERLOAD.match(e) for e in errors), errors
    assert res.goals[f"api_db_connections<={worker_api.POOL_CONNECTIONS}"], res.figures["fleet"]
    for label in worker_api.SERVERS:
        assert len(res.figures["latency"][label]["long_poll"]["ms"]) == 3, res.figures["latency"]
    # Each idle fleet took every job submitted to it, once (run() raises if one was not taken).
    idle = res.figures["fleet"]["idle"]
    assert sorted(idle) == ["w10", "w40"], idle
    assert all(f["claimed"] == len(f["submit_to_claim_ms"]) == 2 for f in idle.values()), idle


@pytest.mark.slow
def test_hostile_tiny(tmp_path: Path) -> None:
    res = hostile.run("tiny", workdir=tmp_path)
    _measured(res, "a_beside_hostile_vs_alone", "poll_p99_beside_vs_alone")
    fig = res.figures
    assert fig["a_states"] == ["succeeded", "succeeded"], fig
    assert fig["a_steps_during_b"] >= 2, "A ran while B was at work"
    assert "DDPQ_METRIC_NAMES_PER_JOB" in fig["b_quota_events"], fig
    assert fig["b_files"]["stopped_by"] == "EMFILE", fig
