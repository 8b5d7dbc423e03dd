"""The attempt API's wire format: what a rank sends to ``/api/v1/attempts/self/…`` and gets
back. One module, imported by the API router (``service.api.attempts.routes``) and by the rank's
client (``worker.runtime.attempt_client``), so both sides read the same shapes.

Every call carries ``Authorization: Bearer <attempt token>``: a token the worker minted for
one (job, attempt) at launch (``service.store.attempts.tokens``). It is valid only while that
attempt is the job's current, active one: after a requeue, a terminal state or a cancel the
API answers 409 (``detail`` starts with ``ATTEMPT_SUPERSEDED``) and the rank stops as a fenced
rank does. It opens no user route: those answer 401 to it.

Metric batches carry columns (``MetricSeries``: one metric name, then its steps, values, times
and epochs as arrays, so a name is sent and checked once and each array is parsed in one go)
or, as older ranks send them, compact rows (``MetricRow``): ``[name, step, epoch, value,
time_s]`` (and an optional ``ranks``); both may be in one batch. A ``value`` is a number,
``null`` (NaN) or one of ``"Infinity"``/``"-Infinity"``, a time epoch seconds (UTC). The answer
counts what was
accepted; 429 with ``Retry-After`` (seconds) is back-pressure: send the same batch again later
(points are idempotent per (job, name, step) within an attempt, so a resend stores nothing
twice).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from service.core.limits import MAX_PATH_BYTES

# The routes, relative to the API prefix (/api/v1).
ATTEMPT_PREFIX = "/attempts/self"
SELF_PATH = ATTEMPT_PREFIX  # GET: who am I, am I current
METRICS_PATH = f"{ATTEMPT_PREFIX}/metrics"  # POST MetricBatch → MetricBatchAck
CHECKPOINTS_PATH = f"{ATTEMPT_PREFIX}/checkpoints"  # GET → CheckpointList; POST CheckpointRecord
CHECKPOINT_FAILURES_PATH = f"{ATTEMPT_PREFIX}/checkpoints/failures"  # POST CheckpointFailure
CHECKPOINT_DELETIONS_PATH = f"{ATTEMPT_PREFIX}/checkpoints/deletions"  # POST CheckpointDeletion

# Attempt tokens start with this, so the API can refuse them on user routes at a glance (and
# an operator can tell one from an API token in a log).
ATTEMPT_TOKEN_PREFIX = "ddpqa_"
# The first words of a 409's detail when the attempt is no longer the job's current one.
ATTEMPT_SUPERSEDED = "attempt superseded"

# One metric point on the wire: [name, step, epoch | null, value | null | "±Infinity", time_s],
# optionally followed by ``ranks`` (how the value was made: N ≥ 1 the mean over N ranks, 0 rank
# 0's own; ``service.core.metrics.points.MetricPoint.ranks``). Rows without it stay valid.
MetricRow = (
    tuple[str, int, int | None, float | str | None, float]
    | tuple[str, int, int | None, float | str | None, float, int | None]
)
MAX_BATCH_ROWS = 5000
# The keys of a job's progress snapshot that are stored; others in a batch are dropped.
PROGRESS_KEYS = ("step", "total_steps", "epoch", "samples_per_s", "eta_s")
# What the tables hold: steps as the dashboard's JavaScript numbers read them exactly
# (metric_points.MAX_STEP), epochs in a 32-bit INTEGER, sizes in a BIGINT. Bounds on the
# wire, so an out-of-range number is a 422, never a database error.
MAX_STEP = 2**53 - 1
MAX_EPOCH = 2**31 - 1
MAX_SIZE_BYTES = 2**63 - 1
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]


def _checked_file_name(name: str) -> str:
    # Imported here: service.core.wire.workspace imports this module at its top.
    from service.core.wire.workspace import path_problem

    problem = path_problem(name)
    if problem is not None:
        raise ValueError(f"file_name {name!r} is not a path inside the workspace: {problem}")
    return name


# A followed checkpoint's file, relative to the command job's workspace (``snapshot.pt``,
# ``ckpt/epoch-3.pt``): where it is put back before the next attempt. None: a checkpoint of
# ddpq's own (``jobs/<id>/checkpoints/step-<n>.pt``).
FileName = Annotated[
    str, Field(min_length=1, max_length=MAX_PATH_BYTES), AfterValidator(_checked_file_name)
]


def encode_value(value: float) -> float | str | None:
    """A float as JSON can carry it: NaN → None, ±inf → ``"Infinity"``/``"-Infinity"``."""
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def decode_value(value: float | str | None) -> float:
    """Inverse of ``encode_value``.

    Raises:
        ValueError: a string other than ``"Infinity"``/``"-Infinity"``.
    """
    if value is None:
        return math.nan
    if isinstance(value, str):
        if value == "Infinity":
            return math.inf
        if value == "-Infinity":
            return -math.inf
        raise ValueError(f"value {value!r} is not a number, null, 'Infinity' or '-Infinity'")
    return float(value)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AttemptSelf(_Wire):
    """``GET /attempts/self``: the attempt the token stands for, while it is current."""

    job_id: int
    attempt: int
    state: str
    # The id of the API's filesystem checkpoint store (the content of STORE_ID_FILE under
    # the API's artifact root), or None when checkpoints go to another store: a rank whose
    # artifact root holds the same id shares the API's filesystem; any other rank uploads.
    store_id: str | None = None
    init_from: InitFrom | None = None


class MetricSeries(_Wire):
    """Points of one metric in columns: point ``i`` is ``(name, steps[i], epochs[i],
    values[i], times_s[i])``. ``epochs`` may be left off (every epoch null); ``ranks`` is how
    every value of the series was made (``MetricRow``'s ``ranks``; None unknown). The
    arrays must be of one length (else 422); a point the API cannot store (a step out of
    range, a value that is not a number) is refused on its own, as a row is."""

    name: str
    steps: list[int] = Field(max_length=MAX_BATCH_ROWS)
    values: list[float | str | None] = Field(max_length=MAX_BATCH_ROWS)
    times_s: list[float] = Field(max_length=MAX_BATCH_ROWS)
    epochs: list[int | None] | None = Field(default=None, max_length=MAX_BATCH_ROWS)
    ranks: int | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> MetricSeries:
        n = len(self.steps)
        for field, column in (("values", self.values), ("times_s", self.times_s),
                              ("epochs", self.epochs)):  # fmt: skip
            if column is not None and len(column) != n:
                raise ValueError(f"{field} has {len(column)} items, steps {n}: one per step")
        return self


class MetricBatch(_Wire):
    """``POST /attempts/self/metrics``: points and (optionally) the job's progress snapshot.

    ``series``: points in columns, one ``MetricSeries`` per metric (what ranks send);
    ``points``: points as rows (``MetricRow``, what older ranks send). At most
    ``MAX_BATCH_ROWS`` points in all. ``progress`` has the keys of the job's ``progress``
    object (step, total_steps, epoch, samples_per_s, eta_s); it replaces the stored one.
    """

    points: list[MetricRow] = Field(default_factory=list, max_length=MAX_BATCH_ROWS)
    series: list[MetricSeries] = Field(default_factory=list, max_length=MAX_BATCH_ROWS)
    progress: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _at_most_max_rows(self) -> MetricBatch:
        n = len(self.points) + sum(len(s.steps) for s in self.series)
        if n > MAX_BATCH_ROWS:
            raise ValueError(f"{n} points in one batch: send at most {MAX_BATCH_ROWS}")
        return self


class MetricBatchAck(_Wire):
    """The answer to a batch: ``accepted`` rows passed the point checks and were written
    (``inserted`` of them were new: a resent batch inserts 0); ``refused`` says why each
    other row was dropped (a bad row never fails the batch)."""

    accepted: int
    inserted: int
    refused: list[str] = Field(default_factory=list)


class CheckpointRecord(_Wire):
    """``POST /attempts/self/checkpoints``: a checkpoint file rank 0 wrote and verified.

    ``path`` is where the file lies, relative to the artifact root (or absolute under it)."""

    step: Step
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    path: str = Field(min_length=1, max_length=MAX_PATH_BYTES)
    size_bytes: int = Field(ge=0, le=MAX_SIZE_BYTES)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    # The written file before rank 0 renames it to ``path`` (it records first, so a fenced-off
    # attempt replaces no file); the server verifies this one. None: the file is at ``path``.
    staged_path: str | None = Field(default=None, min_length=1, max_length=MAX_PATH_BYTES)
    # The workspace file this checkpoint is a version of (``FileName``); None for ddpq's own.
    file_name: FileName | None = None


class CheckpointFailure(_Wire):
    """``POST /attempts/self/checkpoints/failures``: a save that failed (a job event)."""

    step: Step
    reason: str = Field(min_length=1, max_length=2000)


class CheckpointDeletion(_Wire):
    """``POST /attempts/self/checkpoints/deletions``: checkpoint files rank 0 removed
    (rotation) or found damaged; their rows are marked deleted."""

    steps: list[Step] = Field(max_length=10_000)
    # True: found damaged at resume; False: recorded, but the file could not be put in place.
    damaged: bool = True


class CheckpointEntry(_Wire):
    """One committed checkpoint of the job (any attempt), for resume. ``file_name``: the
    workspace file a followed checkpoint is a version of (None for ddpq's own)."""

    step: int
    epoch: int
    attempt: int
    path: str
    size_bytes: int
    sha256: str
    file_name: FileName | None = None


class CheckpointList(_Wire):
    """``GET /attempts/self/checkpoints``: the job's checkpoints, newest step first."""

    checkpoints: list[CheckpointEntry]


# -- the attempt's timeline (resume point, start and checkpoint costs) ------------------------

TIMELINE_PATH = f"{ATTEMPT_PREFIX}/timeline"  # POST AttemptTimeline → 204
NOTES_PATH = f"{ATTEMPT_PREFIX}/notes"  # POST AttemptNote → 204


class AttemptNote(_Wire):
    """``POST /attempts/self/notes``: a decision of rank 0's the job's events must show; the
    server words the event (a rank sends no free text here).

    ``kind``: ``upload_fallback`` (``DDPQ_CHECKPOINT_TRANSPORT=shared``, but this rank's
    artifact root does not hold the API's store id: it uploads instead);
    ``nothing_to_train`` (an ``init_from`` ``full`` start restored ``step`` ≥ the job's
    ``total_steps``)."""

    kind: Literal["upload_fallback", "nothing_to_train"]
    step: Step | None = None
    total_steps: Step | None = None


MAX_SECONDS = 10.0**9


class AttemptTimeline(_Wire):
    """``POST /attempts/self/timeline``: what rank 0 measured about its attempt. Every field
    is optional; a given one replaces the stored one, except ``resume_step`` (the first one
    told stays: the attempt resumed once).

    ``resume_step``: the checkpoint step this attempt resumed from (0: from scratch). Told
    before the attempt's first metric batch: the API then moves earlier attempts' points of
    later steps aside (they are kept, as superseded), so the steps this attempt trains again
    are stored with its values. ``restore_s``: seconds spent finding, verifying and loading
    that checkpoint. ``training_started_at_s``: when the first step began (epoch seconds,
    UTC). ``checkpoint_stall_s``: seconds the training loop waited on checkpoint saves so
    far, over ``checkpoint_saves`` saves.
    """

    resume_step: Step | None = None
    restore_s: float | None = Field(default=None, ge=0, le=MAX_SECONDS)
    training_started_at_s: float | None = Field(default=None, ge=0, le=1e11)
    checkpoint_stall_s: float | None = Field(default=None, ge=0, le=MAX_SECONDS)
    checkpoint_saves: int | None = Field(default=None, ge=0, le=2**31 - 1)


# ---------------------------------------------------------------------------------------------
# Checkpoint uploads and downloads: how checkpoints cross hosts that share no filesystem.
#
# 1. POST UPLOADS_PATH UploadStart → 201 UploadStatus (200 with the same upload when
#    (attempt, step, sha256) was begun before: an interrupted upload resumes at
#    ``received_bytes``). Beginning a newer step's upload abandons older pending ones of the
#    same attempt (only the newest checkpoint needs to go).
# 2. PUT UPLOAD_CHUNK_PATH.format(upload_id=…)?offset=N, body the raw bytes
#    (application/octet-stream, at most ``chunk_bytes`` of UploadStatus), header
#    CHUNK_SHA256_HEADER = sha256 hex of the body → 200 UploadStatus. 409 UploadStatus-shaped
#    detail when ``offset`` is not ``received_bytes`` (seek there and go on); 422 when the body
#    does not match its sha256 or is too big (nothing kept: send it again). The body is
#    streamed, never held whole; the API's JSON body-size cap does not apply, this one does.
# 3. GET UPLOAD_PATH → UploadStatus (where to resume after an error).
# 4. POST UPLOAD_COMMIT_PATH → 201 CheckpointEntry once every byte arrived and the whole
#    file's sha256 matches UploadStart.sha256: only then is the checkpoint row written (the
#    row is the only "latest" pointer) and retention applied. 422 when the sha256 does not
#    match (the upload is discarded and a checkpoint-failure event written).
# 5. GET CHECKPOINT_FILE_PATH.format(step=…) streams a committed checkpoint of the job (for
#    resume on a host without the file); ``Range: bytes=N-`` resumes a download; the
#    SHA256_HEADER response header carries the sha256 to verify before use.
#    GET INIT_FILE_PATH streams the checkpoint named by the job's ``init_from``.
# All of them: attempt token only, 409 ``attempt superseded`` when not current.
# ---------------------------------------------------------------------------------------------
UPLOADS_PATH = f"{ATTEMPT_PREFIX}/uploads"
UPLOAD_PATH = f"{ATTEMPT_PREFIX}/uploads/{{upload_id}}"
UPLOAD_CHUNK_PATH = f"{ATTEMPT_PREFIX}/uploads/{{upload_id}}/chunks"
UPLOAD_COMMIT_PATH = f"{ATTEMPT_PREFIX}/uploads/{{upload_id}}/commit"
CHECKPOINT_FILE_PATH = f"{ATTEMPT_PREFIX}/checkpoints/{{step}}/file"
INIT_FILE_PATH = f"{ATTEMPT_PREFIX}/init-checkpoint/file"
CHUNK_SHA256_HEADER = "X-Ddpq-Chunk-Sha256"
SHA256_HEADER = "X-Ddpq-Sha256"
# The chunk size a client should use unless the server's UploadStatus says otherwise.
DEFAULT_CHUNK_BYTES = 16 * 2**20
# The smallest chunk cap a server may be configured with (Settings.checkpoint_chunk_bytes): a
# status telling less is not believed by the rank.
MIN_CHUNK_BYTES = 64 * 2**10
# A file the filesystem store writes at its root, holding a random id (see AttemptSelf).
STORE_ID_FILE = ".ddpq-store-id"


class UploadStart(_Wire):
    """``POST /attempts/self/uploads``: a checkpoint file rank 0 wrote locally and will send."""

    step: Step
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    # A checkpoint file is never empty (and an empty one would hold no chunk to store).
    size_bytes: int = Field(ge=1, le=MAX_SIZE_BYTES)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    # The workspace file this checkpoint is a version of (``FileName``); None for ddpq's own.
    # Kept with the upload and written to the checkpoint's row at the commit.
    file_name: FileName | None = None


class UploadStatus(_Wire):
    """Where an upload stands: ``received_bytes`` of ``size_bytes`` arrived (the next chunk
    goes at that offset); ``state`` is ``receiving`` | ``committed`` | ``abandoned``;
    ``chunk_bytes`` is the most one chunk may carry."""

    upload_id: int
    step: int
    size_bytes: int
    received_bytes: int
    chunk_bytes: int
    state: str


class InitFrom(_Wire):
    """What ``GET /attempts/self`` says about the job's ``init_from``, resolved at submit:
    the source job's committed checkpoint to start from, and what to load from it
    (``weights_only``: the model; ``full``: model, optimizer and step count)."""

    job_id: int
    step: int
    sha256: str
    size_bytes: int
    mode: str


AttemptSelf.model_rebuild()
