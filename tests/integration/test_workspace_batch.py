"""Batches of small workspace files (``POST /workspaces/files/batch``, ``service.core.wire.
batch``) on SQLite and PostgreSQL, into both stores, with auth on: every file that matches
its sha256 is kept (and read back by a rank), a lying one is refused alone, a body that does
not split or is over the cap is refused whole, another owner's batch counts for nothing, a
rank's token is 401; and the real client sends a 300-file tree in a handful of requests."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.app import create_app
from service.client import DdpqClient
from service.core.config import Settings
from service.core.wire import batch
from service.core.wire import workspace as wire
from service.core.wire.workspace import FileRef
from service.store.checkpoints.backends.base import CheckpointStore
from service.store.db import Database
from service.store.models import WorkspaceFile, WorkspaceUpload
from service.store.workspaces.stores import make_workspace_stores, upload_key
from service.store.workspaces.upload_service import store_file_batch
from tests.live import serve_app
from tests.uploads import mint, running_job
from tests.workspaces import API, manifest, name_workspace, sha

CHUNK = 64 * 1024  # the smallest chunk cap the settings allow: a batch's cap in file bytes
BATCH = API + wire.FILES_BATCH_PATH


@pytest.fixture(params=["filesystem", "database"])
def app_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    # A body cap far below a batch: the batch route is held to its own cap only.
    return settings.model_copy(
        update={
            "auth": "on",
            "checkpoint_store": request.param,
            "checkpoint_chunk_bytes": CHUNK,
            "max_body_bytes": 4096,
        }
    )


def ref(data: bytes, *, size: int | None = None, sha256: str | None = None) -> FileRef:
    return FileRef(sha256=sha256 or sha(data), size_bytes=len(data) if size is None else size)


def send(api: TestClient, user: dict[str, str], body: bytes) -> httpx.Response:
    headers = {**user, "Content-Type": batch.BATCH_CONTENT_TYPE}
    return api.post(BATCH, content=body, headers=headers)


def missing(api: TestClient, user: dict[str, str], files: list[bytes]) -> list[str]:
    asked = {"files": [ref(d).model_dump() for d in files]}
    r = api.post(API + wire.MISSING_PATH, json=asked, headers=user)
    assert r.status_code == 200, r.text
    return list(r.json()["missing"])


def rows(db: Database, table: type[WorkspaceUpload] | type[WorkspaceFile]) -> int:
    with db.session(write=False) as s:
        return int(s.scalar(select(func.count()).select_from(table)) or 0)


def test_a_batch_keeps_every_file_once_and_a_rank_reads_them_back(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    alice = users["alice"]
    files = {f"src/m{i}.py": f"x = {i}\n".encode() for i in range(20)}
    files |= {"empty.txt": b"", "blob.bin": os.urandom(30_000)}
    datas = list(files.values())
    assert len(missing(api, alice, datas)) == len(datas)
    pairs = [(ref(d), d) for d in datas] + [(ref(datas[0]), datas[0])]  # one listed twice
    r = send(api, alice, batch.encode_batch(pairs))
    assert r.status_code == 200, r.text
    assert r.json() == {"stored": [sha(d) for d in datas], "refused": []}
    assert missing(api, alice, datas) == []
    assert rows(db, WorkspaceFile) == rows(db, WorkspaceUpload) == len(datas)

    again = send(api, alice, batch.encode_batch(pairs))  # had already: acknowledged
    assert again.json()["stored"] == [sha(d) for d in datas]
    assert rows(db, WorkspaceUpload) == len(datas), "nothing stored twice"

    created = api.post(API + wire.WORKSPACES_PATH, json={"manifest": manifest(files)},
                       headers=alice)  # fmt: skip
    assert created.status_code == 201, created.text
    job_id = running_job(db, owner="alice")
    name_workspace(db, job_id, created.json()["digest"])
    rank = mint(db, job_id)
    for data in (files["blob.bin"], files["src/m3.py"], b""):
        got = api.get(API + wire.ATTEMPT_WORKSPACE_FILE_PATH.format(sha256=sha(data)),
                      headers=rank)  # fmt: skip
        assert got.status_code == 200 and got.content == data, got.text


def test_a_file_whose_size_or_sha256_lies_is_refused_alone(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    alice = users["alice"]
    good, other, real = b"good file\n", b"something else", b"0123456789"
    pairs = [
        (ref(good), good),
        (ref(other, sha256=sha(b"what it claims to be")), other),  # a wrong sha256
        (ref(real, size=5), real[:5]),  # a wrong size: 5 of its 10 bytes under its sha256
    ]
    r = send(api, alice, batch.encode_batch(pairs))
    assert r.status_code == 200, r.text
    answer = batch.BatchAnswer.model_validate(r.json())
    assert answer.stored == [sha(good)]
    assert [x.sha256 for x in answer.refused] == [sha(b"what it claims to be"), sha(real)]
    assert all("do not match its sha256" in x.reason for x in answer.refused), answer
    assert rows(db, WorkspaceUpload) == rows(db, WorkspaceFile) == 1, "nothing of a refused one"
    assert missing(api, alice, [good, real]) == [sha(real)]


def test_a_body_that_does_not_split_is_422_and_one_over_the_cap_413(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    alice = users["alice"]
    whole = batch.encode_batch([(ref(b"abc"), b"abc")])
    for body, says in (
        (whole + b"x", "add up to 3 bytes but 4 follow"),
        (whole[:-1], "add up to 3 bytes but 2 follow"),
        (b'{"files": [}\nabc', "not a BatchHeader"),
        (b"no header line at all", "ended by a newline"),
        (b'{"files": []}\n', "not a BatchHeader"),
    ):
        r = send(api, alice, body)
        assert r.status_code == 422 and r.json()["code"] == "invalid_batch", r.text
        assert says in r.json()["detail"], (says, r.text)
    big = [(ref(d), d) for d in (os.urandom(40_000), os.urandom(40_000))]  # over 64 KiB
    r = send(api, alice, batch.encode_batch(big))
    assert r.status_code == 413 and r.json()["code"] == "batch_too_large", r.text
    assert "DDPQ_CHECKPOINT_CHUNK_BYTES" in r.json()["detail"]

    def streamed() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield batch.encode_batch(big)

    headers = {**alice, "Content-Type": batch.BATCH_CONTENT_TYPE}
    r = api.post(BATCH, content=streamed(), headers=headers)
    assert r.status_code == 413 and "send smaller batches" in r.json()["detail"], r.text
    assert rows(db, WorkspaceUpload) == 0


def test_another_owners_batch_counts_for_nothing_and_a_rank_token_is_401(
    api: TestClient, db: Database, users: dict[str, dict[str, str]]
) -> None:
    alice, bob = users["alice"], users["bob"]
    data = b"print('mine')\n"
    assert send(api, bob, batch.encode_batch([(ref(data), data)])).status_code == 200
    assert missing(api, alice, [data]) == [sha(data)], "bob's file is not alice's"
    r = send(api, alice, batch.encode_batch([(ref(data), data)]))
    assert r.json()["stored"] == [sha(data)] and missing(api, alice, [data]) == []
    assert rows(db, WorkspaceFile) == 2  # one each

    rank = mint(db, running_job(db, owner="alice"))
    r = send(api, rank, batch.encode_batch([(ref(b"x"), b"x")]))
    assert r.status_code == 401, r.text


class _Counting(httpx.HTTPTransport):
    """An HTTP transport that counts the requests by path."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return super().handle_request(request)


