"""The ``ddpq`` library in a fresh interpreter and under plain torchrun: importing it loads
neither torch nor ddpq's service or worker, and the example script with ddpq's calls runs
under torchrun alone (points printed, checkpoints in ./ddpq-checkpoints/, a resume)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "tutorial" / "train_ddpq.py"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPQ_")}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return {**env, **extra}


def test_import_ddpq_loads_no_torch_and_none_of_ddpqs_service(tmp_path: Path) -> None:
    code = (
        "import json, sys, ddpq\n"
        "mods = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'service', 'worker', 'httpx', 'pydantic', 'numpy'))\n"
        "print(json.dumps(mods))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=clean_env(), capture_output=True,
        text=True, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout) == []


def test_the_example_runs_under_plain_torchrun_and_resumes_from_its_local_checkpoint(
    tmp_path: Path,
) -> None:
    shutil.copy(SCRIPT, tmp_path / "train.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone", "train.py"]  # fmt: skip
    env = clean_env(DDPQ_LOG_EVERY="16", OMP_NUM_THREADS="1")
    first = subprocess.run(
        [*torchrun, "--epochs", "2"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    points = [line for line in first.stdout.splitlines() if line.startswith("[ddpq] ")]
    # 1,024 samples per rank / 64 per batch = 16 steps an epoch; rank 0 alone prints.
    assert [p.split(":")[0] for p in points] == ["[ddpq] epoch 0 step 16", "[ddpq] epoch 1 step 32"]
    saved = sorted(p.name for p in (tmp_path / "ddpq-checkpoints").iterdir())
    assert saved == ["step-16.pt", "step-32.pt"]

    second = subprocess.run(
        [*torchrun, "--epochs", "3"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("resuming at epoch 2 (step 32)") == 2, "every rank resumes"
    points = [line for line in second.stdout.splitlines() if line.startswith("[ddpq] ")]
    assert [p.split(":")[0] for p in points] == ["[ddpq] epoch 2 step 48"]


@pytest.mark.parametrize("imported_first", [True, False])
def test_a_project_with_its_own_worker_module_is_told_why_ddpq_cannot_run(
    tmp_path: Path, imported_first: bool
) -> None:
    """ddpq's runtime is the top-level package ``worker``: a script with its own module of that
    name gets the reason and the fix at its first ddpq call, not a confusing import error."""
    (tmp_path / "worker.py").write_text("HELPER = 1\n")
    (tmp_path / "script.py").write_text(
        ("import worker\n" if imported_first else "")
        + "import ddpq\n"
        + "try:\n    ddpq.report(1, loss=1.0)\n"
        + "except ImportError as exc:\n    print('refused:', exc)\n"
    )
    env = clean_env(DDPQ_JOB_ID="1", DDPQ_ATTEMPT_TOKEN="ddpqa_x")
    out = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "refused: ddpq's runtime is the top-level package 'worker'" in out.stdout, out.stdout
    assert str(tmp_path / "worker.py") in out.stdout
