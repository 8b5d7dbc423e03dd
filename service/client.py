"""DdpqClient: the Python client of the REST API (httpx), used by the CLI and by user code."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from service.core.config import Settings
from service.core.errors import DdpqError
from service.core.limits import DEFAULT_PAGE_ITEMS, METRIC_PAGE_POINTS
from service.core.wire import API_PREFIX
from service.core.wire.attempt import SHA256_HEADER
from service.workspaces.calls import WorkspaceCalls


class ApiError(DdpqError):
    """The API answered with an error; ``status_code``, ``detail`` and ``code`` are the
    server's (``code`` is the stable one to branch on, e.g. ``JobNotFoundError.code``; it stays
    ``api_error`` when the answer carried none: a proxy's page, an older server)."""

    code = "api_error"

    def __init__(self, status_code: int, detail: Any, code: str | None = None) -> None:
        super().__init__(detail)
        self.status_code = status_code
        if code:
            self.code = code

    def __str__(self) -> str:
        return f"HTTP {self.status_code}: {self.detail}"


class ChecksumMismatchError(DdpqError):
    """A downloaded checkpoint's bytes do not have the sha256 the server recorded for it."""

    status_code = 502
    code = "checksum_mismatch"

    def __init__(self, job_id: int, step: int, expected: str, actual: str) -> None:
        super().__init__(
            f"job {job_id}'s checkpoint at step {step} arrived with sha256 {actual}, not "
            f"{expected or '(none sent)'}: the download was corrupted or cut short and was "
            "deleted; download it again"
        )


class ApiUnreachableError(DdpqError):
    """No answer from the API at all (connection refused, DNS, timeout)."""

    status_code = 503
    code = "api_unreachable"

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(
            f"cannot reach the ddpq API at {url} ({reason}): is `ddpq serve` or `ddpq up` "
            "running? set DDPQ_API_URL to where it listens"
        )


class ApiTokenError(DdpqError):
    """The API token cannot be a token: not printable ASCII (a pasted character, a newline
    inside it). Tokens from ``ddpq token create`` are URL-safe ASCII."""

    status_code = 400
    code = "bad_api_token"

    def __init__(self) -> None:
        super().__init__(
            "DDPQ_TOKEN holds characters no API token has (non-ASCII, spaces or control "
            "characters inside it): set it to the exact line `ddpq token create` printed"
        )


class ApiUrlError(DdpqError):
    """The API URL itself is unusable (not a URL, bad host or port)."""

    status_code = 400
    code = "bad_api_url"

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        super().__init__(
            f"invalid API URL {url!r} ({reason}): set DDPQ_API_URL to where `ddpq serve` "
            "listens, e.g. http://127.0.0.1:8000"
        )