def test_the_client_sends_a_300_file_tree_in_a_few_requests(
    tmp_path: Path, app_settings: Settings, db: Database
) -> None:
    root = tmp_path / "w"
    for i in range(300):
        path = root / f"d{i % 7}" / f"f{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(100 + i))  # 300 files, ~75 kB: one batch
    (root / "weights.bin").write_bytes(os.urandom(batch.BATCH_FILE_MAX_BYTES + 1))  # chunks
    # The default caps: the chunk cap (a lower one costs a 413 per halving of the client's
    # batches) and the body cap (POST /workspaces/missing lists 301 files).
    settings = app_settings.model_copy(
        update={
            "auth": "off",
            "checkpoint_chunk_bytes": batch.BATCH_MAX_BYTES,
            "max_body_bytes": Settings.model_fields["max_body_bytes"].default,
        }
    )
    with serve_app(create_app(settings)) as url:
        counting = _Counting()
        client = DdpqClient(url, token="", transport=counting)
        first = client.upload_workspace(root)
        assert (first.file_count, first.sent_files) == (301, 301)
        assert first.sent_bytes == first.total_bytes
        routes = [re.sub(r"/files/\d+", "/files/{upload_id}", p) for p in counting.paths]
        assert routes == [
            API + wire.MISSING_PATH,
            API + wire.FILES_BATCH_PATH,  # the 300 small files
            API + wire.FILES_PATH,  # weights.bin: begin, one chunk, commit
            API + wire.FILE_CHUNK_PATH,
            API + wire.FILE_COMMIT_PATH,
            API + wire.WORKSPACES_PATH,
        ], counting.paths
        counting.paths.clear()
        again = client.upload_workspace(root)
        assert (again.sent_files, again.sent_bytes, again.digest) == (0, 0, first.digest)
        assert counting.paths == [API + wire.MISSING_PATH, API + wire.WORKSPACES_PATH]


def test_a_file_committed_meanwhile_by_another_batch_keeps_that_one(
    db: Database, app_settings: Settings
) -> None:
    """Two batches of one file at once: the one whose rows commit first counts; the other
    answers the file stored too, its own upload abandoned and its bytes dropped."""
    stores = make_workspace_stores(app_settings, db)
    store = stores[app_settings.checkpoint_store]
    data = b"print('twice')\n"
    kwargs = {"store_name": store.name, "max_bytes": app_settings.workspace_max_bytes}

    class _Racing:
        """The store, with another batch of the same file run inside ``put_files``."""

        name = store.name

        def __getattr__(self, attr: str) -> Any:
            return getattr(store, attr)

        def put_files(self, files: Any) -> list[str]:
            other = store_file_batch(db, stores, "alice", [(ref(data), data)], **kwargs)
            assert other.stored == [sha(data)]
            return list(store.put_files(files))

    racing = {store.name: cast(CheckpointStore, _Racing())}
    answer = store_file_batch(db, racing, "alice", [(ref(data), data)], **kwargs)
    assert (answer.stored, answer.refused) == ([sha(data)], [])
    with db.session(write=False) as s:
        states = {i: st for i, st in s.execute(select(WorkspaceUpload.id, WorkspaceUpload.state))}
        (kept,) = s.scalars(select(WorkspaceFile)).all()
    assert sorted(states.values()) == ["abandoned", "committed"]
    assert states[kept.upload_id] == "committed"
    lost = next(i for i, state in states.items() if state == "abandoned")
    assert store.size(kept.location) == len(data)
    assert store.received_size(upload_key(lost)) == 0, "the abandoned copy's bytes are gone"
