"""Whether a local worker can give each attempt a cgroup v2 of its own, decided against temp
directories laid out like cgroupfs (this CI host has a hybrid hierarchy: memory and pids are
cgroup v1 controllers there, so no real cgroup is made here), and what an attempt's cgroup
holds and reports (worker.launchers.local.cgroups)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from worker.launchers.local import cgroups
from worker.launchers.local.cgroups import JobCgroup, job_cgroup_support, probe_cgroups


def _cgroupfs(tmp_path: Path, *, controllers: str = "cpu memory pids", enabled: str = "") -> Path:
    root = tmp_path / "cgroup"
    worker = root / "system.slice" / "ddpq.service"
    worker.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids io\n")
    (worker / "cgroup.controllers").write_text(controllers + "\n")
    (worker / "cgroup.subtree_control").write_text(enabled + "\n")
    (tmp_path / "self-cgroup").write_text("0::/system.slice/ddpq.service\n")
    return root


def test_a_delegated_v2_cgroup_is_used_and_the_worker_moves_into_a_leaf(tmp_path: Path) -> None:
    root = _cgroupfs(tmp_path)
    support = probe_cgroups(root, tmp_path / "self-cgroup", pid=1234)
    parent = root / "system.slice" / "ddpq.service"
    assert support.usable and support.parent == parent
    assert (parent / "ddpq-worker" / "cgroup.procs").read_text() == "1234"
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids"


@pytest.mark.parametrize(
    ("layout", "says"),
    [
        ("v1", "no cgroup v2 hierarchy"),
        ("no_pids", "controller(s) pids not delegated"),
        ("v1_only_process", "names no cgroup v2 path"),
    ],
)
def test_an_unusable_host_is_named_with_its_reason(tmp_path: Path, layout: str, says: str) -> None:
    root = _cgroupfs(tmp_path, controllers="cpu memory" if layout == "no_pids" else "memory pids")
    if layout == "v1":
        (root / "cgroup.controllers").unlink()
    if layout == "v1_only_process":  # this CI host's own /proc/self/cgroup has v1 lines
        (tmp_path / "self-cgroup").write_text("4:memory:/process_api/x\n1:cpu:/\n")
    support = probe_cgroups(root, tmp_path / "self-cgroup")
    assert not support.usable and says in support.reason, support.reason


def test_a_worker_without_cgroups_says_so_once_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=cgroups.__name__):
        support = job_cgroup_support(
            4096, None, root=tmp_path / "none", proc_self_cgroup=tmp_path / "self-cgroup"
        )
    assert not support.usable
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "no per-job cgroups" in warnings[0]
    assert "DDPQ_JOB_PIDS_MAX" in warnings[0]


def test_an_attempt_cgroup_holds_its_limits_names_the_limit_hit_and_is_removed(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "parent"
    (parent / "ddpq-job-7-attempt-2").mkdir(parents=True)  # cgroupfs makes its files itself
    (parent / "ddpq-job-7-attempt-2" / "cgroup.procs").touch()
    group = JobCgroup.create(parent, 7, 2, pids_max=64, memory_max_bytes=1 << 30)
    assert group.path == parent / "ddpq-job-7-attempt-2"
    assert (group.path / "pids.max").read_text() == "64"
    assert (group.path / "memory.max").read_text() == str(1 << 30)
    assert group.limit_hit() is None
    (group.path / "pids.events").write_text("max 3\n")
    hit = group.limit_hit()
    assert hit is not None and "pids.max 64" in hit and "DDPQ_JOB_PIDS_MAX" in hit
    (group.path / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    hit = group.limit_hit()
    assert hit is not None and "out of memory" in hit and "DDPQ_JOB_MEMORY_MAX_BYTES" in hit
    for name in (
        "pids.max",
        "memory.max",
        "memory.oom.group",
        "cgroup.procs",
        "cgroup.kill",
        "pids.events",
        "memory.events",
    ):  # cgroupfs drops its files with the dir
        (group.path / name).unlink(missing_ok=True)
    group.remove()
    assert not group.path.exists() and group.procs_fd is None
