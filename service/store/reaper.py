"""The API's reaper: lost workers' jobs are requeued even when no worker is running,
orphaned checkpoint uploads are cleaned (``checkpoint_uploads.orphaned_uploads``), and
workspaces past their retention go with the files nothing names any more
(``workspaces.service.reap_workspaces``).

Workers reap on every tick too (``worker.loop``); the API runs the same
``workers.service.requeue_expired_jobs`` every ``heartbeat_interval_s`` seconds so that a job
whose only worker died goes back to ``queued`` (and ``ddpq show`` says so) without waiting for
another worker to start. Both call the same compare-and-set, so running several reapers is safe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from starlette.concurrency import run_in_threadpool

from service.core.config import Settings
from service.core.errors import DatabaseUnavailableError
from service.core.holds import Transition
from service.store.checkpoints.backends.base import CheckpointStore
from service.store.checkpoints.uploads import orphaned_uploads
from service.store.db import Database
from service.store.sweeps import service as sweeps
from service.store.workers import service as workers
from service.store.workspaces import service as workspaces

log = logging.getLogger(__name__)

# Settings.worker_retention_s's default (7 days), for callers that pass no setting.
DEFAULT_WORKER_RETENTION_S: float = Settings.model_fields["worker_retention_s"].default
DEFAULT_UPLOAD_STALE_S: float = Settings.model_fields["checkpoint_upload_stale_s"].default
DEFAULT_WORKSPACE_RETENTION_DAYS: float = Settings.model_fields["workspace_retention_days"].default


def reap_once(
    db: Database,
    *,
    worker_retention_s: float = DEFAULT_WORKER_RETENTION_S,
    checkpoint_stores: Mapping[str, CheckpointStore] | None = None,
    upload_stale_s: float = DEFAULT_UPLOAD_STALE_S,
    workspace_stores: Mapping[str, CheckpointStore] | None = None,
    workspace_retention_days: float = DEFAULT_WORKSPACE_RETENTION_DAYS,
) -> list[Transition]:
    """Requeue (or cancel, if flagged) the jobs whose lease expired; the transitions made.
    Then delete the rows of workers stopped more than ``worker_retention_s`` seconds ago
    (``workers.service.prune_stopped_workers``), in a transaction of its own so a failed
    prune never undoes a requeue. Then running sweeps move on
    (``sweeps.service.advance_sweeps``: max_failed, ASHA early stopping, end states), in a
    transaction of their own too. With
    ``checkpoint_stores``, abandon the uploads nobody will finish (superseded attempt,
    finished job, no chunk for ``upload_stale_s`` seconds) and drop their partial bytes from
    the stores. With ``workspace_stores``, apply workspace retention
    (``workspace_retention_days``; uploads without a chunk for ``upload_stale_s`` go too)."""
    reaped = workers.requeue_expired_jobs(db)
    pruned = workers.prune_stopped_workers(db, retention_s=worker_retention_s)
    if pruned:
        log.info("reaper: deleted %d stopped worker row(s): %s", len(pruned), ", ".join(pruned))
    for line in sweeps.advance_sweeps(db):
        log.info("reaper: %s", line)
    if checkpoint_stores is not None:
        reap_uploads(db, checkpoint_stores, stale_s=upload_stale_s)
    if workspace_stores is not None:
        gone = workspaces.reap_workspaces(
            db,
            workspace_stores,
            retention_days=workspace_retention_days,
            upload_stale_s=upload_stale_s,
        )
        if gone.workspaces or gone.files or gone.uploads:
            log.info(
                "reaper: deleted %d workspace(s), %d workspace file(s), %d upload(s)",
                gone.workspaces, gone.files, gone.uploads,
            )  # fmt: skip
    return reaped


def reap_uploads(db: Database, stores: Mapping[str, CheckpointStore], *, stale_s: float) -> int:
    """Abandon and clean orphaned checkpoint uploads; how many partials were dropped."""
    with db.session() as session:
        discards = orphaned_uploads(session, stale_s=stale_s)
    for d in discards:
        store = stores.get(d.store)
        if store is not None:
            store.discard(d.key)
    if discards:
        log.info("reaper: dropped %d abandoned checkpoint upload(s)", len(discards))
    return len(discards)


async def reap_forever(
    db: Database,
    interval_s: float,
    *,
    worker_retention_s: float = DEFAULT_WORKER_RETENTION_S,
    checkpoint_stores: Mapping[str, CheckpointStore] | None = None,
    upload_stale_s: float = DEFAULT_UPLOAD_STALE_S,
    workspace_stores: Mapping[str, CheckpointStore] | None = None,
    workspace_retention_days: float = DEFAULT_WORKSPACE_RETENTION_DAYS,
) -> None:
    """``reap_once`` every ``interval_s`` seconds until cancelled; a database outage is
    logged and retried at the next interval, never raised."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            reaped = await run_in_threadpool(
                lambda: reap_once(
                    db,
                    worker_retention_s=worker_retention_s,
                    checkpoint_stores=checkpoint_stores,
                    upload_stale_s=upload_stale_s,
                    workspace_stores=workspace_stores,
                    workspace_retention_days=workspace_retention_days,
                )
            )
        except DatabaseUnavailableError as exc:
            log.warning("reaper: database unavailable (%s); retrying in %.1f s", exc, interval_s)
            continue
        except Exception:
            log.exception("reaper failed; retrying in %.1f s", interval_s)
            continue
        for t in reaped:
            log.warning("job_id=%d %s → %s: %s", t.job_id, t.expected, t.target, t.reason)
