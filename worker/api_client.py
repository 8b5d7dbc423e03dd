"""``ApiRecords``: the worker's ``WorkerRecords`` over the worker API (``/api/v1/workers/self/…``,
``service.core.wire.worker``), with a worker token. The worker holds nothing else: no database
URL, no user token.

Each method is one HTTP call, not retried here: the loop retries a failing tick with backoff
(and stops its ranks before a lease it could not renew lapses). Errors come back as the
``DdpqError``s the loop already tells apart:

- no answer (connection refused or cut, timeout) or a 5xx: ``ControlPlaneUnavailableError``;
- 401: ``WorkerTokenRefusedError`` (unknown or revoked token); 403:
  ``WorkerTokenMismatchError``;
- 404: ``NotFoundError`` (the worker is not registered: register again) or ``NotHeldError``;
- 409: ``StaleStateError`` / ``InvalidTransitionError`` / ``ConflictError``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from service.core.errors import (
    ConflictError,
    ControlPlaneUnavailableError,
    DdpqError,
    InvalidTransitionError,
    NotFoundError,
    NotHeldError,
    StaleStateError,
    WorkerTokenMismatchError,
    WorkerTokenRefusedError,
)
from service.core.events import EventKind
from service.core.holds import (
    AdoptedJob,
    ClaimedJob,
    ClaimedJobs,
    HeldJob,
    SchedulerHandle,
    Transition,
)
from service.core.states import JobState
from service.core.wire import API_PREFIX
from service.core.wire.worker import (
    ADOPTER_PATH,
    ADOPTIONS_PATH,
    CLAIM_PATH,
    HANDLES_PATH,
    HEARTBEAT_PATH,
    MAX_BATCH,
    MAX_CLAIM_WAIT_S,
    NOTES_PATH,
    PENDING_PATH,
    REGISTER_PATH,
    STOP_PATH,
    TRANSITIONS_PATH,
    WORKER_ID_HEADER,
    AdopterIn,
    AdopterOut,
    AdoptOut,
    Capacity,
    ClaimIn,
    ClaimOut,
    HandlesIn,
    HeartbeatOut,
    NoteIn,
    NoteOut,
    PendingIn,
    RegisterIn,
    TransitionIn,
    TransitionOut,
    WorkerAck,
)

Out = TypeVar("Out", bound=BaseModel)

# A call fails after these (seconds): the worker's lease fence counts the longest a call can
# block in its budget, so they stay short; a slow answer is retried on the next tick.
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 5.0  # beyond a claim's own wait


class ApiRecords:
    """``WorkerRecords`` over HTTP for worker ``worker_id`` of ``launcher``.

    Args:
        api_url: the API's base URL (``http://host:8000``; the ``/api/v1`` prefix is added).
        token: a worker token (``ddpqw_…``).
        worker_id: this worker process's id (``worker.main.make_worker_id``).
        launcher: the launcher it runs jobs with (``"local"``, ``"slurm"``).
        lease_s: the lease to assume until the API says (each answer carries the API's).
        client: an ``httpx.Client`` to send through instead of a new one (tests pass the
            API's in-process test client); its base URL must be the API's root.
    """

    def __init__(
        self,
        api_url: str,
        token: str,
        worker_id: str,
        launcher: str,
        *,
        lease_s: float = 30.0,
        client: httpx.Client | None = None,
    ) -> None:
        self._worker_id = worker_id
        self.launcher = launcher
        self.lease_s = lease_s
        self._headers = {"Authorization": f"Bearer {token}", WORKER_ID_HEADER: worker_id}
        self._owns_client = client is None
        self._client = client or httpx.Client(
            base_url=api_url.rstrip("/"),
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            trust_env=False,  # the API is reached directly, never through a proxy
        )
        self._lock = threading.Lock()  # one call at a time: the loop and its launches share it

    @property
    def worker_id(self) -> str:
        """The worker these records speak for."""
        return self._worker_id

    @property
    def call_timeout_s(self) -> float:
        """See ``WorkerRecords.call_timeout_s``: connecting, then reading the answer."""
        return CONNECT_TIMEOUT_S + READ_TIMEOUT_S

    def close(self) -> None:
        """Close the HTTP client (if this object made it)."""
        if self._owns_client:
            self._client.close()

    # -- the calls ------------------------------------------------------------------------

    def register(self, *, host: str, pid: int, capacity: dict[str, Any]) -> None:
        """See ``WorkerRecords.register``."""
        body = RegisterIn(
            host=host, pid=pid, launcher=self.launcher, capacity=Capacity.model_validate(capacity)
        )
        ack = self._call("PUT", REGISTER_PATH, body, WorkerAck)
        self.lease_s = ack.lease_s

    def heartbeat(self) -> list[HeldJob]:
        """See ``WorkerRecords.heartbeat``."""
        out = self._call("POST", HEARTBEAT_PATH, None, HeartbeatOut)
        self.lease_s = out.lease_s
        return out.jobs

    def stop(self) -> None:
        """See ``WorkerRecords.stop``."""
        self._call("POST", STOP_PATH, None, WorkerAck)

    def claim(self, max_gpus_per_node: int, wait_s: float = 0.0) -> ClaimedJob | None:
        """See ``WorkerRecords.claim``."""
        out = self._claim(ClaimIn(max_gpus_per_node=max_gpus_per_node, wait_s=_wait(wait_s)))
        return out.jobs[0] if out.jobs else None

    def claim_many(
        self, max_gpus_per_node: int, limit: int, wait_s: float = 0.0
    ) -> list[ClaimedJob]:
        """See ``WorkerRecords.claim_many``."""
        body = ClaimIn(
            max_gpus_per_node=max_gpus_per_node, limit=_limit(limit), wait_s=_wait(wait_s)
        )
        return self._claim(body).jobs

    def claim_batch(
        self, max_gpus_per_node: int, limit: int, wait_s: float = 0.0
    ) -> ClaimedJobs | None:
        """See ``WorkerRecords.claim_batch``."""
        body = ClaimIn(
            max_gpus_per_node=max_gpus_per_node, batch=True, limit=limit, wait_s=_wait(wait_s)
        )
        out = self._claim(body)
        if not out.jobs:
            return None
        return ClaimedJobs(tuple(out.jobs), out.sweep_id, out.max_concurrent)

    def record_handles(self, handles: Sequence[SchedulerHandle]) -> None:
        """See ``WorkerRecords.record_handles``."""
        self._call("POST", HANDLES_PATH, HandlesIn(handles=list(handles)), WorkerAck)

    def apply(
        self,
        transition: Transition,
        *,
        error: str | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> JobState:
        """See ``WorkerRecords.apply``."""
        body = TransitionIn.model_validate(
            {"transition": transition, "error": error, "values": dict(values or {})}
        )
        try:
            return self._call("POST", TRANSITIONS_PATH, body, TransitionOut).state
        except ConflictError as exc:
            if isinstance(exc, InvalidTransitionError):
                raise
            raise StaleStateError(transition.job_id, transition.expected) from exc

    def adopter_of(self, job_id: int, attempt: int) -> str | None:
        """See ``WorkerRecords.adopter_of``."""
        body = AdopterIn(job_id=job_id, attempt=attempt)
        return self._call("POST", ADOPTER_PATH, body, AdopterOut).worker_id

    def adopt(self) -> list[AdoptedJob]:
        """See ``WorkerRecords.adopt``."""
        return self._call("POST", ADOPTIONS_PATH, None, AdoptOut).jobs

    def note(self, job_id: int, attempt: int, kind: EventKind, data: Mapping[str, Any]) -> bool:
        """See ``WorkerRecords.note``."""
        body = NoteIn(job_id=job_id, attempt=attempt, kind=kind, data=dict(data))
        try:
            return self._call("POST", NOTES_PATH, body, NoteOut).written
        except NotHeldError:
            return False

    def note_pending_reason(self, job_id: int, attempt: int, code: str, words: str) -> bool:
        """See ``WorkerRecords.note_pending_reason``."""
        body = PendingIn(job_id=job_id, attempt=attempt, code=code, words=words)
        try:
            return self._call("POST", PENDING_PATH, body, NoteOut).written
        except NotHeldError:
            return False

    # -- HTTP -------------------------------------------------------------------------------

    def _claim(self, body: ClaimIn) -> ClaimOut:
        timeout = httpx.Timeout(body.wait_s + READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        return self._call("POST", CLAIM_PATH, body, ClaimOut, timeout=timeout)

    def _call(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        out: type[Out],
        *,
        timeout: httpx.Timeout | None = None,
    ) -> Out:
        content = body.model_dump_json().encode() if body is not None else None
        headers = {**self._headers, "Content-Type": "application/json"}
        # A client passed in (the API's test client) keeps its own timeouts.
        extra: dict[str, Any] = {"timeout": timeout} if timeout and self._owns_client else {}
        try:
            with self._lock:
                response = self._client.request(
                    method, API_PREFIX + path, content=content, headers=headers, **extra
                )
        except httpx.TransportError as exc:
            raise ControlPlaneUnavailableError(
                f"the API did not answer {method} {path}: {type(exc).__name__}: {exc}"
            ) from None
        if response.status_code >= 400:
            raise _error(response)
        try:
            return out.model_validate_json(response.content)
        except ValidationError as exc:
            raise DdpqError(f"unexpected answer to {method} {path}: {exc}") from None


def _wait(wait_s: float) -> float:
    return max(0.0, min(wait_s, MAX_CLAIM_WAIT_S))


def _limit(limit: int) -> int:
    return max(1, min(limit, MAX_BATCH))


def _error(response: httpx.Response) -> DdpqError:
    """The ``DdpqError`` an error answer stands for (by status and the body's ``code``)."""
    status = response.status_code
    try:
        payload = response.json()
    except ValueError:
        payload = {}
    detail = payload.get("detail", response.text[:500]) if isinstance(payload, dict) else payload
    code = payload.get("code") if isinstance(payload, dict) else None
    where = f"{response.request.method} {response.request.url.path}"
    if status == 401:
        return WorkerTokenRefusedError(
            f"the API refused this worker's token ({detail}): check DDPQ_WORKER_TOKEN (create "
            "one with `ddpq token create --worker`; a revoked token stays refused)"
        )
    if status == 403:
        return WorkerTokenMismatchError(str(detail))
    if status == 404:
        return NotHeldError(str(detail)) if code == "job_not_held" else NotFoundError(str(detail))
    if status == 409:
        if code == "invalid_transition":
            return InvalidTransitionError(str(detail))
        return ConflictError(str(detail))
    if status >= 500 or status == 429:
        return ControlPlaneUnavailableError(f"{where}: {status} {detail}")
    return DdpqError(f"{where}: {status} {detail}")
