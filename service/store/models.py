"""SQLAlchemy 2.0 tables: jobs, job_events, workers, metrics (+ metrics_superseded and
metric_rollups), job_attempts, checkpoints (with checkpoint_uploads and checkpoint_chunks),
api_tokens, attempt_tokens, sweeps, sweep_trials, workspaces (with workspace_files,
workspace_uploads and workspace_chunks).

Constraint and index names follow ``NAMING_CONVENTION`` so Alembic migrations (and SQLite's
batch mode) can address them. Tables are storage only; the API has its own schemas.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# Primary keys of tables that grow with use: BIGINT on PostgreSQL (ids up to 2**63 - 1), but
# INTEGER on SQLite, where only an ``INTEGER PRIMARY KEY`` is the autoincrementing rowid.
BIGINT_PK = BigInteger().with_variant(Integer, "sqlite")


def utcnow() -> datetime:
    """The current time, tz-aware UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC and always read back tz-aware (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None or value.tzinfo is UTC:  # PostgreSQL sessions run in UTC (db.py)
            return value
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base with the project's constraint naming convention."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Job(Base):
    """A submitted training job: its frozen spec plus everything that changes as it runs."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    owner: Mapped[str] = mapped_column(String(100))
    state: Mapped[str] = mapped_column(String(16), default="queued")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    # Denormalised from spec so the claim query can filter without parsing JSON.
    launcher: Mapped[str] = mapped_column(String(16))
    gpus_per_node: Mapped[int] = mapped_column(Integer, default=0)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str | None] = mapped_column(
        String(128), ForeignKey("workers.id", ondelete="SET NULL"), nullable=True
    )
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    scheduler_job_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    latest_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # The sweep and trial this job runs (None for a plain job). No foreign key: adding one
    # would make SQLite rebuild the whole jobs table in the migration; sweeps are never
    # deleted, and sweep_trials.job_id points back with a real key.
    sweep_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    trial_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The spec's init_from, resolved at submit (a concrete step): the source job's checkpoint
    # that this job starts from, pinned against the source's retention while this job runs.
    init_from_job_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    init_from_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The metric points rate (DDPQ_METRIC_POINTS_PER_MINUTE): when the job's current
    # one-minute window began and the points it stored in it (service.store.metrics.points).
    metric_window_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    metric_window_points: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key"),
        Index("ix_jobs_init_from_job_id", "init_from_job_id"),
        Index("ix_jobs_owner_id", "owner", "id"),
        Index("ix_jobs_worker_id", "worker_id"),
        # A sweep's jobs that changed since a time: the trials table's delta poll.
        Index("ix_jobs_sweep_id_updated_at", "sweep_id", "updated_at"),
        # AUTOINCREMENT: SQLite never hands out an id again, even after the newest job is
        # deleted, so a new job never meets an old job's artifacts (jobs/<id>/…).
        {"sqlite_autoincrement": True},
    )


# The claim: queued jobs of a launcher, best priority first, then oldest. priority is DESC in
# the index so ORDER BY priority DESC, id is an index scan, not a sort of the whole queue.
Index("ix_jobs_claim", Job.state, Job.launcher, Job.priority.desc(), Job.id)
# A sweep's trials by state: the claim's "fewer than max_concurrent starting or running"
# count is a probe of this index, and so are the sweep's counts by state.
Index("ix_jobs_sweep_id_state", Job.sweep_id, Job.state)


class JobEvent(Base):
    """One row per state change (and other notable moments) of a job: its ``kind`` (a
    ``service.core.events.EventKind``) and ``data`` say what happened; ``reason`` is the same
    rendered for people. Written only through ``service.store.events``."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16))
    kind: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(JSON, server_default=text("'{}'"))
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (
        Index("ix_job_events_job_id_id", "job_id", "id"),
        # Readers look for one kind of a job's events (the newest scheduler pending reason,
        # a rank note already written, the claim to undo).
        Index("ix_job_events_job_id_kind", "job_id", "kind"),
    )


class Worker(Base):
    """A worker process: where it runs, what it can hold, when it last said it was alive."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    launcher: Mapped[str] = mapped_column(String(16))
    # {"slots": int, "gpus": [int, ...]}
    capacity: Mapped[dict[str, Any]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # The worker token it registered with (api_tokens.id): only that token acts for it.
    token_id: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Metric(Base):
    """One scalar a job reported at a step: the current point of (job_id, name, step).

    ``ranks`` says how the value was made: N ≥ 1 the mean over N ranks (a one-rank job's own
    value counts as its mean), 0 rank 0's own unaveraged value (e.g. the flush after a rank
    failure, a custom loop's plain float), NULL not recorded (a point an older rank sent).
    Points of an earlier attempt that a resumed attempt re-trains move to
    ``metrics_superseded`` (``service.store.metrics.history``).
    """

    __tablename__ = "metrics"

    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(100))
    step: Mapped[int] = mapped_column(BigInteger)
    attempt: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # NULL stands for NaN (SQLite cannot store NaN); ±inf are stored as is.
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ranks: Mapped[int | None] = mapped_column(SmallInteger, nullable=True)

    __table_args__ = (
        # On PostgreSQL the primary key's index carries every other column too, so a dashboard
        # poll (job, name, step > ?) is an index-only scan, and an insert maintains one b-tree
        # (a separate poll index beside the key doubled the index work of every ingested point).
        PrimaryKeyConstraint(
            "job_id",
            "name",
            "step",
            postgresql_include=["attempt", "epoch", "value", "time", "ranks"],
        ),
    )


class MetricSuperseded(Base):
    """A point an earlier attempt reported for a step that a later attempt trained again
    after resuming from an earlier checkpoint: kept, but no longer the job's curve. Same
    columns as ``metrics`` plus ``superseded_by`` (the attempt whose resume threw it away)."""

    __tablename__ = "metrics_superseded"

    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(100))
    step: Mapped[int] = mapped_column(BigInteger)
    attempt: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ranks: Mapped[int | None] = mapped_column(SmallInteger, nullable=True)
    superseded_by: Mapped[int] = mapped_column(Integer)

    __table_args__ = (PrimaryKeyConstraint("job_id", "name", "step", "attempt"),)


class MetricRollup(Base):
    """One step bucket of one metric at one resolution, kept at write time so a chart reads
    buckets instead of every point (``service.store.metrics.rollups``).

    ``level`` k: the bucket holds the current points with ``step >> k == bucket`` (2**k steps,
    k in ``rollups.LEVELS``). ``count`` points; the minimum and maximum as (step, value)
    (NULL values stand for NaN and rank after every number; ties go to the smaller step);
    the first and last point as (step, value). Maintained in the transaction that stores or
    supersedes the points.
    """

    __tablename__ = "metric_rollups"

    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(100))
    level: Mapped[int] = mapped_column(SmallInteger)
    bucket: Mapped[int] = mapped_column(BigInteger)
    count: Mapped[int] = mapped_column(BigInteger)
    min_step: Mapped[int] = mapped_column(BigInteger)
    min_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_step: Mapped[int] = mapped_column(BigInteger)
    max_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    first_step: Mapped[int] = mapped_column(BigInteger)
    first_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_step: Mapped[int] = mapped_column(BigInteger)
    last_value: Mapped[float | None] = mapped_column(Float, nullable=True)

    __table_args__ = (PrimaryKeyConstraint("job_id", "name", "level", "bucket"),)


class JobAttempt(Base):
    """What rank 0 told about one attempt of a job (``POST /attempts/self/timeline``): where
    it resumed from and what its start and its checkpoints cost. The goodput ledger
    (``service.store.attempts.goodput``) reads it with the job's events, metrics and checkpoints.

    ``resume_step``: the checkpoint step the attempt resumed from (0: from scratch; NULL: not
    told). ``restore_s``: seconds spent finding, verifying and loading that checkpoint.
    ``training_started_at``: when its first step began. ``checkpoint_stall_s``: seconds the
    training loop waited on checkpoint saves, over ``checkpoint_saves`` saves.
    """

    __tablename__ = "job_attempts"

    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    resume_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    restore_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    training_started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    checkpoint_stall_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    checkpoint_saves: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)

    __table_args__ = (PrimaryKeyConstraint("job_id", "attempt"),)


class Checkpoint(Base):
    """A committed checkpoint of a job, with its size and sha256: the only "latest" pointer
    (a row exists only once the whole file is in its store and verified).

    ``store`` names the backend holding the bytes (``filesystem`` | ``database``) and
    ``location`` where in it (a path relative to the artifact root; an upload id); ``path``
    is the file's name under an artifact root (``jobs/<id>/checkpoints/step-<step>.pt``, or
    where a rank sharing the API's filesystem recorded it). ``resumed_by_attempt`` is the last
    attempt that downloaded it to resume (retention keeps it for that attempt). ``file_name``
    is the workspace file a followed checkpoint is a version of (a command job's
    ``checkpoints.path``, put back there before the next attempt); None for ddpq's own."""

    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    epoch: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    store: Mapped[str] = mapped_column(
        String(16), default="filesystem", server_default="filesystem"
    )
    location: Mapped[str] = mapped_column(Text, default="", server_default="")
    committed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    resumed_by_attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)
    file_name: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (UniqueConstraint("job_id", "step"),)


