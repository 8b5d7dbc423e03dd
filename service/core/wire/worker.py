"""The worker API's wire format: what a worker sends to ``/api/v1/workers/self/…`` and gets
back. One module, imported by the API's routes (``service.api.workers.self_routes``) and by
the worker's client (``worker.api_client``), so both sides read the same shapes.

Every call carries ``Authorization: Bearer <worker token>`` (``ddpqw_…``, from ``ddpq token
create --worker``) and the calling worker's id in the ``Ddpq-Worker-Id`` header. A worker
registers its id once with its token; from then on only that token acts for that id, and
only on the jobs that worker holds (``jobs.worker_id``). A worker token opens no other
route: user routes and the attempt routes answer 401 to it, and a user or attempt token gets
401 here. A revoked token is refused from its next claim or heartbeat (a waiting claim
included; both check the token in their own transaction), and from every call at most
``REVOKED_TOKEN_GRACE_S`` seconds after the revocation (an API process remembers a token it
verified that long): its worker claims nothing more, stops its ranks at once and ends
(``worker.loop``), and its leases lapse, so its jobs are requeued.

Shapes are ``service.core.holds``'s values (stdlib dataclasses, which pydantic validates and
serialises field by field): the same ``Transition``, ``ClaimedJob``, ``HeldJob``,
``AdoptedJob`` and ``SchedulerHandle`` the loop plans with.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.core.events import NOTE_KINDS, EventKind, check_data
from service.core.holds import AdoptedJob, ClaimedJob, HeldJob, SchedulerHandle, Transition
from service.core.states import JobState

# The routes, relative to the API prefix (/api/v1).
WORKER_PREFIX = "/workers/self"
REGISTER_PATH = WORKER_PREFIX  # PUT RegisterIn → WorkerAck (insert or revive the row)
HEARTBEAT_PATH = f"{WORKER_PREFIX}/heartbeat"  # POST → HeartbeatOut (renew leases)
STOP_PATH = f"{WORKER_PREFIX}/stop"  # POST → WorkerAck (a clean shutdown)
CLAIM_PATH = f"{WORKER_PREFIX}/claims"  # POST ClaimIn → ClaimOut (a long poll)
TRANSITIONS_PATH = f"{WORKER_PREFIX}/transitions"  # POST TransitionIn → TransitionOut
HANDLES_PATH = f"{WORKER_PREFIX}/handles"  # POST HandlesIn → WorkerAck
NOTES_PATH = f"{WORKER_PREFIX}/notes"  # POST NoteIn → NoteOut
PENDING_PATH = f"{WORKER_PREFIX}/pending-reasons"  # POST PendingIn → NoteOut
ADOPTIONS_PATH = f"{WORKER_PREFIX}/adoptions"  # POST → AdoptOut (Slurm's detached jobs)
ADOPTER_PATH = f"{WORKER_PREFIX}/adopters"  # POST AdopterIn → AdopterOut

# Worker tokens start with this, so the API refuses them on user and attempt routes at a
# glance (and an operator tells one from a user's token in a log).
WORKER_TOKEN_PREFIX = "ddpqw_"
WORKER_ID_HEADER = "Ddpq-Worker-Id"
# The longest a claim may wait for a job (seconds): a worker polls again after it anyway,
# and a proxy in between must not cut the request first.
MAX_CLAIM_WAIT_S = 30.0
# How long after its revocation a worker token may still be taken by the routes that write
# no claim and renew no lease (seconds): an API process remembers a verified token that long
# instead of reading it before every request of every worker.
REVOKED_TOKEN_GRACE_S = 5.0
MAX_BATCH = 1000
# A worker id: what ``worker.main.make_worker_id`` makes (``<host>-<pid>-<hex>``).
WorkerId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@+-]+$")]
JobId = Annotated[int, Field(ge=1, le=2**63 - 1)]
# Bounds of a worker's registered capacity: jobs held at once, a GPU's device index, cores.
MAX_SLOTS = 1024
MAX_GPU_INDEX = 1023
MAX_CPUS = 1_000_000
Attempt = Annotated[int, Field(ge=1, le=2**31 - 1)]
MAX_JOB_ID = 2**63 - 1
MAX_ATTEMPT = 2**31 - 1
# The longest scheduler job id the jobs table holds (``jobs.scheduler_job_id``).
MAX_SCHEDULER_JOB_ID_CHARS = 64


def _check_job_ref(job_id: int, attempt: int | None = None) -> None:
    """A job id and attempt as the database holds them (the holds' dataclasses do not bound
    them: a larger one would fail in the driver, not as 422)."""
    if not 1 <= job_id <= MAX_JOB_ID:
        raise ValueError(f"job_id {job_id} out of range (1 to {MAX_JOB_ID})")
    if attempt is not None and not 1 <= attempt <= MAX_ATTEMPT:
        raise ValueError(f"attempt {attempt} out of range (1 to {MAX_ATTEMPT})")


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Capacity(_In):
    """What a worker can hold: ``slots`` jobs at once, the host's ``gpus`` (device indices) it
    hands out, the ``cpus`` (cores) its ranks share; the queue explanation and ``ddpq
    workers`` read them."""

    slots: int = Field(default=1, ge=1, le=MAX_SLOTS)
    gpus: list[Annotated[int, Field(ge=0, le=MAX_GPU_INDEX)]] = Field(
        default_factory=list, max_length=MAX_GPU_INDEX + 1
    )
    cpus: int | None = Field(default=None, ge=1, le=MAX_CPUS)


class RegisterIn(_In):
    """A worker's registration: where it runs and what it can hold. ``launcher`` is the
    launcher it runs jobs with (``service.core.launchers``)."""

    host: str = Field(min_length=1, max_length=255)
    pid: int = Field(ge=0, le=2**31 - 1)
    launcher: str = Field(min_length=1, max_length=16)
    capacity: Capacity


class WorkerAck(BaseModel):
    """The worker a call was made for, and its lease length (seconds) as the API grants it:
    a worker must stop its jobs' ranks before a lease it could not renew runs out."""

    worker_id: str
    lease_s: float


