"""The rank's client of the attempt API (``service.core.wire.attempt``): one pooled HTTP/1.1
connection, the bearer attempt token, and the one table that turns an answer into an error.

Only rank 0's background threads call it (the metrics sink's writer, the checkpoint writer)
and ``worker.runtime.main`` once at start; the training thread never does. httpx's
``Client`` is thread-safe, so the sink's thread and the checkpoint thread share one pool.

Error protocol (``raise_for_answer``):

- no answer (connection refused, reset, DNS, a timeout), 5xx, 429 → ``ApiUnavailableError``:
  retryable, with ``retry_after_s`` from ``Retry-After`` (seconds) when the API sent one;
- 401, 409 → ``StaleAttemptError``: the fence (the attempt was superseded or its token is no
  longer valid); the rank stops as a fenced rank does;
- 422 and any other 4xx → ``AttemptRequestError``: the request itself is wrong, sending it
  again cannot help.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from types import TracebackType
from typing import Any, BinaryIO, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from service.core.errors import DdpqError, StaleAttemptError
from service.core.wire import API_PREFIX
from service.core.wire import attempt as wire
from service.core.wire.workspace import ATTEMPT_WORKSPACE_PATH, Manifest

log = logging.getLogger(__name__)

# Seconds: a connect that takes longer means the API is down or unreachable (retry later);
# a read covers a batch of MAX_BATCH_ROWS points written to PostgreSQL under load.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
# Idle keep-alive connections kept per client: the sink's thread and the checkpoint thread.
POOL_CONNECTIONS = 2
# The longest Retry-After honoured (seconds): a misconfigured proxy must not park the writer.
MAX_RETRY_AFTER_S = 60.0

_Answer = TypeVar("_Answer", bound=BaseModel)


class ApiUnavailableError(DdpqError):
    """The attempt API did not answer, or answered 5xx / 429: try again later.

    ``retry_after_s`` is the server's ``Retry-After`` in seconds (None when it sent none).
    """

    status_code = 503
    code = "api_unavailable"

    def __init__(self, detail: str, *, retry_after_s: float | None = None) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(detail)


class AttemptRequestError(DdpqError):
    """The attempt API refused the request itself (422, or another 4xx): not retryable.
    ``answer_code`` is the answer's own ``code`` (e.g. ``quota_exceeded``), "" when none;
    ``answer`` the whole JSON answer ({} when it was not a JSON object), for the fields a
    refusal carries beside its code (e.g. the name quota's ``stored_names``)."""

    status_code = 422
    code = "attempt_request_refused"

    def __init__(
        self, detail: str, *, answer_code: str = "", answer: dict[str, Any] | None = None
    ) -> None:
        self.answer_code = answer_code
        self.answer = answer or {}
        super().__init__(detail)


class StoredFileDamagedError(AttemptRequestError):
    """A checkpoint download answered 410: the service's stored copy is not the file its row
    recorded (e.g. truncated). Not retryable: that checkpoint is unusable."""

    status_code = 410
    code = "checkpoint_damaged"


class UploadOffsetError(DdpqError):
    """A chunk was sent at another offset than the server's ``received_bytes`` (409 with an
    UploadStatus as its detail): seek to ``status.received_bytes`` and go on."""

    status_code = 409
    code = "upload_offset"

    def __init__(self, status: wire.UploadStatus) -> None:
        self.status = status
        super().__init__(f"upload {status.upload_id} is at byte {status.received_bytes}")


def _upload_status_of(response: httpx.Response) -> wire.UploadStatus | None:
    """The UploadStatus in a 409's ``detail`` (an offset mismatch), else None (the fence)."""
    try:
        detail = response.json().get("detail")
        return wire.UploadStatus.model_validate(detail) if isinstance(detail, dict) else None
    except (ValueError, AttributeError, ValidationError):
        return None


def _answer(response: httpx.Response) -> dict[str, Any]:
    """The error answer's JSON object (``service.api.errors.error_body``), {} if none."""
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    detail = body.get("detail", body) if isinstance(body, dict) else body
    return str(detail)[:2000]


def retry_after_s(response: httpx.Response) -> float | None:
    """``Retry-After`` as seconds (capped at ``MAX_RETRY_AFTER_S``); None when absent or an
    HTTP date (ddpq's API sends seconds; a date is treated as no hint)."""
    raw = response.headers.get("Retry-After")
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def raise_for_answer(response: httpx.Response) -> None:
    """The one mapping of an error answer onto the rank's errors (see the module docstring).

    Raises:
        ApiUnavailableError: 5xx or 429 (``retry_after_s`` from ``Retry-After``).
        StaleAttemptError: 401 or 409 (the fence).
        AttemptRequestError: 422 or any other 4xx.
    """
    status = response.status_code
    if status < 400:
        return
    detail = f"{response.request.method} {response.request.url.path}: {status} {_detail(response)}"
    if status == 429 or status >= 500:
        raise ApiUnavailableError(detail, retry_after_s=retry_after_s(response))
    if status in (401, 409):
        raise StaleAttemptError(detail)
    answer = _answer(response)
    code = answer.get("code")
    raise AttemptRequestError(
        detail, answer_code=code if isinstance(code, str) else "", answer=answer
    )


class AttemptClient:
    """The attempt API for one attempt, as its token allows.

    Args:
        api_url: the API's base URL (``DDPQ_API_URL``, e.g. ``http://127.0.0.1:8000``; a
            trailing ``/api/v1`` is accepted too).
        token: the attempt token (``DDPQ_ATTEMPT_TOKEN``), sent as ``Authorization: Bearer``.
        connect_timeout_s, read_timeout_s: per request, in seconds.
        transport: httpx's transport (default: its pooled HTTP/1.1 one); tests pass
            ``httpx.MockTransport`` to play a server's answers.

    Every method raises ``ApiUnavailableError`` (retryable), ``StaleAttemptError`` (fenced)
    or ``AttemptRequestError`` (refused) as ``raise_for_answer`` decides.

    Raises:
        ApiUnavailableError: ``api_url`` is not a usable URL (said so in the message).
    """

    def __init__(
        self,
        api_url: str,
        token: str,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        base = api_url.rstrip("/")
        if base.endswith(API_PREFIX):
            base = base[: -len(API_PREFIX)]
        self.api_url = base
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(
            max_connections=POOL_CONNECTIONS, max_keepalive_connections=POOL_CONNECTIONS
        )
        try:
            self._http = httpx.Client(
                base_url=base + API_PREFIX,
                headers={"Authorization": f"Bearer {token.strip()}"},
                timeout=timeout,
                limits=limits,
                http1=True,
                http2=False,
                trust_env=False,  # a proxy from the user's environment must not see the token
                transport=transport,
            )
        except (httpx.InvalidURL, ValueError) as exc:
            raise ApiUnavailableError(f"invalid attempt API URL {api_url!r}: {exc}") from None

    def close(self) -> None:
        """Close the connection pool. Idempotent."""
        self._http.close()

    def __enter__(self) -> AttemptClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()

    # -- the routes ----------------------------------------------------------------------------
    def self_check(self) -> wire.AttemptSelf:
        """``GET /attempts/self``: which attempt the token stands for, while it is current."""
        return self._call("GET", wire.SELF_PATH, wire.AttemptSelf)

    def send_metrics(self, batch: wire.MetricBatch) -> wire.MetricBatchAck:
        """``POST /attempts/self/metrics``: safe to resend (idempotent per (job, name, step))."""
        return self._call("POST", wire.METRICS_PATH, wire.MetricBatchAck, batch)

    def list_checkpoints(self) -> list[wire.CheckpointEntry]:
        """``GET /attempts/self/checkpoints``: the job's live checkpoints, newest step first."""
        return self._call("GET", wire.CHECKPOINTS_PATH, wire.CheckpointList).checkpoints

    def workspace_manifest(self) -> Manifest:
        """``GET /attempts/self/workspace``: the manifest of the job's workspace (404 for a
        job that has none)."""
        return self._call("GET", ATTEMPT_WORKSPACE_PATH, Manifest)

    def record_checkpoint(self, record: wire.CheckpointRecord) -> None:
        """``POST /attempts/self/checkpoints``: a written, verified checkpoint file."""
        self._call("POST", wire.CHECKPOINTS_PATH, None, record)

    def record_checkpoint_failure(self, failure: wire.CheckpointFailure) -> None:
        """``POST /attempts/self/checkpoints/failures``: a save that failed (a job event)."""
        self._call("POST", wire.CHECKPOINT_FAILURES_PATH, None, failure)

    def record_deletions(self, steps: Sequence[int], *, damaged: bool = True) -> None:
        """``POST /attempts/self/checkpoints/deletions``: checkpoints found damaged (or, with
        ``damaged`` False, whose file could not be put in place; no request when ``steps`` is
        empty)."""
        if steps:
            body = wire.CheckpointDeletion(steps=list(steps), damaged=damaged)
            self._call("POST", wire.CHECKPOINT_DELETIONS_PATH, None, body)

    def send_note(self, note: wire.AttemptNote) -> None:
        """``POST /attempts/self/notes``: a decision the job's events must show."""
        self._call("POST", wire.NOTES_PATH, None, note)

    def send_timeline(self, timeline: wire.AttemptTimeline) -> None:
        """``POST /attempts/self/timeline``: the attempt's resume step and costs (safe to
        resend: the first resume step told is kept)."""
        self._call("POST", wire.TIMELINE_PATH, None, timeline)

    # -- uploads and downloads (hosts without a shared filesystem) -------------------------------
    def begin_upload(self, start: wire.UploadStart) -> wire.UploadStatus:
        """``POST /attempts/self/uploads``: begin (or find again) the upload of one checkpoint
        file; ``received_bytes`` says where to go on."""
        return self._call("POST", wire.UPLOADS_PATH, wire.UploadStatus, start)

    def upload_status(self, upload_id: int) -> wire.UploadStatus:
        """``GET /attempts/self/uploads/{id}``: where an upload stands (resume point)."""
        return self._call("GET", wire.UPLOAD_PATH.format(upload_id=upload_id), wire.UploadStatus)

    def send_chunk(self, upload_id: int, offset: int, data: bytes) -> wire.UploadStatus:
        """``PUT /attempts/self/uploads/{id}/chunks?offset=N``: ``data`` (at most the upload's
        ``chunk_bytes``) with its sha256 in ``CHUNK_SHA256_HEADER``.

        Raises:
            UploadOffsetError: the server holds another offset (its status is attached).
            ApiUnavailableError, StaleAttemptError, AttemptRequestError: as ``_call``; a 422
                means the chunk arrived damaged or too big and nothing was kept.
        """
        path = wire.UPLOAD_CHUNK_PATH.format(upload_id=upload_id)
        headers = {
            "Content-Type": "application/octet-stream",
            wire.CHUNK_SHA256_HEADER: hashlib.sha256(data).hexdigest(),
        }
        response = self._send("PUT", path, content=data, headers=headers, offset=offset)
        if response.status_code == 409:
            status = _upload_status_of(response)
            if status is not None:
                raise UploadOffsetError(status)
        raise_for_answer(response)
        return self._parse("PUT", path, response, wire.UploadStatus)

    def commit_upload(self, upload_id: int) -> wire.CheckpointEntry:
        """``POST /attempts/self/uploads/{id}/commit``: every byte arrived; the service checks
        the whole file's sha256 and writes the checkpoint row (the only "latest" pointer).

        Raises:
            UploadOffsetError: bytes are missing (the server lost some: resend from its
                ``received_bytes``).
            AttemptRequestError: 422, the whole file's sha256 did not match (discarded).
        """
        path = wire.UPLOAD_COMMIT_PATH.format(upload_id=upload_id)
        response = self._send("POST", path, content=None, headers=None)
        if response.status_code == 409:
            status = _upload_status_of(response)
            if status is not None:
                raise UploadOffsetError(status)
        raise_for_answer(response)
        return self._parse("POST", path, response, wire.CheckpointEntry)

    def download(self, path: str, out: BinaryIO, offset: int = 0) -> str | None:
        """Stream ``GET path`` (``CHECKPOINT_FILE_PATH`` or ``INIT_FILE_PATH``) into ``out``
        from byte ``offset`` (``Range: bytes=offset-``), as the bytes arrive: never the whole
        file in memory. ``out`` must be positioned at ``offset``.

        Returns:
            The file's sha256 from ``SHA256_HEADER`` (None when the server sent none).
        Raises:
            ApiUnavailableError: no answer, 5xx, a cut stream (resume from ``out.tell()``),
                or a server that ignored the Range (answered 200 to ``offset > 0``).
            StoredFileDamagedError: 410, the stored copy is damaged.
            StaleAttemptError, AttemptRequestError: as ``raise_for_answer``.
        """
        headers = {"Range": f"bytes={offset}-"} if offset > 0 else None
        try:
            with self._http.stream("GET", path, headers=headers) as response:
                if response.status_code >= 400:
                    response.read()
                    if response.status_code == 410:
                        raise StoredFileDamagedError(f"GET {path}: 410 {_detail(response)}")
                    raise_for_answer(response)
                if offset > 0 and response.status_code != 206:
                    raise ApiUnavailableError(
                        f"GET {path}: answered {response.status_code} to a Range request"
                    )
                for block in response.iter_bytes():  # as it arrives: a cut loses nothing read
                    out.write(block)
                return response.headers.get(wire.SHA256_HEADER)
        except httpx.TimeoutException as exc:
            raise ApiUnavailableError(f"GET {path}: timed out ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise ApiUnavailableError(
                f"GET {path}: cut off from {self.api_url} ({exc or type(exc).__name__})"
            ) from None

    # -- plumbing ------------------------------------------------------------------------------
    def _send(
        self, method: str, path: str, *, content: bytes | None, headers: dict[str, str] | None,
        offset: int | None = None,
    ) -> httpx.Response:  # fmt: skip
        params = {"offset": str(offset)} if offset is not None else None
        try:
            return self._http.request(method, path, content=content, headers=headers, params=params)
        except httpx.TimeoutException as exc:
            raise ApiUnavailableError(
                f"{method} {path}: the attempt API at {self.api_url} timed out "
                f"({type(exc).__name__})"
            ) from None
        except httpx.TransportError as exc:  # refused, reset, DNS, protocol
            raise ApiUnavailableError(
                f"{method} {path}: cannot reach the attempt API at {self.api_url} "
                f"({exc or type(exc).__name__})"
            ) from None

    def _parse(
        self, method: str, path: str, response: httpx.Response, answer: type[_Answer]
    ) -> _Answer:
        try:
            return answer.model_validate_json(response.content)
        except ValidationError as exc:
            # An answer we cannot read: a proxy's page, or an API of another version.
            raise ApiUnavailableError(
                f"{method} {path}: {self.api_url} answered {response.status_code} with a body "
                f"that does not parse as {answer.__name__}: {exc.error_count()} error(s)"
            ) from None

    def _call(
        self,
        method: str,
        path: str,
        answer: type[_Answer] | None,
        body: BaseModel | None = None,
    ) -> Any:
        content = body.model_dump_json().encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if content is not None else None
        response = self._send(method, path, content=content, headers=headers)
        raise_for_answer(response)
        if answer is None:
            return None
        return self._parse(method, path, response, answer)