class CheckpointUpload(Base):
    """A checkpoint file on its way from rank 0 to a store, chunk by chunk: ``received_bytes``
    of ``size_bytes`` have arrived. ``state``: ``receiving`` → ``committed`` (its checkpoints
    row written) or ``abandoned`` (superseded, corrupt, stale; its bytes discarded).
    ``file_name``: the checkpoint's (``Checkpoint.file_name``), written to its row at commit."""

    __tablename__ = "checkpoint_uploads"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    epoch: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    received_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    state: Mapped[str] = mapped_column(String(16), default="receiving")
    store: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    file_name: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (Index("ix_checkpoint_uploads_job_id_state", "job_id", "state"),)


class CheckpointChunk(Base):
    """One chunk of a checkpoint file kept by the database store: bytes ``offset_bytes`` to
    ``offset_bytes + len(data)`` of upload ``upload_id``'s file."""

    __tablename__ = "checkpoint_chunks"

    upload_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("checkpoint_uploads.id", ondelete="CASCADE")
    )
    offset_bytes: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)

    __table_args__ = (PrimaryKeyConstraint("upload_id", "offset_bytes"),)


class ApiToken(Base):
    """An API token, stored only as its sha256 hash: a user's (``kind`` "user": the user
    routes, as ``owner``) or a worker's (``kind`` "worker": only the worker routes; ``name``
    says which host or pool it is for)."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(100))
    kind: Mapped[str] = mapped_column(String(16), default="user", server_default="user")
    name: Mapped[str | None] = mapped_column(String(100), nullable=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class AttemptToken(Base):
    """A rank's token for one (job, attempt), stored only as its sha256 hash. It says which
    attempt a caller speaks for; whether that attempt may still write is the fence's call
    (``leases.fence_attempt``), so no row is ever revoked: a superseded attempt's tokens stop
    working by themselves, and they go with their job."""

    __tablename__ = "attempt_tokens"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (Index("ix_attempt_tokens_job_id", "job_id"),)


class Sweep(Base):
    """A sweep: its spec as submitted (``service.core.sweeps.spec.SweepSpec``), its resolved
    objective, and its state (running → succeeded | failed | cancelled)."""

    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    owner: Mapped[str] = mapped_column(String(100))
    state: Mapped[str] = mapped_column(String(16), default="running")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    objective: Mapped[dict[str, Any]] = mapped_column(JSON)
    # Copied from spec for the claim's predicate (None: no limit).
    max_concurrent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_failed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    stop_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # POST /sweeps's Idempotency-Key: a retried POST returns this sweep (per owner).
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)

    __table_args__ = (
        Index("ix_sweeps_owner_id", "owner", "id"),
        Index("ix_sweeps_state", "state"),
        UniqueConstraint("owner", "idempotency_key"),
    )


class SweepTrial(Base):
    """One trial of a sweep: its key (sha256 of its canonical overrides, unique in the
    sweep), overrides, newest job and how many jobs it has had (a retry is a new job), and
    its outcome when that is not the job's state (``stopped_early``). ``rungs`` holds the
    objective at each ASHA rung it reached: ``{"<rung>": value}``."""

    __tablename__ = "sweep_trials"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    sweep_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("sweeps.id", ondelete="CASCADE"))
    trial_key: Mapped[str] = mapped_column(String(64))
    position: Mapped[int] = mapped_column(Integer)
    overrides: Mapped[dict[str, Any]] = mapped_column(JSON)
    job_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("jobs.id", ondelete="SET NULL"), nullable=True
    )
    attempts: Mapped[int] = mapped_column(Integer, default=1)
    outcome: Mapped[str | None] = mapped_column(String(16), nullable=True)
    rungs: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    __table_args__ = (
        UniqueConstraint("sweep_id", "trial_key"),
        Index("ix_sweep_trials_job_id", "job_id"),
    )


class WorkspaceUpload(Base):
    """A workspace file on its way from a user to a store, chunk by chunk (the checkpoint
    upload's protocol, ``CheckpointUpload``): ``received_bytes`` of ``size_bytes`` arrived.
    ``state``: ``receiving`` → ``committed`` (its ``workspace_files`` row written; the row
    stays while the file lives: the database store keeps the bytes under this id) or
    ``abandoned`` (sha256 mismatch, stale; its bytes discarded). A table of its own, not
    ``checkpoint_uploads``: a workspace file has an owner, no job, step or attempt."""

    __tablename__ = "workspace_uploads"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(100))
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    received_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    state: Mapped[str] = mapped_column(String(16), default="receiving")
    store: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (
        Index("ix_workspace_uploads_owner_sha256", "owner", "sha256"),
        # Retention's abandoned and stale uploads.
        Index("ix_workspace_uploads_state_updated_at", "state", "updated_at"),
    )


class WorkspaceChunk(Base):
    """One chunk of a workspace file kept by the database store (as ``CheckpointChunk``, for
    ``workspace_uploads``: the two id sequences overlap, so each has its own table)."""

    __tablename__ = "workspace_chunks"

    upload_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("workspace_uploads.id", ondelete="CASCADE")
    )
    offset_bytes: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)

    __table_args__ = (PrimaryKeyConstraint("upload_id", "offset_bytes"),)


class WorkspaceFile(Base):
    """A workspace file an owner uploaded, stored once per ``(owner, sha256)``: ``store`` and
    ``location`` as for a checkpoint, ``upload_id`` the committed upload that brought it.
    ``last_used_at`` moves when a workspace names it (retention's clock)."""

    __tablename__ = "workspace_files"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(100))
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    store: Mapped[str] = mapped_column(String(16))
    location: Mapped[str] = mapped_column(Text)
    upload_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("workspace_uploads.id"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (
        UniqueConstraint("owner", "sha256"),
        Index("ix_workspace_files_last_used_at", "last_used_at"),
    )


class Workspace(Base):
    """A stored workspace: its ``manifest`` (``service.core.wire.workspace.Manifest`` as JSON)
    under its ``digest``, unique per owner. ``last_used_at`` moves when it is stored again or
    a rank reads it; retention deletes it once that is old and no unfinished job names it."""

    __tablename__ = "workspaces"

    id: Mapped[int] = mapped_column(BIGINT_PK, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(100))
    digest: Mapped[str] = mapped_column(String(64))
    manifest: Mapped[dict[str, Any]] = mapped_column(JSON)
    file_count: Mapped[int] = mapped_column(Integer)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (
        UniqueConstraint("owner", "digest"),
        Index("ix_workspaces_last_used_at", "last_used_at"),
    )
