"""Snapshot buffers: allocated once per state structure, reused, isolated from training; and
the Checkpointer never refills them while its writer still reads them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from service.core import artifacts
from service.core.config import Settings
from service.store.db import Database
from tests.rank_api import LiveApi, attempt_client, live_api
from tests.rank_api import running_job as start_running_job
from worker.runtime.checkpoints.files import load_checkpoint_file
from worker.runtime.checkpoints.saver import Checkpointer
from worker.runtime.checkpoints.snapshot import SnapshotPool, state_layout


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train_one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(3, 8)).pow(2).mean().backward()
    opt.step()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "notes": ["a"]}


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors_of(v)]
    return []


def assert_same_values(a: Any, b: Any) -> None:
    ta, tb = tensors_of(a), tensors_of(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x.cpu(), y.cpu())


def test_buffers_are_allocated_once_and_reused_across_snapshots() -> None:
    model, opt = model_and_optimizer()
    train_one_step(model, opt)
    pool = SnapshotPool(pin_memory=False)
    first = pool.snapshot(full_state(model, opt)).state
    ptrs = [t.data_ptr() for t in tensors_of(first)]
    train_one_step(model, opt)
    second = pool.snapshot(full_state(model, opt)).state
    assert pool.allocations == 1, "the same structure must reuse its buffers"
    assert [t.data_ptr() for t in tensors_of(second)] == ptrs
    assert_same_values(second, full_state(model, opt))
    assert pool.nbytes == sum(t.numel() * t.element_size() for t in tensors_of(second))


def test_snapshot_is_isolated_from_training_that_goes_on() -> None:
    model, opt = model_and_optimizer()
    train_one_step(model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    state = full_state(model, opt)
    snap = SnapshotPool(pin_memory=False).snapshot(state)
    snap.wait()
    train_one_step(model, opt)  # parameters and optimizer moments change in place
    state["notes"].append("b")  # non-tensor values are copies too
    for key, value in expected.items():
        assert torch.equal(snap.state["model"][key], value), f"{key} changed after the snapshot"
    assert snap.state["notes"] == ["a"]
    assert all(not t.requires_grad for t in tensors_of(snap.state))


def test_a_new_structure_gets_new_buffers() -> None:
    model, opt = model_and_optimizer()
    pool = SnapshotPool(pin_memory=False)
    before = pool.snapshot(full_state(model, opt)).state  # no optimizer state yet
    assert before["optimizer"]["state"] == {}
    train_one_step(model, opt)  # now AdamW holds step, exp_avg, exp_avg_sq per parameter
    after = pool.snapshot(full_state(model, opt)).state
    assert pool.allocations == 2
    assert_same_values(after, full_state(model, opt))
    assert state_layout(after) == state_layout(full_state(model, opt))


def test_sparse_tensors_are_copied_without_a_buffer() -> None:
    sparse = torch.eye(3).to_sparse()
    dense = torch.arange(4.0)
    snap = SnapshotPool(pin_memory=False).snapshot({"s": sparse, "d": dense})
    assert torch.equal(snap.state["s"].to_dense(), torch.eye(3))
    assert torch.equal(snap.state["d"], dense)
    assert snap.state["d"].data_ptr() != dense.data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_snapshot_lands_in_pinned_buffers_after_wait() -> None:
    model = nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    pool = SnapshotPool()
    snap = pool.snapshot(full_state(model, opt))
    with torch.no_grad():  # queued after the copies on the same stream: must not leak in
        for p in model.parameters():
            p.add_(1.0)
    snap.wait()
    assert all(t.is_pinned() for t in tensors_of(snap.state) if t.numel() > 1)
    for key, value in expected.items():
        assert torch.equal(snap.state["model"][key], value)


class Gate:
    """Pickles as an empty dict, but only once ``opened`` is set: holds the writer thread
    inside ``torch.save`` before it has written any tensor bytes."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def __deepcopy__(self, memo: dict[int, Any]) -> Gate:
        return self

    def __reduce__(self) -> tuple[type[dict[str, Any]], tuple[()]]:
        assert self.opened.wait(60), "the test never opened the gate"
        return (dict, ())


@pytest.fixture
def running_job(db: Database) -> tuple[int, int]:
    return start_running_job(db)


@pytest.fixture
def api(db: Database, settings: Settings) -> Iterator[LiveApi]:
    with live_api(settings) as served:
        yield served


def test_next_save_waits_for_the_writer_before_refilling_the_buffers(
    db: Database, settings: Settings, api: LiveApi, running_job: tuple[int, int]
) -> None:
    artifact_dir = settings.resolved_artifact_dir
    model, opt = model_and_optimizer()
    train_one_step(model, opt)
    at_step_1 = {k: v.clone() for k, v in model.state_dict().items()}
    gate = Gate()
    ckpt = Checkpointer(
        attempt_client(db, api.url, *running_job), artifact_dir, *running_job, keep=5
    )
    ckpt.save(1, 0, lambda: {"gate": gate, **full_state(model, opt)})
    train_one_step(model, opt)
    at_step_2 = {k: v.clone() for k, v in model.state_dict().items()}
    # The writer of step 1 is held inside torch.save; open the gate a moment later. A save
    # that refilled the buffers before that write finished would put step 2's values in
    # step 1's file.
    timer = threading.Timer(0.3, gate.opened.set)
    timer.start()
    ckpt.save(2, 0, lambda: {"gate": gate, **full_state(model, opt)})
    ckpt.close()
    timer.join()
    for step, expected in ((1, at_step_1), (2, at_step_2)):
        path = artifacts.checkpoint_path(artifact_dir, running_job[0], step)
        state = load_checkpoint_file(path, torch.device("cpu"))
        for key, value in expected.items():
            assert torch.equal(state["model"][key], value), f"step {step}: {key} is wrong"


def test_checkpointer_reuses_its_buffers_and_frees_them_on_close(
    db: Database, settings: Settings, api: LiveApi, running_job: tuple[int, int]
) -> None:
    model, opt = model_and_optimizer()
    train_one_step(model, opt)
    client = attempt_client(db, api.url, *running_job)
    ckpt = Checkpointer(client, settings.resolved_artifact_dir, *running_job, keep=1)
    for step in (1, 2, 3):
        train_one_step(model, opt)
        ckpt.save(step, 0, lambda: full_state(model, opt))
    pool = ckpt._pool  # the pool is internal; its counters are what this test is about
    assert pool.allocations == 1 and pool.nbytes > 0
    ckpt.close()
    assert pool.nbytes == 0, "close() must release the snapshot buffers"
    state = load_checkpoint_file(
        artifacts.checkpoint_path(settings.resolved_artifact_dir, running_job[0], 3),
        torch.device("cpu"),
    )
    assert_same_values(state["model"], model.state_dict())
