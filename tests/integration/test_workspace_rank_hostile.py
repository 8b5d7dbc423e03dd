"""A rank's workspace fetch (``worker.runtime.script.workspace.materialize``) over the real routes
when what the API serves is not what the manifest says: the stored bytes corrupted or cut
after the upload, the stored manifest edited (a size, a path), a host's cache poisoned. The
rank refuses with ``WorkspaceFetchError`` naming the file, and nothing lands outside
``<attempt dir>/workspace`` but its lock file (and verified files in the host's cache)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from service.app import create_app
from service.client import DdpqClient
from service.core.artifacts import attempt_dir, user_workspace_cache_dir, workspace_dir
from service.core.config import Settings
from service.store.db import Database
from service.store.models import Workspace, WorkspaceFile
from tests.live import serve_app
from tests.uploads import mint, running_job
from tests.workspaces import name_workspace, sha
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.script.workspace import LOCK_NAME, WorkspaceFetchError, materialize

TRAIN = b"print('train')\n" * 50
DATA = os.urandom(3000)


@pytest.fixture
def served(tmp_path: Path, settings: Settings, db: Database) -> Iterator[tuple[str, str, int]]:
    """A real API (filesystem store) holding the tree {train.py, data/x.bin}, and a running
    job naming it: (url, the attempt token, job id)."""
    root = tmp_path / "w"
    (root / "data").mkdir(parents=True)
    (root / "train.py").write_bytes(TRAIN)
    (root / "data" / "x.bin").write_bytes(DATA)
    app_settings = settings.model_copy(update={"checkpoint_store": "filesystem"})
    with serve_app(create_app(app_settings)) as url:
        uploaded = DdpqClient(url, token="").upload_workspace(root)
        job_id = running_job(db, owner=settings.default_owner)
        name_workspace(db, job_id, uploaded.digest)
        token = mint(db, job_id)["Authorization"].removeprefix("Bearer ")
        yield url, token, job_id


def stored_file(settings: Settings, db: Database, content: bytes) -> Path:
    """Where the API's filesystem store keeps ``content``."""
    with db.session(write=False) as s:
        location = s.scalars(
            select(WorkspaceFile.location).where(WorkspaceFile.sha256 == sha(content))
        ).one()
    return settings.resolved_artifact_dir / location


def edit_manifest(db: Database, change: Any) -> None:
    """Rewrite the stored manifest's files (as a damaged or tampered database would)."""
    with db.session() as s:
        row = s.scalars(select(Workspace)).one()
        files = [dict(f) for f in row.manifest["files"]]
        change(files)
        row.manifest = {"files": files}


def files_under(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if not p.is_dir()}


def assert_nothing_outside_the_workspace(rank_root: Path, job_id: int) -> None:
    """Under the rank's artifact root: the attempt dir's lock, anything under its
    ``workspace/``, and cache files that verify by their name; nothing else (no temp file,
    no done marker, nothing above the attempt dir)."""
    attempt = attempt_dir(rank_root, job_id, 1)
    cache = user_workspace_cache_dir(rank_root, os.getuid())
    for name in files_under(rank_root):
        path = rank_root / name
        if path.is_relative_to(workspace_dir(rank_root, job_id, 1)):
            continue
        if path == attempt / LOCK_NAME:
            continue
        assert path.is_relative_to(cache), f"{name} written outside the workspace"
        assert sha(path.read_bytes()) == path.name, f"cache file {name} does not verify"


def test_stored_bytes_corrupted_after_the_upload_are_refused(
    tmp_path: Path, settings: Settings, db: Database, served: tuple[str, str, int]
) -> None:
    url, token, job_id = served
    stored = stored_file(settings, db, DATA)
    damaged = bytearray(stored.read_bytes())
    damaged[1000] ^= 0xFF  # same size: the API serves it, only its sha256 tells
    stored.write_bytes(bytes(damaged))
    rank_root = tmp_path / "rank"
    with pytest.raises(WorkspaceFetchError, match=r"workspace file data/x.bin: .*does not match"):
        materialize(AttemptClient(url, token), rank_root, job_id, 1)
    assert not (workspace_dir(rank_root, job_id, 1) / "data" / "x.bin").exists()
    assert_nothing_outside_the_workspace(rank_root, job_id)


