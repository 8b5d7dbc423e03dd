"""The workspace routes against a caller who does not use our client: raw JSON bodies over
the real app (SQLite and PostgreSQL, auth on). Hostile manifests are refused naming the
problem and store nothing; declared sizes that lie are refused at the chunk, at the commit
and in the manifest; too many files are refused naming DDPQ_WORKSPACE_MAX_FILES before any
work per file (over a real server: a 10^6-file body, timed)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.app import create_app
from service.core.config import Settings
from service.core.wire import workspace as wire
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.models import Workspace
from tests.live import serve_app
from tests.uploads import bearer
from tests.workspaces import API, commit, put_chunk, sha, upload

CHUNK = 64 * 1024
EMPTY = sha(b"")


@pytest.fixture
def app_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"auth": "on", "checkpoint_chunk_bytes": CHUNK, "workspace_max_files": 50}
    )


@pytest.fixture
def alice(db: Database) -> dict[str, str]:
    with db.session() as s:
        return bearer(create_token(s, owner="alice")[1])


def entry(path: str, size: int = 0, digest: str = EMPTY, mode: int = 0o644) -> dict[str, Any]:
    return {"path": path, "mode": mode, "size_bytes": size, "sha256": digest}


def post_raw(api: TestClient, headers: dict[str, str], body: Any) -> httpx.Response:
    """POST /workspaces with ``body`` serialised by hand (no pydantic on our side)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return api.post(
        API + wire.WORKSPACES_PATH,
        content=raw,
        headers={**headers, "Content-Type": "application/json"},
    )


def workspace_count(db: Database) -> int:
    with db.session(write=False) as s:
        return int(s.scalar(select(func.count()).select_from(Workspace)) or 0)


HOSTILE: list[tuple[str, list[dict[str, Any]], str]] = [
    ("absolute", [entry("/etc/cron.d/x")], "absolute"),
    ("dotdot", [entry("../../.bashrc")], "'..' part"),
    ("dotdot inside", [entry("a/../../b")], "'..' part"),
    ("dot", [entry("./train.py")], "'.' part"),
    ("empty part", [entry("a//b")], "empty part"),
    ("trailing slash", [entry("pkg/")], "empty part"),
    ("backslash", [entry("..\\..\\x.py")], "backslash"),
    ("NUL", [entry("a.py\x00.txt")], "control character"),
    ("newline", [entry("a\nb.py")], "control character"),
    ("too long", [entry("a/" * 2100 + "x")], "longer than 4096 bytes"),
    ("part too long", [entry("x" * 256)], "longer than 255 bytes"),
    ("duplicate", [entry("t.py"), entry("t.py", 5, sha(b"other"))], "'t.py' is listed twice"),
    ("file and dir", [entry("pkg"), entry("pkg/m.py")], "'pkg' is a file and also the dir"),
    ("file and deep dir", [entry("a/b/c/d.py"), entry("a/b")], "'a/b' is a file and also"),
    ("setuid", [entry("run.sh", mode=0o4755)], "0o644 or 0o755"),
    ("negative size", [entry("a.py", size=-1)], "greater than or equal to 0"),
    ("size as text", [entry("a.py") | {"size_bytes": "0"}], "valid integer"),
    ("upper-case sha", [entry("a.py", digest=EMPTY.upper())], "should match pattern"),
    ("a symlink field", [entry("a.py") | {"link": "/etc/passwd"}], "Extra inputs"),
]


@pytest.mark.parametrize(("files", "words"), [(f, w) for _, f, w in HOSTILE],
                         ids=[name for name, _, _ in HOSTILE])  # fmt: skip
def test_a_hostile_manifest_is_refused_naming_the_problem_and_stores_nothing(
    api: TestClient, db: Database, alice: dict[str, str], files: list[dict[str, Any]], words: str
) -> None:
    upload(api, alice, b"")  # every file listed is "uploaded": only the shape can refuse it
    upload(api, alice, b"other")
    r = post_raw(api, alice, {"manifest": {"files": files}})
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_request"
    assert any(words in e["msg"] for e in r.json()["detail"]), r.json()["detail"]
    assert all(e["loc"][:2] == ["body", "manifest"] for e in r.json()["detail"])
    assert workspace_count(db) == 0


