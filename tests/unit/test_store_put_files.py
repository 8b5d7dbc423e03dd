"""``FilesystemStore.put_files``: a batch of whole files lands at the names ``finalize``
would give them, made durable with one ``syncfs`` where Linux has it, else an fsync per file
and per directory (both paths run here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.store.checkpoints.backends import filesystem
from service.store.workspaces.stores import WorkspaceFilesystemStore, upload_key


@pytest.mark.parametrize("syncfs", [True, False], ids=["syncfs", "fsync-each"])
def test_put_files_writes_each_file_whole_where_finalize_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, syncfs: bool
) -> None:
    if not syncfs:
        monkeypatch.setattr(filesystem, "_syncfs", lambda: None)
    elif filesystem._syncfs() is None:
        pytest.skip("this libc has no syncfs")
    store = WorkspaceFilesystemStore(tmp_path)
    files = [(upload_key(i), os.urandom(i * 100)) for i in range(1, 6)]
    files.append((upload_key(9), b""))
    locations = store.put_files(files)
    for (key, data), location in zip(files, locations, strict=True):
        assert (tmp_path / location).read_bytes() == data
        assert store.size(location) == len(data)
        # The name finalize gives the same upload, its partial gone.
        assert location == store.finalize(key) and not store._partial(key).exists()
