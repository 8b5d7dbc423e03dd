"""Packing a working directory: real git repositories and plain directories in tmp dirs.

Which files go (git's own rules inside a work tree, ``.ddpqignore`` elsewhere, the always
excluded directories), what each file is (content, executable bit, symlinks), what is refused
(links leaving the directory, fifos), and the limits, checked before any byte is sent.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from service.core.wire.workspace import (
    MAX_BYTES_SETTING,
    MAX_FILES_SETTING,
    WorkspaceTooLargeError,
)
from service.workspaces.pack import WorkspacePackError, pack_workspace
from tests.workspace_api import FakeWorkspaceApi

LIMITS = {"max_bytes": 100 * 2**20, "max_files": 20_000}


@pytest.fixture(autouse=True)
def _plain_git(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """git as a fresh user has it: no global excludes file or config of this machine's."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "no-gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-xdg"))


def git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo, check=True, capture_output=True,
    )  # fmt: skip


def write(root: Path, files: dict[str, str | bytes]) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def paths_of(root: Path, **limits: int) -> set[str]:
    packed = pack_workspace(root, **{**LIMITS, **limits})
    return {f.path for f in packed.manifest.files}


def make_repo(root: Path) -> Path:
    write(root, {
        "train.py": "print('hi')\n",
        ".gitignore": "*.log\noutputs/\n",
        "pkg/__init__.py": "",
        "pkg/model.py": "W = 1\n",
        "pkg/.gitignore": "cache.bin\n",
        "pkg/cache.bin": b"\0" * 100,
        "run.log": "x",
        "outputs/model.pt": b"w" * 1000,
    })  # fmt: skip
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "init")
    return root


