"""Settings: every ``DDPQ_*`` environment variable, in one place, read on demand."""

from __future__ import annotations

import fnmatch
import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.core.limits import MAX_PAGE_ITEMS
from service.core.owners.rank_users import (
    RANK_USER_SETTING,
    RANK_USERS_SETTING,
    RankUserMap,
    parse_rank_users,
)
from service.core.wire.attempt import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def local_url(host: str, port: int) -> str:
    """The URL this machine reaches a server bound to ``host:port`` at: a wildcard bind on
    the loopback of its own address family, an IPv6 address in brackets."""
    loopback = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{loopback}]:{port}" if ":" in loopback else f"http://{loopback}:{port}"


class Settings(BaseSettings):
    """Deployment settings, read from ``DDPQ_<NAME>`` environment variables.

    With nothing set, ddpq runs its embedded default: SQLite (WAL) at ``./.ddpq/ddpq.db``,
    artifacts under ``./.ddpq/artifacts``, the API on 127.0.0.1:8000.
    Nothing here opens a file or a connection; see ``service.store.db`` for that.
    """

    model_config = SettingsConfigDict(env_prefix="DDPQ_", extra="ignore")

    home: Path = Field(
        default=Path(".ddpq"), description="State directory of the embedded default."
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL (postgresql+psycopg://user@host/db). Default: SQLite in home.",
    )
    artifact_dir: Path | None = Field(
        default=None, description="Logs and checkpoints. Default: <home>/artifacts."
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    api_url: str | None = Field(
        default=None,
        description="Where the CLI, workers and their ranks reach the API (ranks report "
        "there). Default: http://<host>:<port>; a worker on another host must set it.",
    )
    worker_token: SecretStr | None = Field(
        default=None,
        description="A worker's token for the worker API (`ddpq token create --worker`): all "
        "a worker holds, with DDPQ_API_URL. A worker refuses to start with DDPQ_DATABASE_URL "
        "set: only API processes hold the database's credentials.",
    )
    allowed_entrypoints: list[str] = Field(
        default_factory=list,
        description='fnmatch patterns of user entrypoints "pkg.module:function" allowed to run.',
    )
    warm_ranks: bool = Field(
        default=True,
        description="Local worker: fork ranks from a warm fork server (worker.runtime.agent) "
        "instead of starting each as a fresh interpreter under plain torchrun.",
    )
    rank_user: str | None = Field(
        default=None,
        description="Unix user a root-run local worker starts every job's rank processes as "
        "(torchrun runs as that user; the attempt directory is theirs, the database file "
        "and the worker's own settings are not readable to them). Unset: the worker's user. "
        'Shorthand for DDPQ_RANK_USERS={"*": user}; set one of the two.',
    )
    # NoDecode: the text reaches ``_parse_rank_users``, whose errors name the setting
    # (pydantic-settings' own JSON error names only the field).
    rank_users: Annotated[dict[str, str] | None, NoDecode] = Field(
        default=None,
        description='JSON object owner → Unix user, e.g. {"alice": "alice", "bob": "ml-bob", '
        '"*": "ddpq-rank"} ("*": every other owner; optional). A root-run local worker starts '
        "each job's ranks as its owner's user, who alone owns the job's attempt directory, "
        "workspace, logs and checkpoints. With auth on and users' code allowed, the API "
        "refuses (422) a job of an owner it does not cover. Not applied on Slurm.",
    )
    rank_log_max_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=64 * 1024,
        description="Local worker: bytes each rank's log (and torchrun's launcher.log) may "
        "hold per attempt. Beyond it the log keeps its first half and its newest bytes with a "
        "'… N MB cut …' line between them; the ranks' writes are never stalled.",
    )
    rank_nproc_max: int | None = Field(
        default=4096,
        ge=16,
        description="Local worker: RLIMIT_NPROC of torchrun and every rank (processes and "
        "threads of the ranks' Unix user on this host, all its jobs together; root is not "
        "bound by it). Unset: inherited from the worker.",
    )
    rank_nofile_max: int | None = Field(
        default=4096,
        ge=64,
        description="Local worker: RLIMIT_NOFILE (open files per process) of torchrun and "
        "every rank. Unset: inherited from the worker.",
    )
    job_pids_max: int | None = Field(
        default=4096,
        ge=16,
        description="Local worker on a cgroup v2 host: pids.max of each attempt's cgroup "
        "(processes and threads of the job). Unset, like DDPQ_JOB_MEMORY_MAX_BYTES unset: no "
        "pids cap.",
    )
    job_memory_max_bytes: int | None = Field(
        default=None,
        ge=64 * 1024 * 1024,
        description="Local worker on a cgroup v2 host: memory.max of each attempt's cgroup, "
        "bytes (the kernel's OOM killer ends the job, not the host). Unset: no memory cap.",
    )
    slurm_enabled: bool = Field(
        default=False, description="Whether this deployment accepts launcher 'slurm' jobs."
    )
    slurm_partition: str | None = Field(
        default=None,
        description="Partition for Slurm jobs whose spec names none (else Slurm's default).",
    )
    slurm_signal_delay_s: int = Field(
        default=60,
        ge=1,
        description="Seconds before a Slurm job's time limit that its ranks get USR1 "
        "(checkpoint and stop).",
    )
    slurm_python: str | None = Field(
        default=None,
        description="Interpreter the ranks run on the Slurm nodes (same path on every node). "
        "Default: the worker's own (sys.executable).",
    )
    # Caps on what one job may ask for (HTTP 422 beyond them).
    max_nnodes: int = Field(default=64, ge=1)
    max_nproc_per_node: int = Field(default=64, ge=1)
    max_gpus_per_node: int = Field(default=16, ge=0)
    max_timeout_min: int = Field(default=7 * 24 * 60, ge=1)
    max_cpus_per_task: int = Field(default=256, ge=1)
    max_mem_gb: float = Field(default=4096, gt=0, allow_inf_nan=False)
    max_body_bytes: int = Field(default=1_000_000, ge=1024, description="Request body cap (bytes).")
    max_list_limit: int = Field(default=MAX_PAGE_ITEMS, ge=1)
    max_metric_points: int = Field(default=10_000, ge=2, description="Cap on limit/max_points.")
    # Worker liveness.
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    lease_s: float = Field(
        default=45.0,
        gt=0,
        description="A job's lease (seconds), renewed by each heartbeat: a lost worker's jobs "
        "are requeued once it lapses. A worker cut off from the API stops a job's ranks ~20 s "
        "before its lease could lapse (cancel grace, a call's timeout, a tick, a margin), so "
        "keep it ≥ 40 s.",
    )
    worker_retention_s: float = Field(
        default=7 * 24 * 3600.0,
        gt=0,
        description="Seconds a stopped worker's row is kept (default 7 days): the API's reaper "
        "deletes rows whose stopped_at is older, never a live worker or one that holds a job.",
    )
    expect_worker: str | None = Field(
        default=None,
        description="Launcher of a worker this deployment starts itself (`ddpq up` sets "
        "'local'): /readyz answers 503 until one is registered and live, and a submit does not "
        "warn that none is registered while it starts.",
    )
    default_owner: str = Field(default="local", min_length=1, max_length=100)
    token: SecretStr | None = Field(
        default=None, description="API token the CLI and DdpqClient send (Authorization: Bearer)."
    )
    auth: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Require API tokens: 'on', 'off', or 'auto' (on unless `host` is loopback).",
    )
    user_code: Literal["auto", "allow", "deny"] = Field(
        default="auto",
        description="Whether users may submit command jobs (their own scripts, shipped as a "
        "workspace): 'allow', 'deny', or 'auto' (allow with auth off, deny with auth on until "
        "the operator allows it; then the ranks must run as DDPQ_RANK_USER).",
    )
    submissions_per_minute: int = Field(
        default=60,
        ge=1,
        description="Jobs one owner may submit in any 60 s (HTTP 429 beyond); with auth on only.",
    )
    attempt_ingest_concurrency: int = Field(
        default=4,
        ge=1,
        description="Metric batches from ranks (POST /api/v1/attempts/self/metrics) one API "
        "process writes at once; more answer 429 with Retry-After (the rank sends again).",
    )

    checkpoint_transport: Literal["auto", "shared", "upload"] = Field(
        default="auto",
        description="How rank 0's checkpoints reach the API: 'shared' (the API reads the file "
        "on a filesystem both see), 'upload' (streamed through the attempt API), or 'auto' "
        "(shared when the rank's artifact dir holds the API's store id, else upload).",
    )
    # Checkpoints (service.store.checkpoints.backends.base): where uploaded checkpoint files go.
    checkpoint_store: Literal["filesystem", "database"] = Field(
        default="filesystem",
        description="Where the API keeps checkpoints that ranks upload: 'filesystem' (the "
        "artifact directory) or 'database' (chunked rows; small models and CI).",
    )
    checkpoint_chunk_bytes: int = Field(
        default=DEFAULT_CHUNK_BYTES,
        ge=MIN_CHUNK_BYTES,
        le=256 * 2**20,
        description="Most bytes one uploaded checkpoint chunk may carry (a chunk PUT has this "
        "cap instead of DDPQ_MAX_BODY_BYTES); the database store keeps one row per chunk.",
    )
    checkpoint_db_max_bytes: int = Field(
        default=2 * 2**30,
        ge=1,
        description="Largest checkpoint file the database store accepts (bytes); a bigger "
        "upload is refused at its start (HTTP 413).",
    )
    checkpoint_upload_stale_s: float = Field(
        default=1800.0,
        gt=0,
        description="Seconds an upload may go without a chunk before the API's reaper "
        "abandons it and discards its partial file.",
    )
    checkpoint_corrupt_chunk_n: int | None = Field(
        default=None,
        ge=1,
        description="Tests only: flip one byte of the Nth checkpoint chunk this API process "
        "receives (1-based), as a network fault would; the chunk is then refused.",
    )

    # Workspaces (service.core.wire.workspace): users' working directories shipped with
    # their command jobs. The CLI checks the limits before it sends a byte; the API again.
    workspace_max_bytes: int = Field(
        default=100 * 2**20,
        ge=1,
        description="Most bytes one workspace may hold, all its files together (default "
        "100 MiB); a bigger one is refused, naming its largest files.",
    )
    workspace_max_files: int = Field(
        default=20_000,
        ge=1,
        description="Most files one workspace may hold (default 20,000).",
    )
    workspace_retention_days: float = Field(
        default=30,
        gt=0,
        description="Days a workspace is kept once no unfinished job references it (one "
        "that an unfinished job references is never deleted).",
    )

    # Quotas (service.store.quotas): what one job or owner may store or send, checked where
    # the bytes arrive; each hit is a ``quota_exceeded`` job event naming its setting.
    checkpoint_job_max_bytes: int = Field(
        default=50 * 2**30,
        ge=1,
        description="Most checkpoint bytes one job may hold in the API's store (default 50 "
        "GiB): its live checkpoints plus uploads under way or abandoned and not yet reaped. "
        "A save that would pass it is refused at its start (HTTP 413, a failed save); "
        "retention's deletions free room, nothing else is deleted to make it.",
    )
    checkpoint_owner_max_bytes: int = Field(
        default=500 * 2**30,
        ge=1,
        description="Most checkpoint bytes all of one owner's jobs may hold together (default "
        "500 GiB), counted as for DDPQ_CHECKPOINT_JOB_MAX_BYTES.",
    )
    workspace_owner_max_bytes: int = Field(
        default=10 * 2**30,
        ge=1,
        description="Most workspace file bytes one owner may store (default 10 GiB): kept "
        "files plus uploads under way or abandoned and not yet reaped (HTTP 413 beyond).",
    )
    metric_names_per_job: int = Field(
        default=10_000,
        ge=1,
        description="Most distinct metric names one job may report (default 10,000): a batch "
        "that brings more is refused whole (HTTP 422).",
    )
    metric_points_per_minute: int = Field(
        default=600_000,
        ge=1,
        description="Most metric points one job may store in a minute (default 600,000, "
        "10,000/s): beyond, a batch is refused whole with HTTP 429 and Retry-After.",
    )
    uploads_in_flight_per_owner: int = Field(
        default=64,
        ge=1,
        description="Most checkpoint and workspace file uploads one owner may have begun and "
        "not finished (default 64): beyond, HTTP 429 with Retry-After.",
    )

    @field_validator("rank_users", mode="before")
    @classmethod
    def _parse_rank_users(cls, value: Any) -> dict[str, str] | None:
        return parse_rank_users(value)

    @model_validator(mode="after")
    def _one_rank_user_setting(self) -> Self:
        if self.rank_user and self.rank_users:
            raise ValueError(
                f"{RANK_USER_SETTING} and {RANK_USERS_SETTING} are both set: keep "
                f'{RANK_USERS_SETTING} and add {{"*": "{self.rank_user}"}} to it for every '
                f"other owner, or unset {RANK_USERS_SETTING}"
            )
        return self

    @property
    def rank_user_map(self) -> RankUserMap:
        """Owner → Unix user of the ranks (``service.core.owners.rank_users``), from
        ``rank_users`` or its shorthand ``rank_user``; empty when neither is set."""
        return RankUserMap.of(self.rank_users, self.rank_user)

    @property
    def rank_users_required(self) -> bool:
        """Whether every owner must have a rank user: auth on (several people) and users'
        own code allowed; the API then refuses jobs of an owner the map does not cover."""
        return self.auth_enabled and self.user_code_allowed

    @property
    def resolved_database_url(self) -> str:
        """The database URL, defaulting to the embedded SQLite file under ``home``."""
        if self.database_url:
            return normalise_database_url(self.database_url)
        return f"sqlite:///{(self.home / 'ddpq.db').resolve()}"

    @property
    def resolved_artifact_dir(self) -> Path:
        """Absolute artifact root (logs, checkpoints)."""
        return (self.artifact_dir or self.home / "artifacts").resolve()

    @property
    def resolved_api_url(self) -> str:
        """Base URL of the API (no trailing slash), as clients should reach it."""
        if self.api_url:
            return self.api_url.rstrip("/")
        return local_url(self.host, self.port)

    @property
    def auth_enabled(self) -> bool:
        """Whether the API demands a bearer token: ``auth`` "on", or "auto" with a bind
        ``host`` that is not loopback (e.g. ``ddpq serve --host 0.0.0.0``). An app started
        some other way (plain uvicorn) knows its bind address only through DDPQ_HOST."""
        if self.auth != "auto":
            return self.auth == "on"
        return not is_loopback_host(self.host)

    @property
    def user_code_allowed(self) -> bool:
        """Whether command jobs are accepted: ``user_code`` "allow", or "auto" with auth off
        (the embedded default: one user on loopback, running their own code)."""
        if self.user_code == "auto":
            return not self.auth_enabled
        return self.user_code == "allow"

    def entrypoint_allowed(self, entrypoint: str) -> bool:
        """True when ``entrypoint`` matches one of ``allowed_entrypoints`` (fnmatch patterns)."""
        return any(fnmatch.fnmatchcase(entrypoint, pat) for pat in self.allowed_entrypoints)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); False for anything
    else, wildcard binds (0.0.0.0, ::) and host names included."""
    if host.strip().lower() in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings from the environment (cached; tests build their own)."""
    return Settings()


def normalise_database_url(url: str) -> str:
    """``postgres://`` and ``postgresql://`` (no driver, as Heroku-style and libpq URLs are
    written) become ``postgresql+psycopg://``, the driver ddpq ships (psycopg 3); any other
    URL is returned as given."""
    for scheme in ("postgres://", "postgresql://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme) :]
    return url
