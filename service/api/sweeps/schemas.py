"""API models of the sweep resource (separate from the tables; see SWEEP-API.md)."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.core.states import SweepState, TrialOutcome
from service.core.sweeps.spec import canonical_json
from service.store.sweeps.values import SweepDetail, TrialPage, TrialView


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class BestTrialOut(_Out):
    """The trial with the best objective value so far, among trials that succeeded, were
    stopped early, or are still running (``outcome`` says which); never a failed or
    cancelled one."""

    job_id: int | None
    trial_key: str
    position: int
    overrides: dict[str, Any]
    value: float
    outcome: str


class SweepOut(_Out):
    """A sweep as the API shows it: state, counts of trials by outcome, the best trial."""

    id: int
    name: str
    owner: str
    state: str = Field(description=" | ".join(SweepState))
    stop_reason: str | None
    spec: dict[str, Any]
    objective: dict[str, str] = Field(description="{metric, mode, at}, defaults filled in.")
    counts: dict[str, int] = Field(
        description="Trials by outcome: the job states plus stopped_early."
    )
    trials_total: int
    best: BestTrialOut | None
    max_concurrent: int | None
    max_failed: int | None
    created_at: datetime
    finished_at: datetime | None
    added: int | None = Field(
        default=None,
        description="extend: trials added; retry-failed: trials re-queued (else null).",
    )


class SweepListOut(_Out):
    """One page of sweeps, newest first; pass ``next_cursor`` as ``cursor`` for the next."""

    sweeps: list[SweepOut]
    next_cursor: int | None


class TrialOut(_Out):
    """One trial: its newest job and how it is doing."""

    key: str = Field(description="sha256 hex of the canonical JSON of the overrides.")
    position: int
    overrides: dict[str, Any]
    job_id: int | None
    state: str | None = Field(description="The newest job's state.")
    outcome: str = Field(description=" | ".join(TrialOutcome))
    attempts: int = Field(description="Jobs this trial has had (a retry is a new job).")
    steps_done: int | None
    objective_value: float | None
    run_time_s: float | None
    may_be_best: bool = Field(
        description="Whether its objective value competes for the sweep's `best`: it "
        "succeeded, was stopped early, or is running and not being cancelled."
    )


class TrialListOut(_Out):
    """Trials of a sweep: every one in position order, or the page the query asked for."""

    trials: list[TrialOut]
    total: int = Field(
        description="Trials the query matched before paging (all of the sweep's, or with "
        "changed_since all that changed)."
    )
    offset: int
    next_offset: int | None = Field(description="The next page's offset (null: the last).")
    changed_since: datetime = Field(
        description="Send as changed_since with the next delta poll: it overlaps this "
        "answer by a few seconds, so a trial may come again (dedupe by key)."
    )


def sweep_out(detail: SweepDetail) -> SweepOut:
    """A sweep with its counts and best trial as the API's Sweep."""
    sweep, best = detail.sweep, detail.best
    return SweepOut(
        id=sweep.id,
        name=sweep.name,
        owner=sweep.owner,
        state=sweep.state,
        stop_reason=sweep.stop_reason,
        spec=sweep.spec,
        objective=sweep.objective,
        counts=detail.counts,
        trials_total=detail.trials_total,
        best=None
        if best is None or best.objective_value is None
        else BestTrialOut(
            job_id=best.job_id,
            trial_key=best.key,
            position=best.position,
            overrides=best.overrides,
            value=best.objective_value,
            outcome=best.outcome,
        ),
        max_concurrent=sweep.max_concurrent,
        max_failed=sweep.max_failed,
        created_at=sweep.created_at,
        finished_at=sweep.finished_at,
        added=detail.added,
    )


def trial_list_out(page: TrialPage) -> TrialListOut:
    """A page of the trials table as the API's envelope."""
    return TrialListOut(
        trials=[trial_out(t) for t in page.trials],
        total=page.total,
        offset=page.offset,
        next_offset=page.next_offset,
        changed_since=page.changed_since,
    )


def trial_out(t: TrialView) -> TrialOut:
    """A TrialView as the API's Trial."""
    return TrialOut(
        key=t.key,
        position=t.position,
        overrides=t.overrides,
        job_id=t.job_id,
        state=t.state,
        outcome=t.outcome,
        attempts=t.attempts,
        steps_done=t.steps_done,
        objective_value=t.objective_value,
        run_time_s=t.run_time_s,
        may_be_best=t.may_be_best,
    )


CSV_COLUMNS = (
    "position",
    "key",
    "job_id",
    "state",
    "outcome",
    "attempts",
    "steps_done",
    "objective_value",
    "run_time_s",
)


def trials_csv(trials: Sequence[TrialView]) -> str:
    """The trials table as CSV: the fixed columns, then one column per override path
    (values as JSON text unless plain numbers or text). Text that a spreadsheet would run
    as a formula (starting ``=``, ``+``, ``-``, ``@``, tab or CR) gets a leading ``'``
    (OWASP's advice against CSV injection); numbers are written as they are."""
    paths = sorted({p for t in trials for p in t.overrides})
    buf = io.StringIO()
    # RFC 4180's CRLF: the writer quotes a field holding any line-terminator character, so a
    # value with a lone CR stays one field.
    writer = csv.writer(buf, lineterminator="\r\n")
    writer.writerow([*CSV_COLUMNS, *paths])
    for t in trials:
        fixed = [
            t.position,
            t.key,
            t.job_id,
            t.state,
            t.outcome,
            t.attempts,
            t.steps_done,
            t.objective_value,
            t.run_time_s,
        ]
        values = [_cell(t.overrides[p]) if p in t.overrides else "" for p in paths]
        writer.writerow([_inert(v) for v in fixed + values])
    return buf.getvalue()


def _cell(value: Any) -> Any:
    return value if isinstance(value, int | float | str) else canonical_json(value)


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _inert(value: Any) -> Any:
    """A CSV cell a spreadsheet shows as text: None → "", formula-like text quoted."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value
