"""``python -m worker.runtime.agent``: torchrun's options and failure summary, with ddpq's rank
entry forked warm and any other entry run as torchrun runs it (real processes, gloo-free)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker.launchers.failure_text import ROOT_CAUSE_RE, LauncherExits
from worker.runtime.agent import warm_entry

REPO = Path(__file__).resolve().parents[2]
OPTIONS = ["--standalone", "--nnodes", "1", "--nproc_per_node", "2", "--max_restarts", "0"]


def run_agent(tmp_path: Path, *entry: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run the agent with ``entry`` as the rank entry; returns (exit code, its output)."""
    proc = subprocess.run(
        [sys.executable, "-m", "worker.runtime.agent", *OPTIONS, *entry],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout


@pytest.mark.parametrize(
    ("argv", "warm"),
    [
        ([*OPTIONS, "-m", "worker.runtime"], True),
        ([*OPTIONS, "--module", "worker.runtime"], True),
        ([*OPTIONS, "-m", "worker.runtime", "--extra"], False),
        ([*OPTIONS, "-m", "examples.train"], False),
        ([*OPTIONS, "train.py"], False),
        ([], False),
    ],
)
def test_only_ddpqs_own_rank_entry_is_forked_warm(argv: list[str], warm: bool) -> None:
    assert warm_entry(argv) is warm


def test_a_script_entry_runs_on_every_rank_as_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            out = {str(tmp_path)!r} + "/rank-" + os.environ["RANK"]
            open(out, "w").write(os.environ["WORLD_SIZE"] + " " + " ".join(sys.argv[1:]))
            """
        )
    )
    code, out = run_agent(tmp_path, str(script), "--lr", "0.1")
    assert code == 0, out
    assert (tmp_path / "rank-0").read_text() == "2 --lr 0.1"
    assert (tmp_path / "rank-1").read_text() == "2 --lr 0.1"


def test_a_failing_script_entry_gets_torchruns_failure_summary(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    code, out = run_agent(tmp_path, str(script))
    assert code != 0
    cause = ROOT_CAUSE_RE.search(out)
    assert cause is not None, out
    assert (cause["rank"], cause["exitcode"]) == ("1", "3")


def test_a_failing_warm_rank_is_reported_as_torchrun_reports_a_rank(tmp_path: Path) -> None:
    # Without DDPQ_JOB_ID & co. every rank refuses to start (exit code 1), from the forked path.
    env = {k: "" for k in ("DDPQ_JOB_ID", "DDPQ_ATTEMPT")}
    code, out = run_agent(tmp_path, "-m", "worker.runtime", env=env)
    assert code != 0
    assert "ddpq rank:" in out, out
    cause = ROOT_CAUSE_RE.search(out)
    assert cause is not None, out
    assert cause["exitcode"] == "1"
    assert "(start_method: forkserver)" in out, out
    # Every rank's exit code, not only the one torchrun's summary names: both refused (1),
    # unless torchrun's teardown after the first failure SIGTERMed the other first (-15).
    exits = LauncherExits.parse(out)
    assert set(exits.exit_codes) == {0, 1}, out
    assert exits.exit_codes[int(cause["rank"])] == 1, out
    assert set(exits.exit_codes.values()) <= {1, -15}, out
