"""Rank 0's notes to the job's events (``POST /attempts/self/notes``), best effort: a note
that cannot be sent is logged, never a reason to stop training (a fenced-off attempt finds
out at its next write anyway)."""

from __future__ import annotations

import logging

from service.core.errors import StaleAttemptError
from service.core.wire import attempt as wire
from worker.runtime.attempt_client import ApiUnavailableError, AttemptClient, AttemptRequestError

log = logging.getLogger(__name__)


def send_note(client: AttemptClient, note: wire.AttemptNote) -> bool:
    """Send ``note``; True when the API stored it, False (logged) when it could not."""
    try:
        client.send_note(note)
    except (ApiUnavailableError, AttemptRequestError, StaleAttemptError) as exc:
        log.warning("note %s not recorded as a job event: %s", note.kind, exc)
        return False
    return True


def note_upload_fallback(client: AttemptClient) -> bool:
    """The job's event for a rank told to share a filesystem that uploads instead."""
    return send_note(client, wire.AttemptNote(kind="upload_fallback"))


def note_nothing_to_train(client: AttemptClient, step: int, total_steps: int) -> bool:
    """The job's event for an ``init_from`` ``full`` start at ``step`` ≥ ``total_steps``."""
    note = wire.AttemptNote(kind="nothing_to_train", step=step, total_steps=total_steps)
    return send_note(client, note)
