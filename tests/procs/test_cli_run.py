"""`ddpq run`: the command forms it accepts as typed, torchrun's options and their conflicts
with ddpq's flags, and the whole command over a fake of the API (``tests.workspace_api``):
what it prints, uploads and submits; --dry-run sends no file; --wait follows the job."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from service.cli import run as cli_run
from service.cli.main import app
from service.workspaces.command import (
    RunCommandError,
    TypedCommand,
    parse_typed_command,
    plan_command,
    resolve_resources,
)
from tests.workspace_api import FakeWorkspaceApi

runner = CliRunner()


@pytest.mark.parametrize(
    ("typed", "command", "nproc", "nnodes"),
    [
        (["train.py", "--epochs", "3"], ["train.py", "--epochs", "3"], None, None),
        (["python", "train.py", "--lr", "1"], ["train.py", "--lr", "1"], None, None),
        (["/usr/bin/python3.11", "-u", "train.py"], ["train.py"], None, None),
        (["-m", "pkg.train", "--x"], ["-m", "pkg.train", "--x"], None, None),
        (["-mpkg.train"], ["-m", "pkg.train"], None, None),
        (["python3", "-m", "pkg.train", "-v"], ["-m", "pkg.train", "-v"], None, None),
        (["torchrun", "--nproc-per-node=2", "train.py", "--epochs", "4"],
         ["train.py", "--epochs", "4"], 2, None),
        (["torchrun", "--nproc_per_node", "3", "--nnodes", "2", "t.py"], ["t.py"], 3, 2),
        (["torchrun", "--standalone", "--nproc-per-node", "2", "t.py"], ["t.py"], 2, 1),
        (["torchrun", "--nnodes=1:1", "-m", "pkg.train", "--nproc-per-node", "9"],
         ["-m", "pkg.train", "--nproc-per-node", "9"], None, 1),
        (["python", "-m", "torch.distributed.run", "--nproc-per-node=4", "t.py"], ["t.py"], 4,
         None),
        (["torchrun", "--module", "pkg.train"], ["-m", "pkg.train"], None, None),
    ],
)  # fmt: skip
def test_typed_forms(
    typed: list[str], command: list[str], nproc: int | None, nnodes: int | None
) -> None:
    plan = plan_command(typed)
    assert plan.command == command
    assert plan.resources.get("nproc_per_node") == nproc
    assert plan.resources.get("nnodes") == nnodes


@pytest.mark.parametrize(
    ("typed", "words"),
    [
        ([], "nothing to run"),
        (["python"], "nothing to run after 'python'"),
        (["torchrun", "--nproc-per-node", "2"], "nothing to run after torchrun"),
        (["torchrun", "--max-restarts=3", "t.py"], "--max-restarts=3' is not taken: ddpq "
                                                   "relaunches.*max_restarts"),
        (["torchrun", "--rdzv_backend", "c10d", "t.py"], "'--rdzv_backend' is not taken.*"
                                                         "rendezvous"),
        (["torchrun", "--master-port=29500", "t.py"], "rendezvous"),
        (["torchrun", "--nproc-per-node", "auto", "t.py"], "'auto'.*number"),
        (["torchrun", "--nnodes", "1:4", "t.py"], "elastic"),
        (["torchrun", "--nproc-per-node"], "needs a value"),
        (["torchrun", "--standalone", "--nnodes", "2", "t.py"], "--standalone.*--nnodes 2"),
        (["python", "-X", "dev", "t.py"], "python's option '-X'"),
        (["--nprocs", "2", "t.py"], "'--nprocs' is not one of ddpq run's options"),
        (["-m"], "-m needs a module name"),
    ],
)  # fmt: skip
def test_what_cannot_run_is_refused_saying_why(typed: list[str], words: str) -> None:
    with pytest.raises(RunCommandError, match=words):
        plan_command(typed)


def test_a_ddpq_flag_and_a_torchrun_option_conflict_naming_both() -> None:
    typed = parse_typed_command(["torchrun", "--nproc-per-node=4", "--nnodes", "2", "t.py"])
    with pytest.raises(RunCommandError, match=r"-n/--nproc-per-node 2 and torchrun's "
                                              "--nproc-per-node 4 disagree"):  # fmt: skip
        resolve_resources(typed, nproc_per_node=2, nnodes=None)
    with pytest.raises(RunCommandError, match=r"--nnodes 3 and torchrun's --nnodes 2 disagree"):
        resolve_resources(typed, nproc_per_node=None, nnodes=3)
    standalone = TypedCommand(command=["t.py"], standalone=True)
    with pytest.raises(RunCommandError, match=r"--nnodes 2 and torchrun's --standalone"):
        resolve_resources(standalone, nproc_per_node=None, nnodes=2)
    # The same value twice is no conflict; a ddpq flag fills what torchrun left out.
    assert resolve_resources(typed, nproc_per_node=4, nnodes=2) == {"nproc_per_node": 4,
                                                                     "nnodes": 2}  # fmt: skip
    assert resolve_resources(TypedCommand(command=["t.py"]), nproc_per_node=2, nnodes=None) == {
        "nproc_per_node": 2
    }


# -- the command over a fake API ------------------------------------------------------------------


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeWorkspaceApi:
    fake = FakeWorkspaceApi()
    monkeypatch.setattr(cli_run, "make_client", lambda settings=None: fake.client())
    return fake


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "no-gitconfig"))
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('loss 0.5')\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "train.py").write_text("print('module')\n")
    (root / ".gitignore").write_text("*.pt\n")
    (root / "old.pt").write_bytes(b"w" * 5000)
    (root / "data.csv").write_text("x\n" * 3000)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def invoke(args: list[str]) -> Any:
    return runner.invoke(app, ["run", *args], env={"COLUMNS": "200"})


def test_run_packs_prints_uploads_and_submits(api: FakeWorkspaceApi, repo: Path) -> None:
    result = invoke(["--workdir", str(repo), "-n", "2", "--env", "LR=0.1", "--set",
                     "max_restarts=2", "train.py", "--epochs", "3", "--name", "x"])  # fmt: skip
    assert result.exit_code == 0, result.output
    (job,) = api.jobs.values()
    spec = job["spec"]
    assert spec["command"] == ["train.py", "--epochs", "3", "--name", "x"]
    assert spec["resources"] == {"nproc_per_node": 2} and spec["env"] == {"LR": "0.1"}
    assert spec["max_restarts"] == 2 and spec["name"] == "train.py"
    manifest = api.workspaces[spec["workspace"]]
    assert {f.path for f in manifest.files} == {"train.py", "pkg/__init__.py", "pkg/train.py",
                                                ".gitignore", "data.csv"}  # fmt: skip
    out = result.output
    assert "5 files, 5.9 KiB" in out and "largest:" in out
    assert out.index("data.csv") < out.index("train.py") and "old.pt" not in out
    assert "uploaded 5 files" in out and "job 1 'train.py' queued" in out

    again = invoke(["--workdir", str(repo), "--", "python", "-m", "pkg.train"])
    assert again.exit_code == 0, again.output
    assert "uploaded nothing: the API has every file" in again.output
    assert api.jobs[2]["spec"]["command"] == ["-m", "pkg.train"]
    assert api.jobs[2]["spec"]["workspace"] == spec["workspace"]


def test_dry_run_shows_the_plan_and_sends_no_file(api: FakeWorkspaceApi, repo: Path) -> None:
    result = invoke(["--workdir", str(repo), "--dry-run", "--", "torchrun", "--standalone",
                     "--nproc-per-node=2", "train.py"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "would upload 5 files" in result.output and "nothing was stored" in result.output
    assert "each rank runs: python train.py" in result.output, "the user's command, not ddpq's"
    assert api.chunk_bytes_received == 0 and api.uploads == {} and api.jobs == {}
    assert not any(path.endswith("/workspaces/files") for _, path in api.requests)
    (spec,) = api.dry_runs
    assert spec["command"] == ["train.py"]
    assert spec["resources"] == {"nproc_per_node": 2, "nnodes": 1}


def test_wait_follows_the_job_like_submit_wait(api: FakeWorkspaceApi, repo: Path) -> None:
    result = invoke(["--workdir", str(repo), "--wait", "--poll-s", "0.05", "train.py"])
    assert result.exit_code == 0, result.output
    assert "succeeded" in result.output
    api.end_state = "failed"
    failed = invoke(["--workdir", str(repo), "--wait", "--poll-s", "0.05", "train.py"])
    assert failed.exit_code == 1, failed.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["-n", "2", "--", "torchrun", "--nproc-per-node", "4", "train.py"],
         "-n/--nproc-per-node 2 and torchrun's --nproc-per-node 4 disagree"),
        (["--nprocs", "2", "train.py"], "'--nprocs' is not one of ddpq run's options"),
        (["missing.py"], "'missing.py' is not among the files shipped"),
        (["old.pt"], "not excluded by .gitignore"),
        (["--env", "NOEQUALS", "train.py"], "--env 'NOEQUALS': write NAME=VALUE"),
        (["--launcher", "nope", "train.py"], "choose one of"),
        ([], "nothing to run"),
        # The spec is checked before its files go: a typo costs no upload.
        (["--set", "max_restart=1", "train.py"],
         "the job is invalid; nothing was sent: max_restart: Extra inputs are not permitted: "
         "did you mean 'max_restarts'?"),
        (["--set", "max_restarts=-1", "train.py"], "max_restarts: Input should be greater"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_the_reason_and_sends_nothing(
    api: FakeWorkspaceApi, repo: Path, args: list[str], words: str
) -> None:
    result = invoke(["--workdir", str(repo), *args])
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
    assert api.requests == []


def test_a_workspace_over_the_limit_exits_2_before_sending(
    api: FakeWorkspaceApi, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPQ_WORKSPACE_MAX_BYTES", "4096")
    result = invoke(["--workdir", str(repo), "train.py"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "(DDPQ_WORKSPACE_MAX_BYTES); its largest files: 5.9 KiB data.csv" in text
    assert "fix: exclude what the job does not need (list them in .gitignore)" in text
    assert api.requests == []


@pytest.mark.parametrize("flag", ["--dry-run", "--wait", "--json"])
def test_a_ddpq_flag_after_the_script_is_refused_unless_after_dashdash(
    api: FakeWorkspaceApi, repo: Path, flag: str
) -> None:
    # Typed after the script, --dry-run would go to the script and a real job would run.
    result = invoke(["--workdir", str(repo), "-n", "2", "train.py", "--steps", "5", flag])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"{flag} comes after the script 'train.py'" in said and "nothing was sent" in said
    assert api.requests == [] and api.jobs == {}

    # After `--` the user said it is the script's own flag.
    meant = invoke(["--workdir", str(repo), "--", "train.py", flag])
    assert meant.exit_code == 0, meant.output
    (job,) = api.jobs.values()
    assert job["spec"]["command"] == ["train.py", flag]
