"""A fake of ddpq's workspace routes and job submission, played at the HTTP boundary
(``httpx.MockTransport``) so the real ``DdpqClient`` and ``ddpq run`` code is exercised:
workspace files stored per owner by sha256, uploads with the chunk protocol of
``service.core.wire.workspace`` (offset checks, chunk sha256, commit verification), batches
of small files (``service.core.wire.batch``: each file checked against its sha256), manifests
by digest, and jobs that a test can end. It records every request and every file byte that
arrived (in chunks or batches), so a test can tell exactly what was sent.

Once the API has the real routes, the same tests can run against it (``DdpqClient`` over a
live server) instead.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

from service.client import DdpqClient
from service.core.wire import API_PREFIX, batch
from service.core.wire import workspace as wire
from service.core.wire.attempt import CHUNK_SHA256_HEADER

API = API_PREFIX


@dataclass
class _Upload:
    upload_id: int
    sha256: str
    size_bytes: int
    data: bytearray = field(default_factory=bytearray)
    state: str = "receiving"


class FakeWorkspaceApi:
    """The fake server. ``chunk_bytes``: the chunk cap it announces. ``faults``: per chunk
    PUT, in order, None (take it), ``"corrupt"`` (answer 422 as for a damaged body) or
    ``"offset"`` (answer 409 with the status, as after a lost answer)."""

    def __init__(self, chunk_bytes: int = 64 * 2**10) -> None:
        self.chunk_bytes = chunk_bytes
        self.files: dict[str, bytes] = {}
        self.workspaces: dict[str, wire.Manifest] = {}
        self.uploads: dict[int, _Upload] = {}
        self.jobs: dict[int, dict[str, Any]] = {}
        self.dry_runs: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []
        self.chunk_bytes_received = 0  # file bytes taken, from chunks and batches alike
        self.faults: list[str | None] = []
        # The most file bytes a batch may carry (413 beyond, as a smaller chunk cap would),
        # and the sha256 of files a batch refuses as if they arrived damaged.
        self.batch_max_bytes = batch.BATCH_MAX_BYTES
        self.batch_refuses: set[str] = set()
        self.end_state = "succeeded"  # what GET /jobs/{id} says a job became
        self._lock = threading.Lock()

    def client(self) -> DdpqClient:
        """A real ``DdpqClient`` whose requests this fake answers."""
        return DdpqClient("http://api.test", token="", transport=httpx.MockTransport(self))

    @property
    def files_committed(self) -> int:
        return sum(1 for u in self.uploads.values() if u.state == "committed")

    # -- the transport ----------------------------------------------------------------------------
    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:  # the client sends batches from two threads at once
            return self._answer(request)

    def _answer(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.requests.append((request.method, path))
        assert path.startswith(API), path
        route = path[len(API) :]
        parts = route.strip("/").split("/")
        method = request.method
        if route == wire.MISSING_PATH and method == "POST":
            asked = wire.MissingFiles.model_validate_json(request.content)
            missing = [f.sha256 for f in asked.files if f.sha256 not in self.files]
            return self._json(200, {"missing": missing})
        if route == wire.FILES_BATCH_PATH and method == "POST":
            return self._batch(request.content)
        if route == wire.FILES_PATH and method == "POST":
            return self._begin(wire.FileUploadStart.model_validate_json(request.content))
        if parts[:2] == ["workspaces", "files"] and len(parts) >= 3:
            upload = self.uploads.get(int(parts[2]))
            if upload is None:
                return self._json(404, {"detail": "upload not found", "code": "not_found"})
            if len(parts) == 3 and method == "GET":
                return self._json(200, self._status(upload))
            if parts[3:] == ["chunks"] and method == "PUT":
                return self._chunk(upload, request)
            if parts[3:] == ["commit"] and method == "POST":
                return self._commit(upload)
        if route == wire.WORKSPACES_PATH and method == "POST":
            return self._create(json.loads(request.content))
        if parts[0] == "workspaces" and len(parts) == 2 and method == "GET":
            manifest = self.workspaces.get(parts[1])
            if manifest is None:
                return self._json(404, {"detail": "workspace not found", "code": "not_found"})
            return self._json(200, manifest.model_dump())
        if route == "/jobs" and method == "POST":
            spec = json.loads(request.content)
            if request.url.params.get("dry_run") == "true":
                self.dry_runs.append(spec)
                return self._json(200, {"spec": spec, "plans": [], "warnings": []})
            return self._submit(spec)
        if parts[0] == "jobs" and len(parts) >= 2:
            return self._job_read(int(parts[1]), parts[2:])
        return self._json(404, {"detail": f"no route {method} {route}", "code": "not_found"})

    # -- routes -----------------------------------------------------------------------------------
    def _begin(self, start: wire.FileUploadStart) -> httpx.Response:
        for upload in self.uploads.values():
            if upload.sha256 == start.sha256 and upload.state == "receiving":
                return self._json(200, self._status(upload))
        upload = _Upload(len(self.uploads) + 1, start.sha256, start.size_bytes)
        if start.sha256 in self.files:
            upload.state = "committed"
        self.uploads[upload.upload_id] = upload
        return self._json(201, self._status(upload))

    def _batch(self, body: bytes) -> httpx.Response:
        try:
            files = batch.split_batch(body, self.batch_max_bytes)
        except (batch.BatchFramingError, batch.BatchTooLargeError) as exc:
            return self._json(exc.status_code, {"detail": str(exc), "code": exc.code})
        stored: list[str] = []
        refused: list[dict[str, str]] = []
        for ref, data in files:
            if ref.sha256 in self.batch_refuses or hashlib.sha256(data).hexdigest() != ref.sha256:
                refused.append({"sha256": ref.sha256, "reason": "sha256 mismatch"})
                continue
            if ref.sha256 not in self.files:  # a committed upload, as the real API writes
                upload = _Upload(len(self.uploads) + 1, ref.sha256, ref.size_bytes)
                upload.data.extend(data)
                upload.state = "committed"
                self.uploads[upload.upload_id] = upload
                self.files[ref.sha256] = data
                self.chunk_bytes_received += len(data)
            stored.append(ref.sha256)
        return self._json(200, {"stored": stored, "refused": refused})

    def _chunk(self, upload: _Upload, request: httpx.Request) -> httpx.Response:
        fault = self.faults.pop(0) if self.faults else None
        offset = int(request.url.params["offset"])
        body = request.content
        if fault == "offset" or offset != len(upload.data):
            if fault == "offset":  # the previous chunk's answer was lost: it had arrived
                upload.data.extend(body)
                self.chunk_bytes_received += len(body)
            return self._json(409, {"detail": self._status(upload), "code": "upload_state"})
        if fault == "corrupt" or hashlib.sha256(body).hexdigest() != request.headers.get(
            CHUNK_SHA256_HEADER
        ):
            return self._json(422, {"detail": "chunk sha256 mismatch", "code": "invalid"})
        if len(body) > self.chunk_bytes:
            return self._json(422, {"detail": "chunk too big", "code": "invalid"})
        upload.data.extend(body)
        self.chunk_bytes_received += len(body)
        return self._json(200, self._status(upload))

    def _commit(self, upload: _Upload) -> httpx.Response:
        if len(upload.data) != upload.size_bytes:
            return self._json(409, {"detail": self._status(upload), "code": "upload_state"})
        if hashlib.sha256(upload.data).hexdigest() != upload.sha256:
            upload.state = "abandoned"
            return self._json(422, {"detail": "sha256 mismatch", "code": "invalid"})
        upload.state = "committed"
        self.files[upload.sha256] = bytes(upload.data)
        return self._json(200, self._status(upload))

    def _create(self, body: dict[str, Any]) -> httpx.Response:
        manifest = wire.WorkspaceCreate.model_validate(body).manifest
        absent = [f.path for f in manifest.files if f.sha256 not in self.files]
        if absent:
            return self._json(422, {"detail": f"files not uploaded: {absent}", "code": "invalid"})
        digest = manifest.digest()
        status = 200 if digest in self.workspaces else 201
        self.workspaces[digest] = manifest
        summary = wire.WorkspaceSummary(
            digest=digest, file_count=manifest.file_count, total_bytes=manifest.total_bytes
        )
        return self._json(status, summary.model_dump())

    def _submit(self, spec: dict[str, Any]) -> httpx.Response:
        job_id = len(self.jobs) + 1
        self.jobs[job_id] = {
            "id": job_id,
            "name": spec["name"],
            "owner": "local",
            "state": "queued",
            "attempt": 0,
            "spec": spec,
            "progress": {},
            "latest_metrics": {},
            "error": None,
            "created_at": "2026-01-01T00:00:00Z",
            "started_at": None,
            "finished_at": None,
        }
        return self._json(201, self.jobs[job_id])

    def _job_read(self, job_id: int, rest: list[str]) -> httpx.Response:
        job = self.jobs.get(job_id)
        if job is None:
            return self._json(404, {"detail": f"job {job_id} not found", "code": "job_not_found"})
        if not rest:
            job.update(state=self.end_state, attempt=1, started_at="2026-01-01T00:00:01Z",
                       finished_at="2026-01-01T00:00:09Z")  # fmt: skip
            return self._json(200, job)
        if rest == ["checkpoints"]:
            return self._json(200, {"checkpoints": []})
        return self._json(404, {"detail": "not here", "code": "not_found"})

    # -- helpers ----------------------------------------------------------------------------------
    def _status(self, upload: _Upload) -> dict[str, Any]:
        return wire.FileUploadStatus(
            upload_id=upload.upload_id,
            sha256=upload.sha256,
            size_bytes=upload.size_bytes,
            received_bytes=len(upload.data),
            chunk_bytes=self.chunk_bytes,
            state=upload.state,
        ).model_dump()

    @staticmethod
    def _json(status: int, body: Any) -> httpx.Response:
        return httpx.Response(status, json=body)
