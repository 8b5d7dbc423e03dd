"""The one exception hierarchy of ddpq; each error carries its HTTP status and a stable
``code`` that the API puts in every error body, so clients branch on it, never on the text."""

from __future__ import annotations

from typing import Any


class DdpqError(Exception):
    """Base of every ddpq error. ``status_code`` is what the API answers with.

    ``detail`` is the full message (logs, CLI); ``public``, when set, replaces it in an API
    answer: the store sets it when it translates a driver error, whose text (SQL, values,
    server messages) stays in the server's log. ``retry_after_s``, when set, becomes the
    answer's ``Retry-After`` header.
    """

    status_code: int = 400
    code: str = "error"
    # Seconds after which a retry may succeed (e.g. a rate limit): the API's ``Retry-After``.
    retry_after_s: float | None = None

    def answer_fields(self) -> dict[str, Any]:
        """Fields an API answer carries beside ``detail`` and ``code`` (none by default):
        what a client needs to act on the refusal without another request."""
        return {}

    def __init__(self, detail: Any = None, *, public: str | None = None) -> None:
        self.detail = detail if detail is not None else self.__class__.__doc__
        self.public = public
        super().__init__(str(self.detail))

    @property
    def client_detail(self) -> Any:
        """What an API client is told: ``public`` when set, else ``detail``."""
        return self.public if self.public is not None else self.detail


class NotFoundError(DdpqError):
    """The object does not exist (or is not yours)."""

    status_code = 404
    code = "not_found"


class JobNotFoundError(NotFoundError):
    """No job with this id, or one the caller may not see (the two answer alike)."""

    code = "job_not_found"

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id} not found")


class SweepNotFoundError(NotFoundError):
    """No sweep with this id, or one the caller may not see (the two answer alike)."""

    code = "sweep_not_found"

    def __init__(self, sweep_id: int) -> None:
        self.sweep_id = sweep_id
        super().__init__(f"sweep {sweep_id} not found")


class ConflictError(DdpqError):
    """The request conflicts with the current state."""

    status_code = 409
    code = "conflict"


class InvalidTransitionError(ConflictError):
    """A state change that the transition table does not allow."""

    code = "invalid_transition"


class StaleStateError(ConflictError):
    """The job was not in the expected state any more (compare-and-set lost)."""

    code = "stale_state"

    def __init__(self, job_id: int, expected: object, actual: object = None) -> None:
        self.job_id = job_id
        self.expected = expected
        super().__init__(
            f"job {job_id} is no longer {expected!s}"
            + (f" (now {actual!s})" if actual is not None else "")
        )


class StaleAttemptError(ConflictError):
    """A write from an attempt that is no longer the job's current one (fenced off)."""

    code = "stale_attempt"


class SpecValidationError(DdpqError):
    """A job spec failed validation. ``errors`` holds one ``{loc, msg}`` per bad field."""

    status_code = 422
    code = "invalid_spec"

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self.errors = errors
        super().__init__(errors)


class ControlPlaneUnavailableError(DdpqError):
    """The worker could not reach the API (connection refused or cut, timeout, 5xx), or the
    API could not reach its database: retry with backoff; running jobs are left alone until
    their leases would lapse."""

    status_code = 503
    code = "api_unavailable"


class DatabaseUnavailableError(ControlPlaneUnavailableError):
    """The database could not be reached or refused the operation."""

    status_code = 503
    code = "database_unavailable"


class SchemaOutOfDateError(DdpqError):
    """The database schema is not at the revision this code expects."""

    status_code = 503
    code = "schema_out_of_date"


class MigrationError(DdpqError):
    """A schema migration could not run; ``hint`` says what to try."""

    status_code = 500
    code = "migration"

    def __init__(self, detail: str, *, hint: str) -> None:
        super().__init__(detail)
        self.hint = hint


class NotHeldError(NotFoundError):
    """A worker acted on a job it does not hold (or on an attempt no longer current)."""

    code = "job_not_held"


class WorkerTokenMismatchError(DdpqError):
    """A worker id registered with another worker token: only that token acts for it."""

    status_code = 403
    code = "worker_token_mismatch"


class WorkerTokenRefusedError(DdpqError):
    """The API refused the worker's token (unknown, revoked, or not a worker token)."""

    status_code = 401
    code = "worker_token_refused"
