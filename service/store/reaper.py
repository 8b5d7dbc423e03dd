"""The API's reaper: lost workers' jobs are requeued even when no worker is running.

Workers reap on every tick too (``worker.loop``); the API runs the same
``jobs.requeue_expired_jobs`` every ``heartbeat_interval_s`` seconds so that a job whose only
worker died goes back to ``queued`` (and ``ddpq show`` says so) without waiting for another
worker to start. Both call the same compare-and-set, so running several reapers is safe.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.concurrency import run_in_threadpool

from service.core.errors import DatabaseUnavailableError
from service.store import jobs
from service.store.db import Database

log = logging.getLogger(__name__)


def reap_once(db: Database) -> list[jobs.Transition]:
    """Requeue (or cancel, if flagged) the jobs whose lease expired; the transitions made."""
    with db.session() as session:
        return jobs.requeue_expired_jobs(session)


async def reap_forever(db: Database, interval_s: float) -> None:
    """``reap_once`` every ``interval_s`` seconds until cancelled; a database outage is
    logged and retried at the next interval, never raised."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            reaped = await run_in_threadpool(reap_once, db)
        except DatabaseUnavailableError as exc:
            log.warning("reaper: database unavailable (%s); retrying in %.1f s", exc, interval_s)
            continue
        except Exception:
            log.exception("reaper failed; retrying in %.1f s", interval_s)
            continue
        for t in reaped:
            log.warning("job_id=%d %s → %s: %s", t.job_id, t.expected, t.target, t.reason)
