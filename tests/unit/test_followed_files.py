"""Following a command job's checkpoint file with real files in ``tmp_path`` (Linux inotify):
a version written in place (``torch.save``) and one renamed into place (``os.replace``) each
come out once; a file in a directory made after the start is seen; a file still being written
is held back until it is closed; symbolic links and paths leaving the root are ignored. And
the copy ``Checkpointer.save_file`` takes: one version, though the script writes the file."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from service.core.spec.followed import glob_matches as _matches
from worker.runtime.checkpoints import files
from worker.runtime.checkpoints.files import CheckpointWriteError, copy_hashed, write_temp_copy
from worker.runtime.checkpoints.followed import FollowedFiles, relative_name
from worker.runtime.checkpoints.leases import being_written


@pytest.fixture
def root(tmp_path: Path) -> Path:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    return workspace


@pytest.fixture
def follow(root: Path) -> Iterator[Any]:
    made: list[FollowedFiles] = []

    def start(pattern: str) -> FollowedFiles:
        made.append(FollowedFiles(root, pattern))
        return made[-1]

    yield start
    for followed in made:
        followed.close()


def names(root: Path, paths: list[Path]) -> list[str]:
    assert all(p.is_absolute() for p in paths), f"absolute paths under the root: {paths}"
    return [relative_name(root, p) for p in paths]


def leases_work(path: Path) -> bool:
    path.write_bytes(b"probe")
    return being_written(path) is False


def test_torch_save_in_place_comes_out_once_per_version(root: Path, follow: Any) -> None:
    (root / "snapshot.pt").write_bytes(b"shipped with the workspace")
    followed = follow("snapshot.pt")
    assert followed.completed() == [], "a file there at the start is no new version"
    torch.save({"epoch": 1}, root / "snapshot.pt")
    assert names(root, followed.completed()) == ["snapshot.pt"]
    assert followed.completed() == [], "once each"
    torch.save({"epoch": 2}, root / "snapshot.pt")
    torch.save({"epoch": 3}, root / "snapshot.pt")
    assert names(root, followed.completed()) == ["snapshot.pt"], "twice since: listed once"
    (root / "other.pt").write_bytes(b"not followed")
    (root / "snapshot.pt.bak").write_bytes(b"not followed")
    assert followed.completed() == []


def test_a_temp_file_renamed_into_place_comes_out_once(root: Path, follow: Any) -> None:
    followed = follow("ckpt/*.pt")
    (root / "ckpt").mkdir()
    assert followed.completed() == []
    tmp = root / "ckpt" / "epoch-1.pt.tmp"  # not matched: closed after writing, then renamed
    torch.save({"epoch": 1}, tmp)
    os.replace(tmp, root / "ckpt" / "epoch-1.pt")
    assert names(root, followed.completed()) == ["ckpt/epoch-1.pt"]
    assert followed.completed() == []


def test_files_come_out_oldest_first_by_their_newest_version(root: Path, follow: Any) -> None:
    followed = follow("*.pt")
    for name in ("a.pt", "b.pt", "c.pt", "a.pt"):
        torch.save({"name": name}, root / name)
    assert names(root, followed.completed()) == ["b.pt", "c.pt", "a.pt"]


def test_a_directory_made_after_the_start_is_followed(root: Path, follow: Any) -> None:
    """``os.makedirs`` then ``torch.save`` at once, before any call: the first file is found
    by the scan of the new directory, later ones by its watch; deeper levels too."""
    followed = follow("runs/*/ckpt/*.pt")
    (root / "runs" / "exp1" / "ckpt").mkdir(parents=True)
    torch.save({"epoch": 1}, root / "runs" / "exp1" / "ckpt" / "e1.pt")
    (root / "runs" / "exp1" / "other").mkdir()  # not a directory the pattern reaches
    (root / "runs" / "exp1" / "other" / "e1.pt").write_bytes(b"x")
    assert names(root, followed.completed()) == ["runs/exp1/ckpt/e1.pt"]
    torch.save({"epoch": 2}, root / "runs" / "exp1" / "ckpt" / "e2.pt")
    assert names(root, followed.completed()) == ["runs/exp1/ckpt/e2.pt"]


def test_a_directory_moved_in_is_followed_and_one_moved_away_is_not(
    root: Path, tmp_path: Path, follow: Any
) -> None:
    followed = follow("ckpt/*.pt")
    outside = tmp_path / "staging"
    outside.mkdir()
    torch.save({"epoch": 1}, outside / "e1.pt")
    os.rename(outside, root / "ckpt")
    assert names(root, followed.completed()) == ["ckpt/e1.pt"]
    os.rename(root / "ckpt", root / "old")
    torch.save({"epoch": 2}, root / "old" / "e2.pt")
    assert followed.completed() == [], "ckpt/e2.pt does not exist: nothing under old/ counts"


def test_double_star_reaches_any_depth(root: Path, follow: Any) -> None:
    followed = follow("out/**/*.pt")
    (root / "out" / "a" / "b").mkdir(parents=True)
    torch.save({}, root / "out" / "top.pt")
    torch.save({}, root / "out" / "a" / "b" / "deep.pt")
    assert sorted(names(root, followed.completed())) == ["out/a/b/deep.pt", "out/top.pt"]


def test_symbolic_links_and_paths_leaving_the_root_are_ignored(
    root: Path, tmp_path: Path, follow: Any
) -> None:
    followed = follow("ckpt/*.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "ckpt").symlink_to(elsewhere)  # a directory link out of the workspace
    torch.save({}, elsewhere / "e1.pt")
    assert followed.completed() == [], "a linked directory is not followed"
    (root / "ckpt").unlink()
    (root / "ckpt").mkdir()
    (elsewhere / "secret").write_bytes(b"not yours")
    link = root / "ckpt" / ".link"
    link.symlink_to(elsewhere / "secret")
    os.replace(link, root / "ckpt" / "e2.pt")  # a link renamed into place
    assert followed.completed() == [], "a symbolic link is not a checkpoint"


def test_a_file_still_open_for_writing_waits_for_its_close(root: Path, follow: Any) -> None:
    if not leases_work(root / "probe"):
        pytest.skip("this filesystem grants no read leases")
    followed = follow("snapshot.pt")
    torch.save({"epoch": 1}, root / "snapshot.pt")
    with open(root / "snapshot.pt", "r+b") as rewriting:  # the next epoch's save began
        rewriting.write(b"PK")
        assert followed.completed() == [], "being rewritten: not a completed version"
    assert names(root, followed.completed()) == ["snapshot.pt"], "its close reports it"


def test_patterns_read_as_pathlib_globs() -> None:
    def parts(pattern: str) -> tuple[str, ...]:
        return tuple(pattern.split("/"))

    assert _matches(parts("ckpt/*.pt"), "ckpt/e1.pt")
    assert not _matches(parts("ckpt/*.pt"), "ckpt/sub/e1.pt"), "* stays within one part"
    assert not _matches(parts("*.pt"), "ckpt/e1.pt")
    assert _matches(parts("**/*.pt"), "e1.pt") and _matches(parts("**/*.pt"), "a/b/e1.pt")
    assert not _matches(parts("ckpt/**"), "ckpt/e1.pt"), "a trailing ** names directories"
    assert _matches(parts("e[0-9].pt"), "e3.pt") and not _matches(parts("e[0-9].pt"), "ex.pt")


# -- the copy that save_file takes --------------------------------------------------------------


def test_the_copy_is_the_file_and_its_sha256(root: Path) -> None:
    data = os.urandom(3 * files._READ_CHUNK_BYTES + 17)
    (root / "snapshot.pt").write_bytes(data)
    final = root / "store" / "step-1.pt"
    tmp, size, digest = write_temp_copy(root / "snapshot.pt", final)
    assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())
    assert tmp.read_bytes() == data and tmp.parent == final.parent and not final.exists()


def test_a_vanished_or_linked_source_is_a_write_error_and_leaves_no_temp(
    root: Path, tmp_path: Path
) -> None:
    final = root / "store" / "step-1.pt"
    with pytest.raises(CheckpointWriteError, match="vanished"):
        write_temp_copy(root / "snapshot.pt", final)
    (tmp_path / "target").write_bytes(b"outside")
    (root / "snapshot.pt").symlink_to(tmp_path / "target")
    with pytest.raises(CheckpointWriteError, match="cannot be read"):
        write_temp_copy(root / "snapshot.pt", final)
    assert list((root / "store").iterdir()) == [], "no temp file left behind"


def test_a_source_open_for_writing_is_not_copied(root: Path) -> None:
    if not leases_work(root / "probe"):
        pytest.skip("this filesystem grants no read leases")
    with open(root / "snapshot.pt", "wb") as writing:
        writing.write(b"half")
        writing.flush()
        with pytest.raises(CheckpointWriteError, match="open for writing"):
            copy_hashed(root / "snapshot.pt", root / "copy")


class _Hook:
    """A sha256 that calls ``on_first`` at its first update (mid-copy: after one chunk)."""

    def __init__(self, on_first: Any) -> None:
        self._digest = hashlib.sha256()
        self._on_first = on_first

    def update(self, data: bytes) -> None:
        if self._on_first is not None:
            self._on_first, call = None, self._on_first
            call()
        self._digest.update(data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def test_without_a_lease_a_change_during_the_copy_fails_it(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filesystem that grants no lease, the script appending (or truncating) the file
    while it is copied is caught by its size."""
    source = root / "snapshot.pt"
    source.write_bytes(b"a" * 100)
    monkeypatch.setattr(files, "take_read_lease", lambda fd: None)
    monkeypatch.setattr(files, "_READ_CHUNK_BYTES", 10)

    def append() -> None:
        with open(source, "ab") as fh:
            fh.write(b"b" * 50)

    monkeypatch.setattr(files, "hashlib", SimpleNamespace(sha256=lambda: _Hook(append)))
    with pytest.raises(CheckpointWriteError, match="changed while it was copied"):
        copy_hashed(source, root / "copy")


