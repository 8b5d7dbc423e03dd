"""What a Slurm submission leaves on disk and hands sbatch: submitit's folder (mode 0700) holds
the attempt token in its pickle and no database URL anywhere; sbatch runs with the allow-listed
environment only (it exports its whole environment to the job). No cluster needed: stand-in
``sbatch``/``srun`` scripts on PATH answer as Slurm does, and sbatch's stand-in records the
environment it got.
"""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import pytest

from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from worker.attempt import ATTEMPT_TOKEN, DATABASE_URL
from worker.launchers.base import with_attempt_token
from worker.launchers.slurm.launcher import SlurmLauncher
from worker.launchers.slurm.rank import SlurmRank

SECRET = "s3cret-db-password"
DB_URL = f"postgresql+psycopg://ddpq:{SECRET}@db.example/ddpq"
TOKEN = "ddpqa_attempt-token-for-the-test"
FAKE_SBATCH = """#!/bin/sh
env > "$FAKE_SBATCH_ENV_FILE.$$"
mv "$FAKE_SBATCH_ENV_FILE.$$" "$FAKE_SBATCH_ENV_FILE"
echo "Submitted batch job 4242"
"""


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``sbatch``/``srun`` stand-ins first on PATH; the worker's environment holds secrets.

    Returns:
        The file the stand-in sbatch writes its environment to.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env_file = tmp_path / "sbatch-env.txt"
    (bin_dir / "sbatch").write_text(FAKE_SBATCH.replace("$FAKE_SBATCH_ENV_FILE", str(env_file)))
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    for name in ("sbatch", "srun"):
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv(DATABASE_URL, DB_URL)
    monkeypatch.setenv("DDPQ_TOKEN", "ddpq_user-token-secret")
    return env_file


def test_the_folder_holds_the_token_in_the_pickle_only_and_no_database_url(
    tmp_path: Path, fake_slurm: Path
) -> None:
    settings = Settings(
        database_url=DB_URL,
        artifact_dir=tmp_path / "artifacts",
        slurm_enabled=True,
        api_url="http://api.example:8000",
    )
    launcher = SlurmLauncher(settings, cwd=tmp_path)
    spec = JobSpec.model_validate(
        {"name": "s", "task": "regression", "launcher": "slurm",
         "resources": {"nproc_per_node": 2, "timeout_min": 5}}
    )  # fmt: skip
    plan = with_attempt_token(launcher.plan(spec, 7, 1), TOKEN)
    assert launcher.start(plan) == "4242"

    folder = artifacts.slurm_dir(settings.resolved_artifact_dir, 7, 1)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700, "submitit's folder must be owner-only"
    files = [p for p in folder.rglob("*") if p.is_file()]
    pickles = [p for p in files if p.suffix == ".pkl"]
    assert pickles, f"submitit should have pickled the SlurmRank into {folder}: {files}"
    for path in files:
        data = path.read_bytes()
        assert SECRET.encode() not in data and b"ddpq_user-token" not in data, (
            f"{path} holds a secret of the worker"
        )
        if path.suffix != ".pkl":
            assert TOKEN.encode() not in data, f"the token may travel in the pickle only: {path}"
    ranks = [_pickled_rank(p) for p in pickles]
    rank = next(r for r in ranks if r is not None)
    assert rank.env[ATTEMPT_TOKEN] == TOKEN
    assert rank.env["DDPQ_API_URL"] == "http://api.example:8000"
    assert DATABASE_URL not in rank.env

    sbatch_env = fake_slurm.read_text()
    assert SECRET not in sbatch_env and "DDPQ_TOKEN" not in sbatch_env, (
        "sbatch exports its whole environment to the job: it must get the allow-list only"
    )
    assert TOKEN not in sbatch_env and "PATH=" in sbatch_env

    spec_file = artifacts.spec_path(settings.resolved_artifact_dir, 7, 1)
    assert JobSpec.model_validate_json(spec_file.read_text()) == spec
    assert stat.S_IMODE(spec_file.stat().st_mode) == 0o600


def _pickled_rank(path: Path) -> SlurmRank | None:
    """The SlurmRank in one of submitit's pickles (a DelayedSubmission), if any."""
    with open(path, "rb") as fh:
        obj = pickle.load(fh)
    function = getattr(obj, "function", None)
    return function if isinstance(function, SlurmRank) else None