class HeartbeatOut(BaseModel):
    """The jobs the API says this worker holds, their leases now renewed for ``lease_s``
    seconds; a cancel request of a held job arrives here (``cancel_requested``)."""

    jobs: list[HeldJob]
    lease_s: float


class ClaimIn(_In):
    """A claim: jobs needing at most ``max_gpus_per_node`` GPUs per node each; up to
    ``limit`` trials of one sweep in one batch when ``batch`` (an array-starting launcher),
    else up to ``limit`` jobs, the best first (a worker with that many free slots: one
    request instead of one per job). With nothing claimable the API waits up to ``wait_s``
    seconds for a job to become claimable (a long poll) before answering with no job; it
    answers with what it found at once, never waiting for ``limit`` jobs."""

    max_gpus_per_node: int = Field(ge=0, le=1024)
    batch: bool = False
    limit: int = Field(default=1, ge=1, le=MAX_BATCH)
    wait_s: float = Field(default=0.0, ge=0.0, le=MAX_CLAIM_WAIT_S)


class ClaimOut(BaseModel):
    """What was claimed (now ``starting``, leased to this worker), best first; empty when
    nothing became claimable within the wait. Each ``ClaimedJob`` carries its spec and the
    attempt token for its ranks. ``sweep_id`` and ``max_concurrent``: a batch's sweep and its
    limit (None: a plain job, or no limit)."""

    jobs: list[ClaimedJob]
    sweep_id: int | None = None
    max_concurrent: int | None = None


class TransitionIn(_In):
    """A state change of a job this worker holds, applied as one compare-and-set with its
    event. ``error``: the job's error text; ``values``: side columns (only ``restarts``)."""

    transition: Transition
    error: str | None = Field(default=None, max_length=20_000)
    values: dict[Literal["restarts"], Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(
        default_factory=dict
    )

    @model_validator(mode="after")
    def _a_writable_transition(self) -> TransitionIn:
        # The event's data is checked against its kind's wording here, so a bad one is 422
        # before anything is written (not a failure while the event row is rendered).
        t = self.transition
        _check_job_ref(t.job_id)
        if t.kind is not None:
            check_data(t.kind, t.data)
        return self


class TransitionOut(BaseModel):
    """The state the transition produced (a requeue of a job flagged for cancel ends
    ``cancelled``)."""

    state: JobState


class HandlesIn(_In):
    """Detached launchers' handles (Slurm job ids) of jobs this worker holds, stored as their
    ``scheduler_job_id`` (each fenced on its attempt)."""

    handles: list[SchedulerHandle] = Field(max_length=MAX_BATCH)

    @model_validator(mode="after")
    def _storable(self) -> HandlesIn:
        for h in self.handles:
            _check_job_ref(h.job_id, h.attempt)
            if not 1 <= len(h.scheduler_job_id) <= MAX_SCHEDULER_JOB_ID_CHARS:
                raise ValueError(f"scheduler_job_id: 1 to {MAX_SCHEDULER_JOB_ID_CHARS} characters")
        return self


class NoteIn(_In):
    """A note of ``kind`` with ``data`` (``service.core.events``) for ``attempt`` of a job
    this worker holds; no state change."""

    job_id: JobId
    attempt: Attempt
    kind: EventKind
    data: dict[str, Any] = Field(default_factory=dict)

    @field_validator("kind")
    @classmethod
    def _a_note(cls, kind: EventKind) -> EventKind:
        if kind not in NOTE_KINDS:
            raise ValueError(f"{kind.value} is not a note (a state change is a transition)")
        return kind

    @model_validator(mode="after")
    def _worded_data(self) -> NoteIn:
        check_data(self.kind, self.data)
        return self


class PendingIn(_In):
    """The batch scheduler's pending reason ``code`` (in plain ``words``) for ``attempt`` of
    a job this worker holds."""

    job_id: JobId
    attempt: Attempt
    code: str = Field(min_length=1, max_length=200)
    words: str = Field(max_length=2_000)


class NoteOut(BaseModel):
    """Whether the note was written (False: the attempt moved on meanwhile, or the note was
    the newest one already)."""

    written: bool


class AdoptOut(BaseModel):
    """The detached jobs of lost or stopped workers of this worker's launcher that it now
    holds; follow each by its ``scheduler_job_id``."""

    jobs: list[AdoptedJob]


class AdopterIn(_In):
    """Which worker, if another, adopted ``attempt`` of a job this worker held."""

    job_id: JobId
    attempt: Attempt


class AdopterOut(BaseModel):
    """The other worker that adopted the attempt and still holds it (None: none did)."""

    worker_id: str | None
