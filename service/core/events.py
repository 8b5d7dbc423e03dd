"""Job events: what kinds there are (``EventKind``) and, in one table (``WORDING``), how each
kind is worded for people from its ``data``.

Every ``job_events`` row carries a kind and a JSON object of data; its ``reason`` text is
rendered here once, when the row is written (``render``), and kept only for people (the API,
``ddpq show``, the dashboard). Code that needs to know what happened reads ``kind`` and
``data``, never the text. Adding a kind: add it to ``EventKind`` and its wording to
``WORDING`` (the unit test renders every kind from sample data).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

MAX_REASON_CHARS = 2000  # a rendered reason (and any text value of an event's data) is cut here


class EventKind(StrEnum):
    """What a job event records. State changes first (``from_state != to_state``), then notes
    (``NOTE_KINDS``: the state does not change, ``from_state == to_state``). The sweep kinds
    are either: a queued trial cancelled, or a started one flagged ``cancel_requested``."""

    # -- state changes ---------------------------------------------------------------------
    SUBMITTED = "submitted"  # None → queued: a job submitted on its own
    TRIAL_SUBMITTED = "trial_submitted"  # None → queued: a sweep's trial
    TRIAL_RETRIED = "trial_retried"  # None → queued: a new job retrying a failed trial's
    CLAIMED = "claimed"  # queued → starting: a worker took it
    LAUNCHED = "launched"  # starting → running: its ranks run
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # ended failed (no restart left, or a failure never retried)
    RETRIED = "retried"  # → queued after a failure, restarts left
    PREEMPTED = "preempted"  # → queued: the scheduler preempted it (not a restart)
    WORKER_LOST = "worker_lost"  # → queued: its worker's lease expired
    WORKER_STOPPED = "worker_stopped"  # → queued: its worker shut down
    ORPHANED = "orphaned"  # → queued: held by a worker that does not run it
    CANCELLED = "cancelled"  # → cancelled: the cancel a user requested, carried out
    CANCELLED_WHILE_QUEUED = "cancelled_while_queued"  # queued → cancelled at the request
    CANCELLED_INSTEAD_OF_REQUEUE = "cancelled_instead_of_requeue"  # a requeue of a flagged job
    CANCELLED_OUTSIDE = "cancelled_outside"  # → cancelled by the scheduler, not through ddpq
    SWEEP_CANCELLED = "sweep_cancelled"  # a trial's job ended (or flagged): its sweep cancelled
    SWEEP_STOPPED = "sweep_stopped"  # a trial's job ended (or flagged): max_failed reached
    STATE_CHANGED = "state_changed"  # a transition planned with a free text only
    # -- notes -----------------------------------------------------------------------------
    EARLY_STOPPED = "early_stopped"  # ASHA stopped the trial at a rung (cancel requested)
    MORE_RANKS_THAN_CORES = "more_ranks_than_cores"  # a CPU job's ranks outnumber the cores
    SCHEDULER_PENDING = "scheduler_pending"  # why the batch scheduler keeps it pending
    CHECKPOINT_FAILED = "checkpoint_failed"  # a checkpoint could not be written
    CHECKPOINT_DELETED = "checkpoint_deleted"  # retention let an older checkpoint go
    CHECKPOINT_DAMAGED = "checkpoint_damaged"  # rank 0 found it damaged at resume
    CHECKPOINT_UNPLACED = "checkpoint_unplaced"  # recorded, but its file never got in place
    FRESH_START = "fresh_start"  # an attempt starts from step 0 although checkpoints existed
    UPLOAD_FALLBACK = "upload_fallback"  # told to share a filesystem, rank 0 uploads instead
    NOTHING_TO_TRAIN = "nothing_to_train"  # init_from restored a step ≥ the job's steps
    QUOTA_EXCEEDED = "quota_exceeded"  # a write refused: it would pass one of the quotas
    NOTE = "note"  # a free-text note (rows written before events had kinds)


# The kinds always written as notes (the job's state stays as it is).
NOTE_KINDS: frozenset[EventKind] = frozenset(
    {
        EventKind.EARLY_STOPPED,
        EventKind.MORE_RANKS_THAN_CORES,
        EventKind.SCHEDULER_PENDING,
        EventKind.CHECKPOINT_FAILED,
        EventKind.CHECKPOINT_DELETED,
        EventKind.CHECKPOINT_DAMAGED,
        EventKind.CHECKPOINT_UNPLACED,
        EventKind.FRESH_START,
        EventKind.UPLOAD_FALLBACK,
        EventKind.NOTHING_TO_TRAIN,
        EventKind.QUOTA_EXCEEDED,
        EventKind.NOTE,
    }
)


@dataclass(frozen=True)
class Wording:
    """How one kind reads: ``fields`` its data holds (``?``: optional), ``text`` the words."""

    fields: tuple[str, ...]
    text: Callable[[Mapping[str, Any]], str | None]


def _num(value: object) -> str:
    """A number as events show it (4 significant digits); a non-number as it is."""
    return f"{value:.4g}" if isinstance(value, int | float) else str(value)


def _sweep_cancelled(d: Mapping[str, Any]) -> str:
    head = "cancel requested: " if d.get("cancel_requested") else ""
    return f"{head}sweep {d['sweep_id']} cancelled by {d['by']}"


def _sweep_stopped(d: Mapping[str, Any]) -> str:
    head = "cancel requested: " if d.get("cancel_requested") else ""
    return (
        f"{head}sweep {d['sweep_id']} stopped: {d['failed']} trial(s) failed "
        f"(max_failed {d['max_failed']}); the rest cancelled"
    )


def _trial_retried(d: Mapping[str, Any]) -> str:
    trial = f"trial {d['position']} of sweep {d['sweep_id']}"
    text = f"retry of failed job {d['failed_job_id']} ({trial})"
    if "continuing_from_step" in d:
        text += f", continuing from its checkpoint at step {d['continuing_from_step']}"
    return text


def _more_ranks(d: Mapping[str, Any]) -> str:
    n, cpus, batch = d["nproc_per_node"], d["cpus"], d.get("batch_size")
    # A command job's note has no batch_size: its script chooses its own.
    global_batch = (
        f"the global batch is {n} × batch_size {batch} = {n * batch} samples per step"
        if batch is not None
        else f"the global batch is {n} × the script's batch size"
    )
    return (
        f"{n} ranks on {cpus} CPU core{'s' if cpus != 1 else ''} of this worker: the ranks "
        f"share cores, so each step is slower; {global_batch}, which changes learning and "
        f"accuracy against a run with fewer ranks (lower resources.nproc_per_node to {cpus} "
        "to match the cores)"
    )


def _fresh_start(d: Mapping[str, Any]) -> str:
    damaged = list(d["damaged_steps"])
    detail = ", ".join(f"step {s}" for s in damaged[:20]) + " damaged" if damaged else "none usable"
    return f"attempt {d['attempt']} starts from step 0: no intact checkpoint ({detail})"


def _quota_exceeded(d: Mapping[str, Any]) -> str:
    unit = "" if d.get("unit") in (None, "") else f" {d['unit']}"
    return (
        f"{d['quota']} quota reached: {d['asked']}{unit} asked, the limit is "
        f"{d['limit']}{unit} (raise {d['setting']})"
    )


def _early_stopped(d: Mapping[str, Any]) -> str:
    return (
        f"stopped at rung {d['rung']}, step {d['step']}: {d['metric']} {_num(d['value'])} "
        f"not in the top 1/{d['reduction_factor']} (cut {_num(d['cut'])}) of {d['n']} trials"
    )


# The one table of wordings: kind → the data it holds and the text people read.
WORDING: dict[EventKind, Wording] = {
    EventKind.SUBMITTED: Wording((), lambda d: None),  # the state change says it all
    EventKind.TRIAL_SUBMITTED: Wording(
        ("sweep_id", "position"), lambda d: f"trial {d['position']} of sweep {d['sweep_id']}"
    ),
    EventKind.TRIAL_RETRIED: Wording(
        ("sweep_id", "position", "failed_job_id", "continuing_from_step?"), _trial_retried
    ),
    EventKind.CLAIMED: Wording((), lambda d: "claimed"),
    EventKind.LAUNCHED: Wording((), lambda d: "launched"),
    EventKind.SUCCEEDED: Wording((), lambda d: "succeeded"),
    EventKind.FAILED: Wording(("error?",), lambda d: d.get("error") or "failed"),
    EventKind.RETRIED: Wording(
        ("restart", "max_restarts", "error"),
        lambda d: f"retry {d['restart']}/{d['max_restarts']}: {d['error']}",
    ),
    EventKind.PREEMPTED: Wording(
        ("detail?",), lambda d: "preempted" + (f": {d['detail']}" if d.get("detail") else "")
    ),
    EventKind.WORKER_LOST: Wording((), lambda d: "worker lost: lease expired"),
    EventKind.WORKER_STOPPED: Wording((), lambda d: "worker stopped"),
    EventKind.ORPHANED: Wording((), lambda d: "held by this worker but not running here"),
    EventKind.CANCELLED: Wording((), lambda d: "cancel requested"),
    EventKind.CANCELLED_WHILE_QUEUED: Wording((), lambda d: "cancelled while queued"),
    EventKind.CANCELLED_INSTEAD_OF_REQUEUE: Wording(
        ("instead_of", "requeue_kind?"),
        lambda d: f"cancel requested (instead of: {d['instead_of']})",
    ),
    EventKind.CANCELLED_OUTSIDE: Wording(
        ("detail?",), lambda d: d.get("detail") or "cancelled outside ddpq"
    ),
    EventKind.SWEEP_CANCELLED: Wording(("sweep_id", "by", "cancel_requested?"), _sweep_cancelled),
    EventKind.SWEEP_STOPPED: Wording(
        ("sweep_id", "failed", "max_failed", "cancel_requested?"), _sweep_stopped
    ),
    EventKind.STATE_CHANGED: Wording(("reason?",), lambda d: d.get("reason")),
    EventKind.EARLY_STOPPED: Wording(
        ("rung", "step", "metric", "value", "cut", "n", "reduction_factor"), _early_stopped
    ),
    EventKind.MORE_RANKS_THAN_CORES: Wording(
        ("nproc_per_node", "cpus", "batch_size?"), _more_ranks
    ),
    EventKind.SCHEDULER_PENDING: Wording(
        ("code", "words"), lambda d: f"scheduler pending: {d['code']} — {d['words']}"
    ),
    EventKind.CHECKPOINT_FAILED: Wording(
        ("step", "reason"), lambda d: f"checkpoint at step {d['step']} not written: {d['reason']}"
    ),
    EventKind.CHECKPOINT_DELETED: Wording(
        ("step", "keep"),
        lambda d: (
            f"checkpoint at step {d['step']} deleted: keep_checkpoints={d['keep']} keeps newer ones"
        ),
    ),
    EventKind.CHECKPOINT_DAMAGED: Wording(
        ("step",), lambda d: f"checkpoint at step {d['step']} found damaged at resume and deleted"
    ),
    EventKind.CHECKPOINT_UNPLACED: Wording(
        ("step",),
        lambda d: f"checkpoint at step {d['step']} deleted: its file could not be put in place",
    ),
    EventKind.FRESH_START: Wording(("attempt", "damaged_steps"), _fresh_start),
    EventKind.UPLOAD_FALLBACK: Wording(
        (),
        lambda d: (
            "checkpoint transport: DDPQ_CHECKPOINT_TRANSPORT=shared, but rank 0's artifact "
            "root does not hold the API's store id (not the API's directory): uploading instead"
        ),
    ),
    EventKind.NOTHING_TO_TRAIN: Wording(
        ("step", "total_steps"),
        lambda d: (
            f"init_from step {d['step']} ≥ this job's {d['total_steps']} steps: nothing "
            "to train (raise training.max_steps or epochs, or use init_from.mode weights_only)"
        ),
    ),
    EventKind.QUOTA_EXCEEDED: Wording(
        ("quota", "limit", "asked", "setting", "unit?"), _quota_exceeded
    ),
    EventKind.NOTE: Wording(("text?",), lambda d: d.get("text")),
}


def render(kind: EventKind, data: Mapping[str, Any] | None = None) -> str | None:
    """The ``reason`` text of an event of ``kind`` with ``data``, at most
    ``MAX_REASON_CHARS`` characters; None for a kind that needs no words (``submitted``).

    Raises:
        KeyError: ``data`` lacks a field the kind's wording needs.
    """
    text = WORDING[kind].text(data or {})
    return None if text is None else text[:MAX_REASON_CHARS]


def json_safe(data: Mapping[str, Any] | None) -> dict[str, Any]:
    """``data`` as an event stores it: a non-finite float becomes its text (``"nan"``,
    ``"inf"``; neither database's JSON holds them) and a text longer than
    ``MAX_REASON_CHARS`` is cut; lists and nested objects likewise."""

    def safe(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, str):
            return value[:MAX_REASON_CHARS]
        if isinstance(value, Mapping):
            return {str(k): safe(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [safe(v) for v in value]
        return value

    return {str(k): safe(v) for k, v in (data or {}).items()}


# The type of every field a wording names, for event data that comes from outside the API
# process (the worker API's notes and transitions): ``check_data`` refuses any other. The
# wordings format and multiply these values, so a text where a number belongs would fail
# (or, multiplied, grow without bound) when the event is written.
_INT = (int,)
_NUMBER = (int, float)
_TEXT = (str,)
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(
        ("sweep_id", "position", "failed_job_id", "continuing_from_step", "restart",
         "max_restarts", "failed", "max_failed", "rung", "step", "n", "reduction_factor",
         "nproc_per_node", "cpus", "batch_size", "keep", "attempt", "total_steps", "limit",
         "asked"),
        _INT,
    ),
    **dict.fromkeys(("value", "cut"), _NUMBER),
    **dict.fromkeys(
        ("error", "detail", "instead_of", "requeue_kind", "by", "reason", "metric", "code",
         "words", "text", "quota", "setting", "unit"),
        _TEXT,
    ),
    "cancel_requested": (bool,),
    "damaged_steps": (list,),  # of ints
}  # fmt: skip
MAX_DATA_INT = 2**63 - 1
MAX_DATA_LIST = 1000


def _check_value(name: str, value: Any) -> None:
    types = FIELD_TYPES[name]
    if isinstance(value, bool) and bool not in types:
        raise ValueError(f"{name}: {types[0].__name__} expected, not a boolean")
    if not isinstance(value, types):
        raise ValueError(f"{name}: {types[0].__name__} expected, got {type(value).__name__}")
    items = value if isinstance(value, list) else [value]
    if isinstance(value, list) and len(value) > MAX_DATA_LIST:
        raise ValueError(f"{name}: at most {MAX_DATA_LIST} items")
    for item in items:
        if isinstance(value, list) and (isinstance(item, bool) or not isinstance(item, int)):
            raise ValueError(f"{name}: a list of integers expected")
        if isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_DATA_INT:
            raise ValueError(f"{name}: out of range")


def check_data(kind: EventKind, data: Mapping[str, Any]) -> None:
    """Check ``data`` for an event of ``kind`` that a caller outside the API sends (a
    worker's note or transition): only the fields its wording names, the required ones
    present, each of its type (``FIELD_TYPES``; an optional one may be null). Then it
    renders.

    Raises:
        ValueError: the first problem found, in words (the wire answers 422 with it).
    """
    fields = WORDING[kind].fields
    names = {f.rstrip("?") for f in fields}
    unknown = sorted(set(data) - names)
    if unknown:
        allowed = ", ".join(fields) if fields else "no data"
        raise ValueError(f"{kind.value} takes {allowed}; not {', '.join(unknown)}")
    for field_name in fields:
        name = field_name.rstrip("?")
        if name not in data:
            if not field_name.endswith("?"):
                raise ValueError(f"{kind.value} needs {name}")
            continue
        value = data[name]
        if value is None and field_name.endswith("?"):
            continue
        _check_value(name, value)
    render(kind, json_safe(data))


def describe_kinds() -> str:
    """Every kind with the fields of its data (``?``: optional), one per line: the OpenAPI
    description of an event's ``kind`` and ``data``."""
    return "\n".join(
        f"- `{kind}`: " + (", ".join(w.fields) if w.fields else "no data")
        for kind, w in WORDING.items()
    )
