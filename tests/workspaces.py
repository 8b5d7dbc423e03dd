"""Helpers for the workspace route tests: files and manifests, the user's side of the upload
protocol over a TestClient, and jobs whose spec names a workspace."""

from __future__ import annotations

import hashlib
from typing import Any

from service.core.wire import API_PREFIX
from service.core.wire import workspace as wire
from service.core.wire.attempt import CHUNK_SHA256_HEADER
from service.store.db import Database
from service.store.models import Job

API = API_PREFIX


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest(files: dict[str, bytes]) -> dict[str, Any]:
    """A manifest body of ``{path: content}`` (mode 0o644)."""
    return {
        "files": [
            {"path": p, "mode": 0o644, "size_bytes": len(d), "sha256": sha(d)}
            for p, d in files.items()
        ]
    }


def digest(files: dict[str, bytes]) -> str:
    return wire.Manifest.model_validate(manifest(files)).digest()


def begin(api: Any, user: dict[str, str], data: bytes) -> Any:
    body = {"sha256": sha(data), "size_bytes": len(data)}
    return api.post(API + wire.FILES_PATH, json=body, headers=user)


def put_chunk(
    api: Any, user: dict[str, str], upload_id: int, offset: int, body: bytes, digest: str = ""
) -> Any:
    headers = {**user, CHUNK_SHA256_HEADER: digest or sha(body)}
    path = API + wire.FILE_CHUNK_PATH.format(upload_id=upload_id)
    return api.put(path, params={"offset": offset}, content=body, headers=headers)


def commit(api: Any, user: dict[str, str], upload_id: int) -> Any:
    return api.post(API + wire.FILE_COMMIT_PATH.format(upload_id=upload_id), headers=user)


def upload(api: Any, user: dict[str, str], data: bytes) -> dict[str, Any]:
    """Begin, send every chunk, commit: the committed status."""
    r = begin(api, user, data)
    assert r.status_code in (200, 201), r.text
    status: dict[str, Any] = r.json()
    offset = status["received_bytes"]
    while status["state"] == "receiving" and offset < len(data):
        piece = data[offset : offset + status["chunk_bytes"]]
        r = put_chunk(api, user, status["upload_id"], offset, piece)
        assert r.status_code == 200, r.text
        status, offset = r.json(), r.json()["received_bytes"]
    if status["state"] == "receiving":
        r = commit(api, user, status["upload_id"])
        assert r.status_code == 200, r.text
        status = r.json()
    assert status["state"] == "committed", status
    return status


def store_workspace(api: Any, user: dict[str, str], files: dict[str, bytes]) -> Any:
    """Upload every file, then POST the manifest: the answer."""
    for data in files.values():
        upload(api, user, data)
    return api.post(API + wire.WORKSPACES_PATH, json={"manifest": manifest(files)}, headers=user)


def name_workspace(db: Database, job_id: int, workspace: str | None) -> None:
    """Put ``workspace`` in the job's stored spec, as a command job's submission does."""
    with db.session() as s:
        job = s.get_one(Job, job_id)
        spec = {k: v for k, v in job.spec.items() if k != "workspace"}
        if workspace is not None:
            spec["workspace"] = workspace
        job.spec = spec