def test_with_a_lease_a_writer_waits_until_the_copy_is_done(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.save`` of the next version starts during the copy: its open waits for the
    lease, so the copy is the old version whole, and the new one lands afterwards."""
    if not leases_work(root / "probe"):
        pytest.skip("this filesystem grants no read leases")
    source = root / "snapshot.pt"
    old = os.urandom(64 * 1024)
    source.write_bytes(old)
    monkeypatch.setattr(files, "_READ_CHUNK_BYTES", 4096)
    opened_at: list[float] = []

    def rewrite() -> None:
        with open(source, "wb") as fh:  # truncates: blocked while the lease is held
            opened_at.append(time.monotonic())
            fh.write(b"new version")

    writer = threading.Thread(target=rewrite)

    def start_writer() -> None:
        writer.start()
        time.sleep(0.3)  # the writer is blocked in open() by now

    monkeypatch.setattr(files, "hashlib", SimpleNamespace(sha256=lambda: _Hook(start_writer)))
    size, digest = copy_hashed(source, root / "copy")
    copied_at = time.monotonic()
    writer.join(10)
    assert (size, digest) == (len(old), hashlib.sha256(old).hexdigest()), "the old version whole"
    assert (root / "copy").read_bytes() == old
    assert opened_at and opened_at[0] >= copied_at - 0.05, "the writer waited for the copy"
    assert source.read_bytes() == b"new version"


def test_a_version_replaced_before_its_copy_is_not_taken_under_its_own_step(
    root: Path, follow: Any
) -> None:
    """Epoch 1's save completes, and epoch 2's is written whole before the follower copies
    epoch 1's: a copy now would be epoch 2's bytes under epoch 1's step. The copy of the
    version seen is refused; the newer version comes out on its own and copies whole."""
    followed = follow("snapshot.pt")
    source = root / "snapshot.pt"
    torch.save({"epoch": 1}, source)
    assert names(root, followed.completed()) == ["snapshot.pt"]
    seen = followed.completed_version(source)
    time.sleep(0.01)  # a new mtime, on filesystems with coarse timestamps too
    torch.save({"epoch": 2}, source)
    with pytest.raises(files.VersionGoneError, match="replaced by a newer version"):
        copy_hashed(source, root / "copy", version=seen)
    assert not (root / "copy").exists(), "refused before the copy began"
    assert names(root, followed.completed()) == ["snapshot.pt"], "the newer version, once"
    newer = followed.completed_version(source)
    assert newer != seen
    size, _ = copy_hashed(source, root / "copy", version=newer)
    assert torch.load(root / "copy")["epoch"] == 2 and size == source.stat().st_size
