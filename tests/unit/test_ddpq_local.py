"""The ``ddpq`` library outside ddpq (plain ``python``/``torchrun``): every call works locally,
so one script runs both ways."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ddpq
from ddpq import _state
from ddpq._local import LocalSession


@pytest.fixture(autouse=True)
def local(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for name in ("DDPQ_JOB_ID", "DDPQ_ATTEMPT_TOKEN", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPQ_LOG_EVERY", "2")
    _state.use(None)
    yield
    _state.use(None)


def test_report_prints_every_log_every_steps_on_rank_0(capsys: pytest.CaptureFixture[str]) -> None:
    for step in range(1, 6):
        ddpq.report(step, epoch=0, loss=torch.tensor(1.0 / step), acc=0.5)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "[ddpq] epoch 0 step 2: loss=0.5 acc=0.5",
        "[ddpq] epoch 0 step 4: loss=0.25 acc=0.5",
    ]


def test_report_on_another_rank_prints_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ddpq.report(2, loss=1.0)
    assert capsys.readouterr().out == ""


def test_a_step_below_1_is_refused_as_under_ddpq() -> None:
    with pytest.raises(ValueError, match="1-based"):
        ddpq.report(0, loss=1.0)


def test_checkpoints_round_trip_newest_first_and_three_kept(tmp_path: Path) -> None:
    assert ddpq.load_checkpoint() is None, "a fresh start"
    for step in (10, 20, 30, 40):
        ddpq.save_checkpoint({"w": torch.full((2,), float(step)), "step": step}, step)
    names = sorted(p.name for p in (tmp_path / "ddpq-checkpoints").iterdir())
    assert names == ["step-20.pt", "step-30.pt", "step-40.pt"]
    state = ddpq.load_checkpoint(map_location="cpu")
    assert state["step"] == 40 and torch.equal(state["w"], torch.full((2,), 40.0))
    assert ddpq.info().resumed_from_step == 40


def test_only_rank_0_writes_a_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "1")
    ddpq.save_checkpoint({"x": 1}, 5)
    assert not (tmp_path / "ddpq-checkpoints").exists()


def test_the_checkpoint_directory_can_be_moved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DDPQ_LOCAL_CHECKPOINT_DIR", str(tmp_path / "elsewhere"))
    ddpq.save_checkpoint([1, 2, 3], 7)
    assert (tmp_path / "elsewhere" / "step-7.pt").is_file()
    assert ddpq.load_checkpoint() == [1, 2, 3]


def test_never_asked_to_stop_and_config_is_the_defaults() -> None:
    assert ddpq.should_stop() is False
    assert ddpq.config({"lr": 0.1}) == {"lr": 0.1}
    assert ddpq.config() == {}
    info = ddpq.info()
    assert (info.under_ddpq, info.job_id, info.rank, info.world_size) == (False, None, 0, 1)


def test_torchrun_topology_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    session = LocalSession()
    assert (session.rank, session.local_rank, session.world_size) == (3, 1, 4)