def test_stored_bytes_cut_short_are_refused_as_a_fetch_failure(
    tmp_path: Path, settings: Settings, db: Database, served: tuple[str, str, int]
) -> None:
    url, token, job_id = served
    stored = stored_file(settings, db, DATA)
    stored.write_bytes(stored.read_bytes()[:100])  # the API answers 404: bytes gone or damaged
    rank_root = tmp_path / "rank"
    with pytest.raises(WorkspaceFetchError, match=r"workspace file data/x.bin: .*404"):
        materialize(AttemptClient(url, token), rank_root, job_id, 1)
    assert_nothing_outside_the_workspace(rank_root, job_id)


@pytest.mark.parametrize("size", [0, len(DATA) - 1, len(DATA) + 1, 10**9])
def test_a_manifest_whose_size_was_edited_is_refused(
    tmp_path: Path, db: Database, served: tuple[str, str, int], size: int
) -> None:
    # The digest covers path, mode and sha256, not the size: an edited size keeps the digest.
    url, token, job_id = served

    def lie(files: list[dict[str, Any]]) -> None:
        next(f for f in files if f["path"] == "data/x.bin")["size_bytes"] = size

    edit_manifest(db, lie)
    rank_root = tmp_path / "rank"
    with pytest.raises(WorkspaceFetchError, match=r"workspace file data/x.bin: .*does not match"):
        materialize(AttemptClient(url, token), rank_root, job_id, 1)
    assert not (workspace_dir(rank_root, job_id, 1) / "data" / "x.bin").exists()
    assert_nothing_outside_the_workspace(rank_root, job_id)


@pytest.mark.parametrize("path", ["../../../escaped.py", "/tmp/escaped.py", "data"])
def test_a_stored_manifest_edited_to_a_hostile_path_writes_nothing(
    tmp_path: Path, db: Database, served: tuple[str, str, int], path: str
) -> None:
    # "data" is a file and the directory of data/x.bin. The API validates what it serves:
    # the rank gets an error, never the path.
    url, token, job_id = served

    def hostile(files: list[dict[str, Any]]) -> None:
        next(f for f in files if f["path"] == "train.py")["path"] = path

    edit_manifest(db, hostile)
    rank_root = tmp_path / "rank" / "root"
    rank_root.mkdir(parents=True)
    with pytest.raises(WorkspaceFetchError, match=r"could not read the job's workspace: .*410 the "
                       r"stored manifest of workspace .* is damaged"):  # fmt: skip
        materialize(AttemptClient(url, token), rank_root, job_id, 1)
    assert files_under(workspace_dir(rank_root, job_id, 1)) == set()
    assert_nothing_outside_the_workspace(rank_root, job_id)
    assert files_under(tmp_path / "rank") == {f"root/{n}" for n in files_under(rank_root)}
    assert not Path("/tmp/escaped.py").exists()


def test_a_poisoned_cache_entry_is_fetched_again_not_used(
    tmp_path: Path, served: tuple[str, str, int]
) -> None:
    url, token, job_id = served
    rank_root = tmp_path / "rank"
    poisoned = user_workspace_cache_dir(rank_root, os.getuid()) / sha(TRAIN)[:2] / sha(TRAIN)
    poisoned.parent.mkdir(parents=True)
    poisoned.write_bytes(b"import os; os.system('evil')\n")
    where = materialize(AttemptClient(url, token), rank_root, job_id, 1)
    assert (where / "train.py").read_bytes() == TRAIN
    assert (where / "data" / "x.bin").read_bytes() == DATA
    assert poisoned.read_bytes() == TRAIN
    assert files_under(where) == {"train.py", "data/x.bin"}


def test_a_name_of_255_bytes_is_fetched_when_the_host_has_no_cache(
    tmp_path: Path, db: Database, served: tuple[str, str, int]
) -> None:
    # Without a usable cache each file is fetched straight into place; the temp file's name
    # once added to the file's own name, over NAME_MAX for a legal 255-byte name.
    url, token, job_id = served
    long_name = "n" * 252 + ".py"

    def rename(files: list[dict[str, Any]]) -> None:
        next(f for f in files if f["path"] == "train.py")["path"] = long_name

    edit_manifest(db, rename)  # a valid manifest still: the API serves it
    rank_root = tmp_path / "rank"
    rank_root.mkdir()
    cache = user_workspace_cache_dir(rank_root, os.getuid())
    cache.parent.mkdir()
    cache.write_text("not a directory: no cache on this host")
    where = materialize(AttemptClient(url, token), rank_root, job_id, 1)
    assert (where / long_name).read_bytes() == TRAIN
    assert files_under(where) == {long_name, "data/x.bin"}
    leftovers = files_under(attempt_dir(rank_root, job_id, 1)) - {
        f"workspace/{n}" for n in files_under(where)
    }
    assert leftovers <= {LOCK_NAME, ".workspace.done"}, leftovers