class DdpqClient(WorkspaceCalls):
    """A synchronous client of one ddpq API.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (default: ``Settings().resolved_api_url``,
            i.e. ``DDPQ_API_URL``).
        token: sent as ``Authorization: Bearer <token>`` (default: ``DDPQ_TOKEN``).
        timeout_s: per-request timeout in seconds.
        transport: httpx's transport (default: its own); tests pass ``httpx.MockTransport``.

    Every method raises ``ApiError`` for an error answer and ``ApiUnreachableError`` when
    the API does not answer. Workspaces and command jobs (``run``, ``upload_workspace``, the
    workspace routes) come from ``WorkspaceCalls``.

    Raises:
        ApiUrlError: ``base_url`` is not a usable URL (e.g. ``http://[::1``).
        ApiTokenError: ``token`` has characters no token has.
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        timeout_s: float = 10,
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if base_url is None or token is None:
            settings = Settings()
            base_url = base_url or settings.resolved_api_url
            if token is None and settings.token is not None:
                token = settings.token.get_secret_value()
        self.base_url = base_url.rstrip("/")
        token = (token or "").strip()  # a token read from a file keeps its newline
        if token and not (token.isascii() and token.isprintable() and " " not in token):
            raise ApiTokenError()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            self._http = httpx.Client(
                base_url=self.base_url, timeout=timeout_s, headers=headers, transport=transport
            )
        except httpx.InvalidURL as exc:
            raise ApiUrlError(self.base_url, str(exc)) from None

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> DdpqClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing -------------------------------------------------------------------

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise ApiUnreachableError(self.base_url, f"timed out: {type(exc).__name__}") from None
        except httpx.InvalidURL as exc:
            raise ApiUrlError(self.base_url, str(exc)) from None
        except httpx.RequestError as exc:
            raise ApiUnreachableError(self.base_url, str(exc) or type(exc).__name__) from None
        if response.status_code >= 400:
            raise ApiError(response.status_code, *_detail_and_code(response))
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._send(method, API_PREFIX + path, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise ApiError(
                response.status_code,
                f"{self.base_url} answered something that is not JSON: is DDPQ_API_URL the "
                "address of a ddpq API?",
            ) from None

    # ---- jobs -----------------------------------------------------------------------

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        """Submit a job spec; returns the Job (the earlier one on an Idempotency-Key replay).

        Raises:
            ApiError: 422 with ``detail`` = list of ``{loc, msg, type}`` for a bad spec.
        """
        headers = {"Content-Type": "application/json"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        # ASCII JSON with NaN/Infinity allowed: text and numbers that JSON cannot carry reach
        # the server, whose 422 names the field, instead of failing here while encoding.
        body = json.dumps(spec, ensure_ascii=True, allow_nan=True)
        result: dict[str, Any] = self._json("POST", "/jobs", content=body, headers=headers)
        return result

    def dry_run(self, spec: dict[str, Any], job_id: int | None = None) -> dict[str, Any]:
        """What submitting ``spec`` would do, storing nothing (``POST /jobs?dry_run=true``):
        the normalised spec, launch plans, resume point (as job ``job_id``'s next attempt),
        queue explanation and warnings.

        Raises:
            ApiError: 422 for a bad spec; 404 when ``job_id`` is not the caller's job.
        """
        params: dict[str, Any] = {"dry_run": "true"}
        if job_id is not None:
            params["job_id"] = job_id
        body = json.dumps(spec, ensure_ascii=True, allow_nan=True)
        headers = {"Content-Type": "application/json"}
        result: dict[str, Any] = self._json(
            "POST", "/jobs", content=body, headers=headers, params=params
        )
        return result

    # ---- sweeps ---------------------------------------------------------------------

    def submit_sweep(
        self, spec: dict[str, Any], idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Submit a sweep (SweepSpec); returns the Sweep (the earlier one on an
        Idempotency-Key replay).

        Raises:
            ApiError: 422 naming the bad field, or ``[body, trials, i, dotted.field]`` of
                a bad trial (nothing is stored then), or the key used for another sweep.
        """
        body = json.dumps(spec, ensure_ascii=True, allow_nan=True)
        headers = {"Content-Type": "application/json"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        result: dict[str, Any] = self._json("POST", "/sweeps", content=body, headers=headers)
        return result

    def get_sweep(self, sweep_id: int) -> dict[str, Any]:
        """The Sweep ``sweep_id`` (state, counts by outcome, best trial)."""
        result: dict[str, Any] = self._json("GET", f"/sweeps/{int(sweep_id)}")
        return result

    def list_sweeps(
        self, *, limit: int = DEFAULT_PAGE_ITEMS, cursor: int | None = None
    ) -> dict[str, Any]:
        """One page ``{"sweeps": [...], "next_cursor": int | None}``, newest first."""
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        result: dict[str, Any] = self._json("GET", "/sweeps", params=params)
        return result

    def sweep_trials(self, sweep_id: int) -> list[dict[str, Any]]:
        """The sweep's trials in position order (one row per trial key, newest job)."""
        result: list[dict[str, Any]] = self._json("GET", f"/sweeps/{int(sweep_id)}/trials")[
            "trials"
        ]
        return result

    def sweep_trials_page(
        self,
        sweep_id: int,
        *,
        sort: str = "position",
        order: str = "asc",
        limit: int | None = None,
        offset: int = 0,
        changed_since: str | None = None,
    ) -> dict[str, Any]:
        """A page of the sweep's trials table sorted on the server: ``{"trials": [...],
        "total", "offset", "next_offset", "changed_since"}``. ``sort``: a column
        (``position``, ``objective_value``, ``steps_done``, …, or ``overrides.<path>``),
        ``order`` ``asc``/``desc``, missing values last; ``changed_since``: the previous
        answer's, for only the trials that changed since (rows may repeat: dedupe by key).

        Raises:
            ApiError: 404 not your sweep; 422 naming a bad parameter.
        """
        params: dict[str, Any] = {"sort": sort, "order": order, "offset": offset}
        if limit is not None:
            params["limit"] = limit
        if changed_since is not None:
            params["changed_since"] = changed_since
        result: dict[str, Any] = self._json("GET", f"/sweeps/{int(sweep_id)}/trials", params=params)
        return result

    def cancel_sweep(self, sweep_id: int) -> dict[str, Any]:
        """Cancel the sweep's unfinished trials; returns the Sweep (409 if it had ended)."""
        result: dict[str, Any] = self._json("POST", f"/sweeps/{int(sweep_id)}/cancel")
        return result

    def retry_failed(self, sweep_id: int) -> dict[str, Any]:
        """Re-queue the failed trials (a new job each); the Sweep, ``added`` = how many."""
        result: dict[str, Any] = self._json("POST", f"/sweeps/{int(sweep_id)}/retry-failed")
        return result

    def extend_sweep(self, sweep_id: int, extension: dict[str, Any]) -> dict[str, Any]:
        """Add grid values / samples / seeds; the Sweep, ``added`` = new trials."""
        result: dict[str, Any] = self._json(
            "POST", f"/sweeps/{int(sweep_id)}/extend", json=extension
        )
        return result

    def get_job(self, job_id: int) -> dict[str, Any]:
        """The Job ``job_id``."""
        result: dict[str, Any] = self._json("GET", f"/jobs/{int(job_id)}")
        return result

    def list_jobs(
        self,
        *,
        state: str | None = None,
        limit: int = DEFAULT_PAGE_ITEMS,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """One page ``{"jobs": [...], "next_cursor": str | None}``, newest first."""
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        if cursor:
            params["cursor"] = cursor
        result: dict[str, Any] = self._json("GET", "/jobs", params=params)
        return result

    def cancel(self, job_id: int) -> dict[str, Any]:
        """Cancel ``job_id``; returns the Job. ApiError 409 when it already finished."""
        result: dict[str, Any] = self._json("POST", f"/jobs/{int(job_id)}/cancel")
        return result

    def events(self, job_id: int) -> list[dict[str, Any]]:
        """The job's state history, oldest first."""
        result: list[dict[str, Any]] = self._json("GET", f"/jobs/{int(job_id)}/events")["events"]
        return result

    def metrics(
        self,
        job_id: int,
        name: str = "loss",
        *,
        after_step: int = 0,
        limit: int = METRIC_PAGE_POINTS,
        max_points: int | None = None,
    ) -> dict[str, Any]:
        """``{"name", "points": [{step, epoch, value, time}], "next_after_step"}``."""
        params: dict[str, Any] = {"name": name, "after_step": after_step, "limit": limit}
        if max_points is not None:
            params["max_points"] = max_points
        result: dict[str, Any] = self._json("GET", f"/jobs/{int(job_id)}/metrics", params=params)
        return result

    def goodput(self, job_id: int) -> dict[str, Any]:
        """The job's lost-work ledger (``GET /jobs/{id}/goodput``): seconds per phase per
        attempt and in total, goodput, lost steps, the checkpoint interval estimate."""
        result: dict[str, Any] = self._json("GET", f"/jobs/{int(job_id)}/goodput")
        return result

    def metric_names(self, job_id: int) -> list[str]:
        """Names of the metrics the job reported."""
        result: list[str] = self._json("GET", f"/jobs/{int(job_id)}/metrics/names")["names"]
        return result

    def checkpoints(self, job_id: int) -> list[dict[str, Any]]:
        """The job's checkpoints, newest step first."""
        result: list[dict[str, Any]] = self._json("GET", f"/jobs/{int(job_id)}/checkpoints")[
            "checkpoints"
        ]
        return result

    def checkpoint_url(self, job_id: int, step: int) -> str:
        """Absolute download URL of the checkpoint at ``step``."""
        return f"{self.base_url}{API_PREFIX}/jobs/{int(job_id)}/checkpoints/{int(step)}/file"

    def download_checkpoint(
        self,
        job_id: int,
        step: int,
        dest: str | Path,
        *,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Path:
        """Stream the checkpoint at ``step`` into the file ``dest`` and verify its sha256
        (the server's ``X-Ddpq-Sha256``) before it takes that name: the bytes go to
        ``dest`` + ``.part`` first, never held whole in memory. ``on_progress(done_bytes,
        total_bytes)`` is called as blocks arrive.

        Returns:
            ``dest``.
        Raises:
            ApiError: the server refused (404: no such job or checkpoint).
            ChecksumMismatchError: the bytes that arrived are not the checkpoint's (nothing
                is left at ``dest``).
            ApiUnreachableError: no answer, or the connection broke mid-file.
        """
        dest = Path(dest)
        part = dest.with_name(dest.name + ".part")
        path = f"{API_PREFIX}/jobs/{int(job_id)}/checkpoints/{int(step)}/file"
        digest = hashlib.sha256()
        try:
            with self._http.stream("GET", path) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ApiError(response.status_code, *_detail_and_code(response))
                expected = response.headers.get(SHA256_HEADER, "")
                total = int(response.headers.get("content-length") or 0)
                done = 0
                with part.open("wb") as f:
                    for block in response.iter_bytes():
                        f.write(block)
                        digest.update(block)
                        done += len(block)
                        if on_progress is not None:
                            on_progress(done, total)
        except httpx.TransportError as exc:
            part.unlink(missing_ok=True)
            raise ApiUnreachableError(self.base_url, str(exc) or type(exc).__name__) from None
        if digest.hexdigest() != expected:
            part.unlink(missing_ok=True)
            raise ChecksumMismatchError(job_id, step, expected, digest.hexdigest())
        part.replace(dest)
        return dest

    def logs(
        self, job_id: int, *, rank: int = 0, attempt: int | None = None, offset: int = 0
    ) -> dict[str, Any]:
        """``{"text", "next_offset", "rank", "attempt", "eof"}`` from byte ``offset``."""
        params: dict[str, Any] = {"rank": rank, "offset": offset}
        if attempt is not None:
            params["attempt"] = attempt
        result: dict[str, Any] = self._json("GET", f"/jobs/{int(job_id)}/logs", params=params)
        return result

    # ---- service --------------------------------------------------------------------

    def workers(self) -> list[dict[str, Any]]:
        """Every worker with its heartbeat age and held jobs."""
        result: list[dict[str, Any]] = self._json("GET", "/workers")["workers"]
        return result

    def health(self) -> dict[str, Any]:
        """``/healthz``: ``{"status": "ok"}`` while the server runs."""
        result: dict[str, Any] = self._send("GET", "/healthz").json()
        return result

    def ready(self) -> dict[str, Any]:
        """``/readyz``; ApiError 503 (with the reason) when the database is not ready, or
        (under ``ddpq up``) its worker has not registered yet."""
        result: dict[str, Any] = self._send("GET", "/readyz").json()
        return result


def _detail_and_code(response: httpx.Response) -> tuple[Any, str | None]:
    """An error answer's ``detail`` and stable ``code`` (None when it has none: not JSON,
    or not from ddpq)."""
    try:
        body = response.json()
        code = body.get("code")
        return body.get("detail", response.text), code if isinstance(code, str) else None
    except (ValueError, AttributeError):
        return response.text or response.reason_phrase, None
