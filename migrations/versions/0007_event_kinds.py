"""job_events.kind and job_events.data: typed events, backfilled from the old reason texts

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 09:00:00.000000

Rows written before this revision carry only a ``reason`` text; this is the one place that
reads those texts back: each row gets the kind (and what data the text holds) that the code
of revision 0006 wrote it for. A text no pattern knows becomes ``state_changed`` (a state
change, text kept as ``data.reason``), ``failed`` / ``cancelled_outside`` (their free text as
``error`` / ``detail``) or ``note`` (``data.text``). The kinds are written as plain strings
here, frozen as of this revision.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH_ROWS = 5000

_events = sa.table(
    "job_events",
    sa.column("id", sa.BigInteger()),
    sa.column("from_state", sa.String()),
    sa.column("to_state", sa.String()),
    sa.column("reason", sa.Text()),
    sa.column("kind", sa.String()),
    sa.column("data", sa.JSON()),
)

# Exact (from_state, to_state, reason) → kind: the bulk of any table (one claim and one launch
# per attempt), backfilled set-wise. ``None`` as a state: any.
_EXACT: list[tuple[str | None, str | None, str | None, str]] = [
    (None, "queued", None, "submitted"),
    ("queued", "starting", "claimed", "claimed"),
    ("starting", "running", "launched", "launched"),
    (None, "succeeded", "succeeded", "succeeded"),
    (None, "queued", "worker lost: lease expired", "worker_lost"),
    (None, "queued", "worker stopped", "worker_stopped"),
    (None, "queued", "held by this worker but not running here", "orphaned"),
    (None, "queued", "preempted", "preempted"),
    (None, "cancelled", "cancel requested", "cancelled"),
    ("queued", "cancelled", "cancelled while queued", "cancelled_while_queued"),
]

_INT = r"(-?\d+)"
# (pattern, kind, field names of its groups in order) for state changes, tried in order.
_CHANGES: list[tuple[re.Pattern[str], str, tuple[str, ...]]] = [
    (re.compile(rf"^trial {_INT} of sweep {_INT}$"), "trial_submitted", ("position", "sweep_id")),
    (
        re.compile(
            rf"^retry of failed job {_INT} \(trial {_INT} of sweep {_INT}\)"
            r"(?:, continuing from its checkpoint at step (.*))?$"
        ),
        "trial_retried",
        ("failed_job_id", "position", "sweep_id", "continuing_from_step"),
    ),
    (re.compile(rf"^retry {_INT}/{_INT}: (.*)$", re.S), "retried", ("restart", "max_restarts", "error")),
    (re.compile(r"^preempted: (.*)$", re.S), "preempted", ("detail",)),
    (re.compile(r"^cancel requested \(instead of: (.*)\)$", re.S), "cancelled_instead_of_requeue", ("instead_of",)),
    (re.compile(rf"^sweep {_INT} cancelled by (.*)$", re.S), "sweep_cancelled", ("sweep_id", "by")),
    (
        re.compile(
            rf"^sweep {_INT} stopped: {_INT} trial\(s\) failed \(max_failed {_INT}\); "
            "the rest cancelled$"
        ),
        "sweep_stopped",
        ("sweep_id", "failed", "max_failed"),
    ),
]

# The same for notes (from_state = to_state).
_NOTES: list[tuple[re.Pattern[str], str, tuple[str, ...]]] = [
    (re.compile(r"^scheduler pending: (.*?) — (.*)$", re.S), "scheduler_pending", ("code", "words")),
    (re.compile(rf"^checkpoint at step {_INT} not written: (.*)$", re.S), "checkpoint_failed", ("step", "reason")),
    (
        re.compile(rf"^checkpoint at step {_INT} deleted: keep_checkpoints={_INT} keeps newer ones$"),
        "checkpoint_deleted",
        ("step", "keep"),
    ),
    (re.compile(rf"^checkpoint at step {_INT} found damaged at resume and deleted$"), "checkpoint_damaged", ("step",)),
    (
        re.compile(rf"^checkpoint at step {_INT} deleted: its file could not be put in place$"),
        "checkpoint_unplaced",
        ("step",),
    ),
    (
        re.compile(rf"^attempt {_INT} starts from step 0: no intact checkpoint \((.*)\)$"),
        "fresh_start",
        ("attempt", "damaged_steps"),
    ),
    (re.compile(r"^checkpoint transport: DDPQ_CHECKPOINT_TRANSPORT=shared, "), "upload_fallback", ()),
    (
        re.compile(rf"^init_from step {_INT} ≥ this job's {_INT} steps: nothing to train"),
        "nothing_to_train",
        ("step", "total_steps"),
    ),
    (
        re.compile(rf"^{_INT} ranks on {_INT} CPU cores? of this worker: .* × batch_size {_INT} = ", re.S),
        "more_ranks_than_cores",
        ("nproc_per_node", "cpus", "batch_size"),
    ),
    (
        re.compile(
            rf"^stopped at rung {_INT}, step {_INT}: (.*) (\S+) not in the top 1/{_INT} "
            rf"\(cut (\S+)\) of {_INT} trials$",
            re.S,
        ),
        "early_stopped",
        ("rung", "step", "metric", "value", "reduction_factor", "cut", "n"),
    ),
    (re.compile(rf"^cancel requested: sweep {_INT} cancelled by (.*)$", re.S), "sweep_cancelled", ("sweep_id", "by")),
    (
        re.compile(
            rf"^cancel requested: sweep {_INT} stopped: {_INT} trial\(s\) failed "
            rf"\(max_failed {_INT}\); the rest cancelled$"
        ),
        "sweep_stopped",
        ("sweep_id", "failed", "max_failed"),
    ),
]

_INT_FIELDS = {
    "position", "sweep_id", "failed_job_id", "restart", "max_restarts", "failed", "max_failed",
    "step", "keep", "attempt", "total_steps", "nproc_per_node", "cpus", "batch_size", "rung",
    "reduction_factor", "n",
}  # fmt: skip


def _value(name: str, text: str) -> Any:
    if name in _INT_FIELDS:
        return int(text)
    if name in ("value", "cut"):
        try:
            number = float(text)
        except ValueError:
            return text
        return number if number == number and abs(number) != float("inf") else text
    if name == "continuing_from_step":
        return int(text) if re.fullmatch(r"-?\d+", text) else (None if text == "None" else text)
    if name == "damaged_steps":
        return [int(s) for s in re.findall(r"step (\d+)", text)]
    return text


def classify(from_state: str | None, to_state: str, reason: str | None) -> tuple[str, dict[str, Any]]:
    """The kind and data of an event written before kinds existed, from its states and text."""
    if from_state is not None and from_state == to_state:
        table = _NOTES
    else:
        table = _CHANGES
    for pattern, kind, names in table:
        m = pattern.match(reason or "")
        if m is None:
            continue
        data = {n: _value(n, g) for n, g in zip(names, m.groups(), strict=True) if g is not None}
        if table is _NOTES and kind in ("sweep_cancelled", "sweep_stopped"):
            data["cancel_requested"] = True
        return kind, data
    for exact_from, exact_to, text, kind in _EXACT:
        if exact_to == to_state and reason == text and exact_from in (None, from_state):
            if kind == "submitted" and from_state is not None:
                continue
            return kind, {}
    if from_state is not None and from_state == to_state:
        return "note", ({"text": reason} if reason else {})
    if to_state == "failed":
        return "failed", ({"error": reason} if reason else {})
    if to_state == "cancelled":
        return "cancelled_outside", ({"detail": reason} if reason else {})
    if from_state is None and reason is None:
        return "submitted", {}
    return "state_changed", ({"reason": reason} if reason else {})


def _backfill(conn: sa.Connection) -> None:
    """Every row's kind and data: the exact texts set-wise, the rest row by row."""
    for exact_from, exact_to, text, kind in _EXACT:
        where = [_events.c.kind.is_(None), _events.c.to_state == exact_to]
        where.append(_events.c.reason.is_(None) if text is None else _events.c.reason == text)
        if kind == "submitted":
            where.append(_events.c.from_state.is_(None))
        elif exact_from is not None:
            where.append(_events.c.from_state == exact_from)
        else:  # a state change, never a note with the same text
            where.append(
                sa.or_(_events.c.from_state.is_(None), _events.c.from_state != _events.c.to_state)
            )
        conn.execute(sa.update(_events).where(*where).values(kind=kind))
    update = (
        sa.update(_events)
        .where(_events.c.id == sa.bindparam("b_id"))
        .values(kind=sa.bindparam("b_kind"), data=sa.bindparam("b_data", type_=sa.JSON()))
    )
    last = None
    while True:
        query = (
            sa.select(_events.c.id, _events.c.from_state, _events.c.to_state, _events.c.reason)
            .where(_events.c.kind.is_(None))
            .order_by(_events.c.id)
            .limit(BATCH_ROWS)
        )
        if last is not None:
            query = query.where(_events.c.id > last)
        rows = conn.execute(query).all()
        if not rows:
            return
        params = []
        for row in rows:
            kind, data = classify(row.from_state, row.to_state, row.reason)
            params.append({"b_id": row.id, "b_kind": kind, "b_data": data})
        conn.execute(update, params)
        last = rows[-1].id


def upgrade() -> None:
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=32), nullable=True))
        batch_op.add_column(
            sa.Column("data", sa.JSON(), server_default=sa.text("'{}'"), nullable=False)
        )
    _backfill(op.get_bind())
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.alter_column("kind", existing_type=sa.String(length=32), nullable=False)
        batch_op.create_index(batch_op.f("ix_job_events_job_id_kind"), ["job_id", "kind"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_job_events_job_id_kind"))
        batch_op.drop_column("data")
        batch_op.drop_column("kind")