def test_git_lists_tracked_and_untracked_files_but_not_ignored_ones(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    write(repo, {"notes.md": "untracked, not ignored", "pkg/data/extra.csv": "1,2\n",
                 "pkg/deeper/cache.bin": "only pkg/cache.bin's name at any depth"})  # fmt: skip
    (repo / "pkg" / "model.py").unlink()  # tracked, deleted from disk: skipped
    packed = pack_workspace(repo, **LIMITS)
    assert packed.listing == "git"
    assert {f.path for f in packed.manifest.files} == {
        "train.py", ".gitignore", "pkg/__init__.py", "pkg/.gitignore", "notes.md",
        "pkg/data/extra.csv",
    }  # fmt: skip
    assert "run.log" not in packed.sources and "pkg/cache.bin" not in packed.sources


def test_a_subdirectory_of_a_repository_ships_its_files_relative_to_it(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    assert paths_of(repo / "pkg") == {"__init__.py", "model.py", ".gitignore"}


def test_ddpq_state_directory_is_never_shipped_from_git(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    write(repo, {".ddpq/ddpq.db": "sqlite", ".ddpq/artifacts/jobs/1/x.pt": "w"})
    assert not any(p.startswith(".ddpq/") for p in paths_of(repo))


def test_a_submodule_like_nested_repository_is_listed_by_its_own_git(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    nested = repo / "vendor" / "lib"
    write(nested, {"lib.py": "x", ".gitignore": "*.tmp\n", "junk.tmp": "t"})
    git(nested, "init", "-q")
    found = paths_of(repo)
    assert {"vendor/lib/lib.py", "vendor/lib/.gitignore"} <= found
    assert "vendor/lib/junk.tmp" not in found and "vendor/lib" not in found


def test_ddpqignore_outside_git_and_the_always_excluded_dirs(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    write(root, {
        "train.py": "x",
        ".ddpqignore": "*.ckpt\ndata/\n!keep.ckpt\n/top.txt\n",
        "a.ckpt": "c", "keep.ckpt": "k", "top.txt": "t", "sub/top.txt": "kept",
        "data/big.bin": "d", "sub/data/x": "d",
        "pkg/__pycache__/m.cpython-311.pyc": "p", ".git/HEAD": "ref",
        ".ddpq/ddpq.db": "db", "venv/pyvenv.cfg": "home = /usr", "venv/lib/site.py": "s",
        "env2/bin/python": "not a venv without pyvenv.cfg",
    })  # fmt: skip
    packed = pack_workspace(root, **LIMITS)
    assert packed.listing == "walk"
    assert {f.path for f in packed.manifest.files} == {
        "train.py", ".ddpqignore", "keep.ckpt", "sub/top.txt", "env2/bin/python",
    }  # fmt: skip


def test_digest_is_stable_across_repacks_copies_and_creation_order(tmp_path: Path) -> None:
    files = {f"m{i}/f{j}.py": f"{i}-{j}" * (i + j) for i in range(5) for j in range(5)}
    one, two = tmp_path / "one", tmp_path / "two"
    write(one, files)
    write(two, dict(reversed(list(files.items()))))
    (one / "m1" / "f1.py").chmod(0o755)
    (two / "m1" / "f1.py").chmod(0o755)
    first = pack_workspace(one, **LIMITS)
    assert first.digest == pack_workspace(one, **LIMITS).digest
    assert first.digest == pack_workspace(two, **LIMITS).digest
    assert (
        pack_workspace(make_repo(tmp_path / "r1"), **LIMITS).digest
        == pack_workspace(make_repo(tmp_path / "r2"), **LIMITS).digest
    )
    (two / "m1" / "f1.py").chmod(0o644)  # the executable bit is part of it
    assert pack_workspace(two, **LIMITS).digest != first.digest


def test_content_and_executable_bit_are_packed(tmp_path: Path) -> None:
    write(tmp_path, {"run.sh": "#!/bin/sh\n", "data.bin": os.urandom(300_000)})
    (tmp_path / "run.sh").chmod(0o700)
    packed = pack_workspace(tmp_path, **LIMITS)
    by_path = {f.path: f for f in packed.manifest.files}
    assert by_path["run.sh"].mode == 0o755 and by_path["data.bin"].mode == 0o644
    data = (tmp_path / "data.bin").read_bytes()
    assert by_path["data.bin"].sha256 == hashlib.sha256(data).hexdigest()
    assert by_path["data.bin"].size_bytes == 300_000


def test_a_symlink_inside_ships_its_content_one_leaving_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "w"
    write(root, {"real/config.yaml": "lr: 1\n", "train.py": "x"})
    (root / "config.yaml").symlink_to("real/config.yaml")
    packed = pack_workspace(root, **LIMITS)
    link = next(f for f in packed.manifest.files if f.path == "config.yaml")
    assert link.sha256 == hashlib.sha256(b"lr: 1\n").hexdigest()
    assert packed.sources["config.yaml"] == (root / "real" / "config.yaml").resolve()

    (tmp_path / "secret").write_text("s")
    (root / "leak").symlink_to(tmp_path / "secret")
    with pytest.raises(WorkspacePackError, match=r"'leak': it is a symlink to .*outside"):
        pack_workspace(root, **LIMITS)
    (root / "leak").unlink()
    (root / "up").symlink_to("../secret")  # relative, leaving all the same
    with pytest.raises(WorkspacePackError, match=r"'up'.*outside the working directory"):
        pack_workspace(root, **LIMITS)
    (root / "up").unlink()
    (root / "dangling").symlink_to("nowhere.txt")
    with pytest.raises(WorkspacePackError, match=r"'dangling'.*does not exist"):
        pack_workspace(root, **LIMITS)


def test_a_symlink_leaving_a_git_tree_is_refused_too(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / "data").symlink_to("/etc")
    with pytest.raises(WorkspacePackError, match=r"'data'.*outside.*\.gitignore"):
        pack_workspace(repo, **LIMITS)


def test_a_fifo_is_refused_naming_it(tmp_path: Path) -> None:
    write(tmp_path, {"train.py": "x"})
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(WorkspacePackError, match=r"'pipe': it is a fifo"):
        pack_workspace(tmp_path, **LIMITS)


def test_120_mib_is_refused_before_any_byte_is_sent(tmp_path: Path) -> None:
    """Sparse files: the sizes are checked before any file is read, nothing reaches the API."""
    repo = make_repo(tmp_path / "repo")
    for name, size in (("weights.pt", 80), ("dataset.npy", 30), ("extra.bin", 10)):
        with open(repo / name, "wb") as fh:
            fh.truncate(size * 2**20)
    api = FakeWorkspaceApi()
    with pytest.raises(WorkspaceTooLargeError) as info:
        api.client().upload_workspace(repo)
    assert api.requests == [] and api.chunk_bytes_received == 0
    text = str(info.value)
    assert MAX_BYTES_SETTING in text and ".gitignore" in text
    assert text.index("weights.pt (80.0 MiB)") < text.index("dataset.npy (30.0 MiB)")
    assert "extra.bin (10.0 MiB)" in text


def test_20001_files_are_refused_naming_the_setting(tmp_path: Path) -> None:
    root = tmp_path / "many"
    for i in range(200):
        d = root / f"d{i}"
        d.mkdir(parents=True)
        for j in range(100):
            (d / f"f{j}").touch()
    (root / "one-more").touch()
    with pytest.raises(WorkspaceTooLargeError) as info:
        pack_workspace(root, **LIMITS)
    assert info.value.setting == MAX_FILES_SETTING and info.value.file_count == 20_001
    assert MAX_FILES_SETTING in str(info.value) and ".ddpqignore" in str(info.value)


def test_nothing_to_ship_and_not_a_directory(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    with pytest.raises(WorkspacePackError, match=r"nothing to ship.*ignored"):
        pack_workspace(repo / "outputs", **LIMITS)
    with pytest.raises(WorkspacePackError, match=r"not a directory"):
        pack_workspace(repo / "train.py", **LIMITS)
    with pytest.raises(WorkspacePackError, match=r"cannot use"):
        pack_workspace(tmp_path / "absent", **LIMITS)


def test_without_git_installed_a_tree_is_walked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert shutil.which("git") is None
    found = paths_of(repo)
    assert "run.log" in found and not any(p.startswith(".git/") for p in found)


@pytest.mark.parametrize("in_git", [True, False])
def test_what_ddpq_follows_and_the_librarys_local_checkpoints_are_not_shipped(
    tmp_path: Path, in_git: bool
) -> None:
    """A plain torchrun run left its snapshot, TensorBoard files and ddpq's local checkpoints
    behind: shipping them would make the job's first attempt resume from them."""
    from service.workspaces.pack import leave_out_for

    root = tmp_path / "proj"
    write(root, {
        "train.py": "print('hi')\n", "snapshot.pt": b"s", "runs/Dec02/events.out.tfevents.1": b"e",
        "ckpt/a.pt": b"a", "ckpt/notes.txt": "kept", "ddpq-checkpoints/step-16.pt": b"c",
        "src/runs.py": "kept: only the directory runs/ is followed",
    })  # fmt: skip
    if in_git:
        git(root, "init", "-q")
    spec = {"checkpoints": {"path": "ckpt/*.pt"}, "metrics": {"tensorboard": "runs/"}}
    packed = pack_workspace(root, **LIMITS, leave_out=leave_out_for(spec))
    shipped = {f.path for f in packed.manifest.files}
    assert shipped == {"train.py", "snapshot.pt", "ckpt/notes.txt", "src/runs.py"}
    assert packed.left_out == (
        "ckpt/a.pt",
        "ddpq-checkpoints/step-16.pt",
        "runs/Dec02/events.out.tfevents.1",
    )
    snapshot = pack_workspace(
        root, **LIMITS, leave_out=leave_out_for({"checkpoints": {"path": "snapshot.pt"}})
    )
    assert "snapshot.pt" not in {f.path for f in snapshot.manifest.files}
    assert "runs/Dec02/events.out.tfevents.1" in {f.path for f in snapshot.manifest.files}
