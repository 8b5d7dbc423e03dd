"""Attempt use cases: one function per operation on an attempt (its token, its identity, its
timeline), each owning its transaction and returning plain values, never ORM rows.

The attempt API's operations run behind the attempt fence, checked inside their own
transaction (``fence.superseded_on_fence``: a superseded attempt is refused with 409
``attempt superseded: …``). A rank's metric batches are ``service.store.metrics.service``;
its checkpoints ``service.store.checkpoints.service``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from service.core.states import JobState
from service.store.attempts import tokens
from service.store.attempts.fence import superseded_on_fence
from service.store.attempts.timeline import record_attempt_timeline
from service.store.attempts.values import AttemptRef, TimelineUpdate
from service.store.checkpoints.events import note_fresh_start
from service.store.checkpoints.init_from import describe_init_from
from service.store.checkpoints.stores import CheckpointStores, shared_store_id
from service.store.db import Database
from service.store.workers.leases import check_attempt

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InitFromInfo:
    """The checkpoint a job starts from (its resolved ``init_from``): ``step`` of job
    ``job_id``, its ``sha256`` (hex) and ``size_bytes``, loaded as ``mode``
    (``weights_only`` | ``full``)."""

    job_id: int
    step: int
    sha256: str
    size_bytes: int
    mode: str


@dataclass(frozen=True, slots=True)
class AttemptInfo:
    """What a rank learns about its own attempt: the job's ``state`` now, the filesystem
    store's id (``store_id``: a rank whose artifact root holds it shares the API's
    filesystem; None: upload) and the job's ``init_from`` (None without one)."""

    job_id: int
    attempt: int
    state: JobState
    store_id: str | None
    init_from: InitFromInfo | None


def mint_token(db: Database, job_id: int, attempt: int) -> str:
    """A new token for ``attempt`` of job ``job_id`` (only its hash is stored; the worker
    hands it to the attempt's ranks).

    Raises:
        ConflictError: no job ``job_id`` (409).
    """
    with db.session() as session:
        return tokens.mint_attempt_token(session, job_id, attempt)


def find_attempt(db: Database, token: str) -> AttemptRef | None:
    """The attempt ``token`` was minted for, or None for an unknown or non-attempt token (an
    API token included). Says nothing about whether the attempt is still current."""
    with db.session(write=False) as session:
        return tokens.find_attempt(session, token)


def describe_attempt(
    db: Database, stores: CheckpointStores, ref: AttemptRef, *, upload_store: str
) -> AttemptInfo:
    """The token's attempt while it is current and active, with the filesystem store's id
    when uploads go to ``upload_store`` = ``filesystem`` (read, or written once, from the
    artifact root) and the job's resolved ``init_from``.

    Raises:
        StaleAttemptError: the job was requeued, cancelled or finished (409).
    """
    with superseded_on_fence(), db.session(write=False) as session:
        state = tokens.current_state(session, ref)
        init = describe_init_from(session, ref.job_id)
    return AttemptInfo(
        job_id=ref.job_id,
        attempt=ref.attempt,
        state=state,
        store_id=shared_store_id(stores, upload_store),
        init_from=InitFromInfo(**init) if init is not None else None,
    )


def record_timeline(db: Database, ref: AttemptRef, update: TimelineUpdate) -> int:
    """Store what rank 0 measured about its attempt. The first ``resume_step`` told moves
    earlier attempts' points of later steps aside as superseded; a ``resume_step`` of 0
    notes, when the job had checkpoints, why the attempt starts from scratch.

    Returns:
        How many points were superseded now.
    Raises:
        StaleAttemptError: the attempt is superseded (409, nothing stored).
    """
    with superseded_on_fence(), db.session() as session:
        moved = record_attempt_timeline(session, ref.job_id, ref.attempt, update)
        if update.resume_step == 0:  # say why, when the job had checkpoints
            note_fresh_start(session, check_attempt(session, ref.job_id, ref.attempt), ref.attempt)
    if moved:
        log.info("job %d attempt %d resumed from step %s: %d earlier points superseded",
                 ref.job_id, ref.attempt, update.resume_step, moved)  # fmt: skip
    return moved