def test_bodies_that_are_not_a_manifest_are_422(api: TestClient, alice: dict[str, str]) -> None:
    for raw in (b"", b"{", b"\xff\xfe", b"[]", b'{"manifest": null}', b'{"manifest": {}}'):
        r = post_raw(api, alice, raw)
        assert r.status_code == 422, (raw, r.text)


def test_a_declared_size_that_lies_is_refused_at_the_chunk_and_at_the_commit(
    api: TestClient, alice: dict[str, str]
) -> None:
    data = b"0123456789"
    # Declared 4 bytes, sends all 10: the chunk runs past the declared size.
    r = api.post(API + wire.FILES_PATH, json={"sha256": sha(data), "size_bytes": 4},
                 headers=alice)  # fmt: skip
    assert r.status_code == 201, r.text
    short = r.json()["upload_id"]
    r = put_chunk(api, alice, short, 0, data)
    assert r.status_code == 422, r.text
    assert api.get(API + wire.FILE_UPLOAD_PATH.format(upload_id=short),
                   headers=alice).json()["received_bytes"] == 0  # fmt: skip
    # Sends the 4 declared bytes: they are not the content the sha256 names.
    assert put_chunk(api, alice, short, 0, data[:4]).status_code == 200
    r = commit(api, alice, short)
    assert r.status_code == 422 and r.json()["code"] == "invalid_workspace_file", r.text
    # Declared 20 bytes, sends 10, commits: bytes are missing (409 with the status).
    r = api.post(API + wire.FILES_PATH, json={"sha256": sha(data), "size_bytes": 20},
                 headers=alice)  # fmt: skip
    long = r.json()["upload_id"]
    assert put_chunk(api, alice, long, 0, data).status_code == 200
    r = commit(api, alice, long)
    assert r.status_code == 409 and r.json()["detail"]["received_bytes"] == 10, r.text
    # Nothing was committed: the file is still missing for alice.
    r = api.post(API + wire.MISSING_PATH, json={"files": [{"sha256": sha(data),
                 "size_bytes": 10}]}, headers=alice)  # fmt: skip
    assert r.json()["missing"] == [sha(data)]


@pytest.mark.parametrize("declared", [0, 1, 6])
def test_a_manifest_declaring_another_size_than_the_uploaded_file_is_refused(
    api: TestClient, db: Database, alice: dict[str, str], declared: int
) -> None:
    # Without this check a file declared 0 bytes slips past DDPQ_WORKSPACE_MAX_BYTES, and a
    # stored manifest every rank then refuses (the bytes are not its size).
    data = b"hello"
    upload(api, alice, data)
    files = [entry("ok.txt", 5, sha(data)), entry("lie.txt", declared, sha(data))]
    r = post_raw(api, alice, {"manifest": {"files": files}})
    assert r.status_code == 422 and r.json()["code"] == "workspace_files_missing", r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "manifest", "files", 1, "size_bytes"]
    assert error["type"] == "size_mismatch"
    assert (
        f"'lie.txt' is declared {declared} bytes" in error["msg"] and "is 5 bytes" in error["msg"]
    )
    assert workspace_count(db) == 0
    files[1]["size_bytes"] = 5  # the truth: stored
    assert post_raw(api, alice, {"manifest": {"files": files}}).status_code == 201


def test_too_many_files_are_refused_naming_the_setting_before_any_upload(
    api: TestClient, db: Database, alice: dict[str, str]
) -> None:
    files = [entry(f"src/m{i:03}.py") for i in range(51)]  # workspace_max_files is 50
    r = post_raw(api, alice, {"manifest": {"files": files}})
    assert r.status_code == 413 and r.json()["code"] == "workspace_too_large", r.text
    assert wire.MAX_FILES_SETTING in r.json()["detail"] and "51 files" in r.json()["detail"]
    assert workspace_count(db) == 0


@pytest.fixture
def live(settings: Settings, db: Database) -> Iterator[tuple[str, dict[str, str]]]:
    """A real server (uvicorn) with the default limits, and alice's headers."""
    with db.session() as s:
        alice = bearer(create_token(s, owner="alice")[1])
    with serve_app(create_app(settings.model_copy(update={"auth": "on"}))) as url:
        yield url, alice


