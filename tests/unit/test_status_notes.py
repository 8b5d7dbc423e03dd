"""A launcher's notes on an ended attempt (``RunStatus.notes``: a log cut at its cap) become
the attempt's job events once, however often the loop polls the ended attempt."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.core.events import EventKind, render
from service.core.states import JobState
from worker.attempt_notes import post_status_notes
from worker.decisions import HeldRun
from worker.launchers.base import RunPhase, RunStatus


class NoteBook:
    """The part of ``WorkerRecords`` notes go through (a fake of our own interface)."""

    def __init__(self, fail: bool = False) -> None:
        self.notes: list[tuple[int, int, EventKind, Mapping[str, Any]]] = []
        self.fail = fail

    def note(self, job_id: int, attempt: int, kind: EventKind, data: Mapping[str, Any]) -> bool:
        if self.fail:
            raise ConnectionError("API down")
        self.notes.append((job_id, attempt, kind, data))
        return True


CUT = {"quota": "log rank-0.log", "limit": 1000, "asked": 5000,
       "setting": "DDPQ_RANK_LOG_MAX_BYTES", "unit": "bytes"}  # fmt: skip


def test_an_ended_attempts_notes_are_posted_once() -> None:
    run = HeldRun(job_id=7, attempt=2, state=JobState.RUNNING)
    status = RunStatus(RunPhase.SUCCEEDED, notes=((EventKind.QUOTA_EXCEEDED, CUT),))
    book = NoteBook()
    for _ in range(3):  # the outcome's transition failed twice: polled again each tick
        post_status_notes(book, run, status)  # type: ignore[arg-type]
    assert book.notes == [(7, 2, EventKind.QUOTA_EXCEEDED, CUT)]
    words = render(EventKind.QUOTA_EXCEEDED, CUT) or ""
    assert "DDPQ_RANK_LOG_MAX_BYTES" in words and "5000 bytes" in words


def test_a_note_the_api_cannot_take_never_blocks_the_outcome() -> None:
    run = HeldRun(job_id=7, attempt=2, state=JobState.RUNNING)
    status = RunStatus(RunPhase.FAILED, "boom", notes=((EventKind.QUOTA_EXCEEDED, CUT),))
    post_status_notes(NoteBook(fail=True), run, status)  # type: ignore[arg-type]
    assert run.notes_posted  # not retried: the outcome is what matters now
