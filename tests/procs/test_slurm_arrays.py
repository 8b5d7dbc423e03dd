"""Slurm job arrays without a cluster: the array plan (golden file), chunking below the
cluster's MaxArraySize (read once from a stand-in ``scontrol``), sacct's array rows, and what
a submission leaves on disk and hands sbatch (stand-in ``sbatch``/``srun`` on PATH).

Regenerate the golden file after an intended change:
``DDPQ_UPDATE_GOLDEN=1 pytest tests/procs/test_slurm_arrays.py``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import stat
import sys
from pathlib import Path

import pytest

from service.core import artifacts
from service.core.config import Settings
from service.core.spec.model import JobSpec
from worker.attempt import ATTEMPT_TOKEN, DATABASE_URL
from worker.errors import LaunchError
from worker.launchers.base import ArrayStarter, LaunchPlan, RunPhase, with_attempt_token
from worker.launchers.slurm.array import MANIFEST, element_attempt
from worker.launchers.slurm.cluster import (
    DEFAULT_MAX_ARRAY_SIZE,
    array_chunks,
    parse_max_array_size,
)
from worker.launchers.slurm.launcher import SlurmLauncher
from worker.launchers.slurm.rank import SlurmRank
from worker.launchers.slurm.states import (
    parse_array_name,
    parse_sacct,
    sacct_command,
    slurm_array_name,
    status_from_records,
)

GOLDEN = Path(__file__).parents[1] / "golden"
SCONTROL_CONFIG = """\
Configuration data as of 2026-12-01T18:00:00
AccountingStorageType   = accounting_storage/slurmdbd
MaxArraySize            = {size}
MaxJobCount             = 10000
"""


def _settings(tmp_path: Path, database_url: str | None = None) -> Settings:
    return Settings(
        home=tmp_path / ".ddpq",
        database_url=database_url or f"sqlite:///{tmp_path}/ddpq.db",
        artifact_dir=tmp_path / "artifacts",
        slurm_enabled=True,
        api_url="http://api.example:8000",
    )


def _fake_scontrol(tmp_path: Path, size: int | None, *, fail: bool = False) -> Path:
    """A stand-in scontrol that prints ``MaxArraySize = size`` and logs each call."""
    path = tmp_path / "scontrol"
    text = SCONTROL_CONFIG.format(size=size) if size is not None else "MaxJobCount = 1\n"
    body = "exit 1" if fail else f"cat <<'EOF'\n{text}EOF"
    path.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/scontrol-calls\n{body}\n')
    path.chmod(0o755)
    return path


def _launcher(
    tmp_path: Path, size: int | None = 1001, database_url: str | None = None
) -> SlurmLauncher:
    (tmp_path / "cwd").mkdir(exist_ok=True)
    scontrol = str(_fake_scontrol(tmp_path, size))
    settings = _settings(tmp_path, database_url)
    return SlurmLauncher(settings, cwd=tmp_path / "cwd", scontrol=scontrol)


def _calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "scontrol-calls"
    return path.read_text().splitlines() if path.exists() else []


def _spec(**resources: object) -> JobSpec:
    return JobSpec.model_validate({
        "name": "trial", "task": "regression", "launcher": "slurm",
        "resources": {"nproc_per_node": 2, "cpus_per_task": 1, "timeout_min": 5, **resources},
    })  # fmt: skip


def _plans(launcher: SlurmLauncher, job_ids: list[int], spec: JobSpec | None = None) -> list[
    LaunchPlan
]:  # fmt: skip
    return [
        with_attempt_token(launcher.plan(spec or _spec(), j, 1), f"ddpqa_token-of-{j}")
        for j in job_ids
    ]


def _normalise(text: str, tmp_path: Path) -> str:
    return text.replace(str(tmp_path.resolve()), "<tmp>").replace(sys.executable, "<python>")


def test_the_slurm_launcher_starts_arrays() -> None:
    assert issubclass(SlurmLauncher, ArrayStarter)


def test_an_array_plan_of_three_trials_matches_golden(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path)
    (array,) = launcher.plan_array(_plans(launcher, [7, 8, 9]), parallelism=2)
    text = _normalise(array.render(), tmp_path).rstrip("\n")
    assert "ddpqa_token" not in text, "an attempt token must never be rendered"
    path = GOLDEN / "slurm_array_plan_3x2.txt"
    if os.environ.get("DDPQ_UPDATE_GOLDEN") == "1":
        path.write_text(text + "\n")
    assert path.exists(), f"missing golden file {path}; create it with DDPQ_UPDATE_GOLDEN=1"
    expected = path.read_text().rstrip("\n")
    assert text == expected, (
        f"plan differs from {path}; if the change is intended, rerun with DDPQ_UPDATE_GOLDEN=1"
        f"\n--- expected\n{expected}\n--- got\n{text}"
    )


def test_an_array_plan_masks_the_api_urls_password_and_every_token(tmp_path: Path) -> None:
    (tmp_path / "cwd").mkdir()
    settings = _settings(tmp_path).model_copy(
        update={"api_url": "http://apiuser:p@ss:w0rd@10.0.0.5:8765"}
    )
    launcher = SlurmLauncher(settings, cwd=tmp_path / "cwd",
                             scontrol=str(_fake_scontrol(tmp_path, 1001)))  # fmt: skip
    plans = _plans(launcher, [7, 8])
    # Should a token ever reach the shared script, it is masked there too.
    (array,) = launcher.plan_array(plans, parallelism=None)
    leaky = dataclasses.replace(array, script=f"{array.script}\n# ddpqa_token-of-8\n")
    text = leaky.render()
    assert "p@ss" not in text and "w0rd" not in text and "ddpqa_token" not in text
    assert "export DDPQ_API_URL=http://apiuser:***@10.0.0.5:8765" in text


@pytest.mark.parametrize(
    ("n", "size", "chunks"),
    [
        (1, 1001, [(0, 1)]),
        (1001, 1001, [(0, 1001)]),  # indices 0-1000: MaxArraySize allows up to 1000
        (1002, 1001, [(0, 1001), (1001, 1002)]),
        (5, 2, [(0, 2), (2, 4), (4, 5)]),
        (0, 3, []),
    ],
)
def test_chunks_stay_below_max_array_size(n: int, size: int, chunks: list[tuple[int, int]]) -> None:
    got = array_chunks(n, size)
    assert [(r.start, r.stop) for r in got] == chunks
    assert all(len(r) <= size and r.stop - r.start - 1 < size for r in got)


def test_arrays_disabled_on_the_cluster_is_a_launch_error_that_says_so(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, size=0)
    with pytest.raises(LaunchError, match=r"MaxArraySize=0"):
        launcher.plan_array(_plans(launcher, [1]), parallelism=None)


def test_a_batch_bigger_than_max_array_size_is_split_and_the_size_read_once(
    tmp_path: Path,
) -> None:
    launcher = _launcher(tmp_path, size=2)
    arrays = launcher.plan_array(_plans(launcher, [1, 2, 3, 4, 5]), parallelism=None)
    assert [[e.job_id for e in a.elements] for a in arrays] == [[1, 2], [3, 4], [5]]
    assert [a.parallelism for a in arrays] == [2, 2, 1]
    assert [a.request.parameters["job_name"] for a in arrays if a.request] == [
        "ddpq-array-1-1", "ddpq-array-3-1", "ddpq-array-5-1",
    ]  # fmt: skip
    assert "#SBATCH --array=0-1%2" in (arrays[0].script or "")
    assert "#SBATCH --array=0-0%1" in (arrays[2].script or "")
    launcher.plan_array(_plans(launcher, [6, 7, 8]), parallelism=1)
    assert _calls(tmp_path) == ["show config"], "MaxArraySize is read once and kept"


def test_parallelism_is_max_concurrent_capped_by_the_array(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path)
    (two,) = launcher.plan_array(_plans(launcher, [1, 2, 3, 4]), parallelism=2)
    (all_,) = launcher.plan_array(_plans(launcher, [5, 6, 7]), parallelism=50)
    assert two.parallelism == 2 and "#SBATCH --array=0-3%2" in (two.script or "")
    assert all_.parallelism == 3 and "#SBATCH --array=0-2%3" in (all_.script or "")


def test_trials_with_different_resources_go_to_different_arrays(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path)
    plans = [
        *_plans(launcher, [1], _spec()),
        *_plans(launcher, [2], _spec(nnodes=2, nproc_per_node=1)),
        *_plans(launcher, [3], _spec()),
    ]
    arrays = launcher.plan_array(plans, parallelism=None)
    assert [[e.job_id for e in a.elements] for a in arrays] == [[1, 3], [2]]
    assert "#SBATCH --nodes=2" in (arrays[1].script or "")
    assert "#SBATCH --ntasks-per-node=1" in (arrays[1].script or "")


def test_an_unreadable_max_array_size_falls_back_to_slurms_default(tmp_path: Path) -> None:
    assert parse_max_array_size(SCONTROL_CONFIG.format(size=77)) == 77
    assert parse_max_array_size("MaxJobCount = 5\n") is None
    assert _launcher(tmp_path, size=None).max_array_size == DEFAULT_MAX_ARRAY_SIZE
    broken = SlurmLauncher(_settings(tmp_path), scontrol=str(tmp_path / "no-such-scontrol"))
    assert broken.max_array_size == DEFAULT_MAX_ARRAY_SIZE


SACCT_ARRAY_OUTPUT = """\
12_0|ddpq-array-7-1|RUNNING|0:0|None
12_0.batch|batch|RUNNING|0:0|
12_1|ddpq-array-7-1|COMPLETED|0:0|None
12_[2-3,5%2]|ddpq-array-7-1|PENDING|0:0|JobArrayTaskLimit
13_0|ddpq-array-9-1|REQUEUED|0:0|None
13_0|ddpq-array-9-1|PENDING|0:0|BeginTime
"""


def test_sacct_is_asked_once_per_array_and_its_pending_range_is_expanded() -> None:
    cmd = sacct_command(["12_0", "12_3", "12_5", "13_0", "40"])
    assert cmd[-2:] == ["-j", "12,13,40"], "one id per array, not one per element"
    records = parse_sacct(SACCT_ARRAY_OUTPUT)
    assert sorted(records) == ["12_0", "12_1", "12_2", "12_3", "12_5", "13_0"]
    assert [r.state for r in records["12_3"]] == ["PENDING"]
    assert status_from_records(records["12_1"]).phase == RunPhase.SUCCEEDED
    assert status_from_records(records["12_5"]).phase == RunPhase.PENDING
    # A requeued element is preempted on its own: its siblings are untouched.
    assert status_from_records(records["13_0"]).phase == RunPhase.PREEMPTED
    assert status_from_records(records["12_0"]).phase == RunPhase.RUNNING


def test_array_names_and_the_manifest_say_which_attempt_an_element_runs(tmp_path: Path) -> None:
    assert parse_array_name(slurm_array_name(7, 2)) == (7, 2)
    assert parse_array_name("ddpq-7-2") is None
    folder = artifacts.slurm_array_dir(tmp_path, 7, 2)
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text('{"0": [7, 2], "1": [8, 1]}')
    assert element_attempt(tmp_path, "ddpq-array-7-2", "55_1") == (8, 1)
    assert element_attempt(tmp_path, "ddpq-array-7-2", "55_4") is None
    assert element_attempt(tmp_path, "ddpq-7-2", "55_1") is None
    assert element_attempt(tmp_path, "ddpq-array-3-1", "55_0") is None  # no manifest


SECRET = "s3cret-db-password"
DB_URL = f"postgresql+psycopg://ddpq:{SECRET}@db.example/ddpq"
FAKE_SBATCH = """#!/bin/sh
env > "{env_file}"
cp "$1" "{script_copy}"
echo "Submitted batch job 4242"
"""


def test_starting_an_array_writes_each_trial_its_own_pickle_and_hands_sbatch_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env_file, script_copy = tmp_path / "sbatch-env.txt", tmp_path / "submitted.sh"
    (bin_dir / "sbatch").write_text(FAKE_SBATCH.format(env_file=env_file, script_copy=script_copy))
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    for name in ("sbatch", "srun"):
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv(DATABASE_URL, DB_URL)
    launcher = _launcher(tmp_path, database_url=DB_URL)
    (array,) = launcher.plan_array(_plans(launcher, [7, 8, 9]), parallelism=2)

    assert launcher.start_array(array) == ["4242_0", "4242_1", "4242_2"]

    root = launcher.artifact_dir
    folder = artifacts.slurm_array_dir(root, 7, 1)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700, "the pickles hold the tokens"
    assert script_copy.read_text() == array.script, "sbatch got exactly the planned script"
    for i, job_id in enumerate([7, 8, 9]):
        rank = _pickled_rank(folder / f"4242_{i}_submitted.pkl")
        assert rank.env[ATTEMPT_TOKEN] == f"ddpqa_token-of-{job_id}"
        assert rank.env["DDPQ_JOB_ID"] == str(job_id)
        assert element_attempt(root, "ddpq-array-7-1", f"4242_{i}") == (job_id, 1)
        link = artifacts.slurm_dir(root, job_id, 1)
        assert link.is_symlink() and link.resolve() == folder.resolve()
        assert artifacts.spec_path(root, job_id, 1).exists()
    for path in folder.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"{path} holds the database URL"
            if path.suffix != ".pkl":
                assert b"ddpqa_token" not in path.read_bytes(), f"a token outside a pickle: {path}"
    sbatch_env = env_file.read_text()
    assert SECRET not in sbatch_env and "ddpqa_token" not in sbatch_env and "PATH=" in sbatch_env


def _pickled_rank(path: Path) -> SlurmRank:
    with open(path, "rb") as fh:
        obj = pickle.load(fh)
    function = getattr(obj, "function", None)
    assert isinstance(function, SlurmRank), f"{path} holds no SlurmRank"
    return function


def test_a_worker_that_did_not_submit_the_array_follows_its_elements_with_one_sacct(
    tmp_path: Path,
) -> None:
    """Re-attach (adoption): a fresh launcher knows only the element ids; sacct's rows and the
    array's manifest tell it which attempt each runs, and its files decide the outcome."""
    root = tmp_path / "artifacts"
    folder = artifacts.slurm_array_dir(root, 7, 1)
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text('{"0": [7, 1], "1": [8, 1], "2": [9, 1]}')
    for job_id in (7, 8, 9):
        artifacts.attempt_dir(root, job_id, 1).mkdir(parents=True)
        artifacts.slurm_dir(root, job_id, 1).symlink_to(folder)
    artifacts.result_path(root, 8, 1).write_text("{}")  # rank 0 of job 8 finished
    (folder / "12_0_0_log.err").write_text("Traceback ...\nRuntimeError: boom\n")
    sacct = tmp_path / "sacct"
    sacct.write_text(
        f"#!/bin/sh\necho \"$*\" >> {tmp_path}/sacct-calls\ncat <<'EOF'\n"
        "12_0|ddpq-array-7-1|FAILED|1:0|NonZeroExitCode\n"
        "12_1|ddpq-array-7-1|COMPLETED|0:0|None\n"
        "12_[2%1]|ddpq-array-7-1|PENDING|0:0|JobArrayTaskLimit\nEOF\n"
    )
    sacct.chmod(0o755)
    launcher = SlurmLauncher(_settings(tmp_path), sacct=str(sacct))

    statuses = launcher.poll_many(["12_0", "12_1", "12_2"])

    calls = (tmp_path / "sacct-calls").read_text().splitlines()
    assert len(calls) == 1 and calls[0].endswith("-j 12"), calls
    assert statuses["12_1"].phase == RunPhase.SUCCEEDED
    assert statuses["12_2"].phase == RunPhase.PENDING
    failed = statuses["12_0"]
    assert failed.phase == RunPhase.FAILED and "RuntimeError: boom" in (failed.reason or "")