def manifest_body(count: int, prefix: str = "f") -> bytes:
    files = ",".join(
        f'{{"path":"{prefix}{i}","mode":420,"size_bytes":0,"sha256":"{EMPTY}"}}'
        for i in range(count)
    )
    return b'{"manifest":{"files":[' + files.encode() + b"]}}"


def raw_post(url: str, path: str, headers: dict[str, str], head: bytes, length: int) -> bytes:
    """Send a POST's headers declaring ``length`` bytes and only ``head`` of the body; the
    answer's raw bytes (the server must answer without waiting for the rest)."""
    host, port = url.removeprefix("http://").split(":")
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        f"Content-Length: {length}",
        "Content-Type: application/json",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_million_empty_files_are_refused_at_once_by_the_body_cap(
    live: tuple[str, dict[str, str]], settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    url, alice = live
    body = manifest_body(10**6)
    assert len(body) > 100 * 10**6  # ~107 MB
    # Streamed without a Content-Length (the cap counts bytes as they come), then with one.
    with httpx.Client(base_url=url, headers=alice, timeout=60) as client:
        started = time.perf_counter()
        try:
            r = client.post(API + wire.WORKSPACES_PATH, content=iter([body[i : i + 2**20]
                            for i in range(0, len(body), 2**20)]))  # fmt: skip
        except httpx.TransportError as exc:  # the server closed mid-body, having answered
            pytest.fail(f"no answer to a streamed 10^6-file manifest: {exc!r}")
        streamed_s = time.perf_counter() - started
        assert r.status_code == 413, r.text
        assert "DDPQ_MAX_BODY_BYTES" in r.json()["detail"]
    # Its Content-Length alone is enough: over a raw socket, headers and the first kilobyte.
    started = time.perf_counter()
    declared = raw_post(url, API + wire.WORKSPACES_PATH, alice, body[:1024], len(body))
    declared_s = time.perf_counter() - started
    assert declared.startswith(b"HTTP/1.1 413") and b"DDPQ_MAX_BODY_BYTES" in declared, declared
    assert streamed_s < 10 and declared_s < 2, (streamed_s, declared_s)
    with capsys.disabled():
        print(f"\n10^6 files: body {len(body)} bytes; streamed refused in {streamed_s:.2f} s, "
              f"by Content-Length in {declared_s:.3f} s")  # fmt: skip


def test_the_most_files_the_body_cap_lets_through_are_refused_naming_max_files(
    live: tuple[str, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, alice = live
    # The default cap for this route is 1 MB + 20,000 files x 512 B (~11.2 MB): as many
    # short entries as fit, 4.5 times DDPQ_WORKSPACE_MAX_FILES (20,000).
    body = manifest_body(90_000)
    assert len(body) < 1_000_000 + 20_000 * 512, len(body)
    started = time.perf_counter()
    r = httpx.post(url + API + wire.WORKSPACES_PATH, content=body, headers=alice, timeout=60)
    took_s = time.perf_counter() - started
    assert r.status_code == 413 and r.json()["code"] == "workspace_too_large", r.text[:300]
    assert wire.MAX_FILES_SETTING in r.json()["detail"] and "90000 files" in r.json()["detail"]
    assert took_s < 10, took_s
    with capsys.disabled():
        print(f"\n90,000 files: body {len(body)} bytes; refused (413 {wire.MAX_FILES_SETTING})"
              f" in {took_s:.2f} s")  # fmt: skip


def test_deep_paths_filling_the_body_cap_are_answered_quickly(
    live: tuple[str, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    # 2,600 paths of 2,047 parts each (~11 MB): checking each path's parents one by one took
    # ~8 s of the event loop; now the body is parsed off the loop in well under a second.
    url, alice = live
    deep = "/".join(["a"] * 2046) + "/"
    body = manifest_body(2600, prefix=deep)
    started = time.perf_counter()
    r = httpx.post(url + API + wire.WORKSPACES_PATH, content=body, headers=alice, timeout=60)
    took_s = time.perf_counter() - started
    assert r.status_code == 422 and r.json()["code"] == "workspace_files_missing", r.text[:300]
    assert took_s < 4, took_s
    with capsys.disabled():
        print(f"\n2,600 deep paths: body {len(body)} bytes; answered in {took_s:.2f} s")
