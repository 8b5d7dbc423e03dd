"""The one table of event wordings (``service.core.events``): every kind has a wording that
renders from sample data, in the words the code wrote before events had kinds; and the
migration's reader of those old texts (0007) gives each sample back its kind and data."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from service.core.events import (
    FIELD_TYPES,
    MAX_REASON_CHARS,
    NOTE_KINDS,
    WORDING,
    EventKind,
    check_data,
    describe_kinds,
    json_safe,
    render,
)

# kind → (from_state, to_state, data, the reason the code wrote for it before kinds existed)
SAMPLES: dict[EventKind, tuple[str | None, str, dict[str, Any], str | None]] = {
    EventKind.SUBMITTED: (None, "queued", {}, None),
    EventKind.TRIAL_SUBMITTED: (
        None, "queued", {"sweep_id": 3, "position": 7}, "trial 7 of sweep 3",
    ),
    EventKind.TRIAL_RETRIED: (
        None, "queued", {"sweep_id": 3, "position": 7, "failed_job_id": 41,
                         "continuing_from_step": 40},
        "retry of failed job 41 (trial 7 of sweep 3), continuing from its checkpoint at step 40",
    ),
    EventKind.CLAIMED: ("queued", "starting", {}, "claimed"),
    EventKind.LAUNCHED: ("starting", "running", {}, "launched"),
    EventKind.SUCCEEDED: ("running", "succeeded", {}, "succeeded"),
    EventKind.FAILED: (
        "running", "failed", {"error": "rank 1 failed: RuntimeError: boom"},
        "rank 1 failed: RuntimeError: boom",
    ),
    EventKind.RETRIED: (
        "running", "queued", {"restart": 1, "max_restarts": 2, "error": "rank 0 exited 1"},
        "retry 1/2: rank 0 exited 1",
    ),
    EventKind.PREEMPTED: ("running", "queued", {"detail": "PREEMPTED"}, "preempted: PREEMPTED"),
    EventKind.WORKER_LOST: ("running", "queued", {}, "worker lost: lease expired"),
    EventKind.WORKER_STOPPED: ("running", "queued", {}, "worker stopped"),
    EventKind.ORPHANED: ("starting", "queued", {}, "held by this worker but not running here"),
    EventKind.CANCELLED: ("running", "cancelled", {}, "cancel requested"),
    EventKind.CANCELLED_WHILE_QUEUED: ("queued", "cancelled", {}, "cancelled while queued"),
    EventKind.CANCELLED_INSTEAD_OF_REQUEUE: (
        "running", "cancelled", {"instead_of": "worker stopped"},
        "cancel requested (instead of: worker stopped)",
    ),
    EventKind.CANCELLED_OUTSIDE: (
        "running", "cancelled", {"detail": "Slurm job 12 cancelled"}, "Slurm job 12 cancelled",
    ),
    EventKind.SWEEP_CANCELLED: (
        "queued", "cancelled", {"sweep_id": 3, "by": "alice"}, "sweep 3 cancelled by alice",
    ),
    EventKind.SWEEP_STOPPED: (
        "running", "running", {"sweep_id": 3, "failed": 2, "max_failed": 2,
                               "cancel_requested": True},
        "cancel requested: sweep 3 stopped: 2 trial(s) failed (max_failed 2); the rest cancelled",
    ),
    EventKind.STATE_CHANGED: ("starting", "queued", {"reason": "moved by hand"}, "moved by hand"),
    EventKind.EARLY_STOPPED: (
        "running", "running", {"rung": 1, "step": 200, "metric": "eval loss", "value": 0.4123,
                               "cut": 0.37, "n": 9, "reduction_factor": 3},
        "stopped at rung 1, step 200: eval loss 0.4123 not in the top 1/3 (cut 0.37) of 9 trials",
    ),
    EventKind.MORE_RANKS_THAN_CORES: (
        "starting", "starting", {"nproc_per_node": 16, "cpus": 2, "batch_size": 8},
        "16 ranks on 2 CPU cores of this worker: the ranks share cores, so each step is slower; "
        "the global batch is 16 × batch_size 8 = 128 samples per step, which changes learning "
        "and accuracy against a run with fewer ranks (lower resources.nproc_per_node to 2 to "
        "match the cores)",
    ),
    EventKind.SCHEDULER_PENDING: (
        "starting", "starting", {"code": "Resources", "words": "waiting for the nodes"},
        "scheduler pending: Resources — waiting for the nodes",
    ),
    EventKind.CHECKPOINT_FAILED: (
        "running", "running", {"step": 20, "reason": "No space left on device"},
        "checkpoint at step 20 not written: No space left on device",
    ),
    EventKind.CHECKPOINT_DELETED: (
        "running", "running", {"step": 4, "keep": 2},
        "checkpoint at step 4 deleted: keep_checkpoints=2 keeps newer ones",
    ),
    EventKind.CHECKPOINT_DAMAGED: (
        "running", "running", {"step": 65},
        "checkpoint at step 65 found damaged at resume and deleted",
    ),
    EventKind.CHECKPOINT_UNPLACED: (
        "running", "running", {"step": 4},
        "checkpoint at step 4 deleted: its file could not be put in place",
    ),
    EventKind.FRESH_START: (
        "running", "running", {"attempt": 2, "damaged_steps": [65, 130]},
        "attempt 2 starts from step 0: no intact checkpoint (step 65, step 130 damaged)",
    ),
    EventKind.UPLOAD_FALLBACK: (
        "running", "running", {},
        "checkpoint transport: DDPQ_CHECKPOINT_TRANSPORT=shared, but rank 0's artifact root "
        "does not hold the API's store id (not the API's directory): uploading instead",
    ),
    EventKind.NOTHING_TO_TRAIN: (
        "running", "running", {"step": 50, "total_steps": 40},
        "init_from step 50 ≥ this job's 40 steps: nothing to train (raise training.max_steps "
        "or epochs, or use init_from.mode weights_only)",
    ),
    EventKind.QUOTA_EXCEEDED: (
        "running", "running",
        {"quota": "metric names per job", "limit": 5, "asked": 6,
         "setting": "DDPQ_METRIC_NAMES_PER_JOB", "unit": "names"},
        "metric names per job quota reached: 6 names asked, the limit is 5 names "
        "(raise DDPQ_METRIC_NAMES_PER_JOB)",
    ),
    EventKind.NOTE: ("running", "running", {"text": "something noted"}, "something noted"),
}  # fmt: skip
# Kinds first written after the migration that gave events their kinds (0007): no row holds
# an old text of theirs to read back.
BORN_WITH_KINDS = frozenset({EventKind.QUOTA_EXCEEDED})


def _migration() -> ModuleType:
    path = Path(__file__).parents[2] / "migrations" / "versions" / "0007_event_kinds.py"
    spec = importlib.util.spec_from_file_location("migration_0007", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_kind_has_a_wording_and_a_sample() -> None:
    assert set(WORDING) == set(EventKind), "add the new kind's wording to WORDING"
    assert set(SAMPLES) == set(EventKind), "add a sample of the new kind to SAMPLES"


@pytest.mark.parametrize("kind", list(EventKind))
def test_each_kind_renders_from_sample_data_as_the_code_wrote_it(kind: EventKind) -> None:
    from_state, to_state, data, text = SAMPLES[kind]
    assert render(kind, data) == text
    assert (from_state == to_state) == (kind in NOTE_KINDS) or kind in (
        EventKind.SWEEP_CANCELLED, EventKind.SWEEP_STOPPED,  # a cancel, or a flag: a note
    ), "a note keeps the state; any other kind changes it"  # fmt: skip
    required = [f for f in WORDING[kind].fields if not f.endswith("?")]
    assert set(required) <= set(data), f"the sample of {kind} lacks {required}"
    for field in required:
        with pytest.raises(KeyError):
            render(kind, {k: v for k, v in data.items() if k != field})
    assert f"`{kind}`" in describe_kinds()


def test_optional_parts_of_a_wording() -> None:
    assert render(EventKind.PREEMPTED) == "preempted"
    assert render(EventKind.FAILED) == "failed"
    assert render(EventKind.CANCELLED_OUTSIDE) == "cancelled outside ddpq"
    assert render(EventKind.FRESH_START, {"attempt": 3, "damaged_steps": []}) == (
        "attempt 3 starts from step 0: no intact checkpoint (none usable)"
    )
    assert render(EventKind.TRIAL_RETRIED, {"sweep_id": 1, "position": 0, "failed_job_id": 9}) == (
        "retry of failed job 9 (trial 0 of sweep 1)"
    )
    assert render(EventKind.SWEEP_CANCELLED, {"sweep_id": 1, "by": "bo"}) == (
        "sweep 1 cancelled by bo"
    )


def test_data_is_stored_json_safe_and_texts_are_cut() -> None:
    safe = json_safe({"value": math.nan, "cut": math.inf, "steps": [1, 2], "n": 3})
    assert safe == {"value": "nan", "cut": "inf", "steps": [1, 2], "n": 3}
    data = {**SAMPLES[EventKind.EARLY_STOPPED][2], "value": math.nan}
    assert "eval loss nan not in the top" in str(render(EventKind.EARLY_STOPPED, json_safe(data)))
    long = json_safe({"step": 1, "reason": "x" * 5000})
    assert len(long["reason"]) == MAX_REASON_CHARS
    assert len(str(render(EventKind.CHECKPOINT_FAILED, long))) == MAX_REASON_CHARS


@pytest.mark.parametrize("kind", [k for k in EventKind if k not in BORN_WITH_KINDS])
def test_the_backfill_reads_each_old_text_back_as_its_kind(kind: EventKind) -> None:
    """The migration's reader of texts written before events had kinds gives every sample
    its kind and data back (the one place in ddpq that parses an event's text)."""
    from_state, to_state, data, text = SAMPLES[kind]
    assert _migration().classify(from_state, to_state, text) == (kind.value, data)


def test_the_backfill_keeps_unknown_texts() -> None:
    classify = _migration().classify
    assert classify("running", "queued", "moved") == ("state_changed", {"reason": "moved"})
    assert classify("running", "failed", None) == ("failed", {})
    assert classify("running", "running", "odd") == ("note", {"text": "odd"})
    assert classify("running", "cancelled", "scancel") == (
        "cancelled_outside",
        {"detail": "scancel"},
    )
    assert classify(None, "queued", "by hand") == ("state_changed", {"reason": "by hand"})
    assert classify("running", "queued", "preempted") == ("preempted", {})


ROOT = Path(__file__).parents[2]
# Writing an event row anywhere but the one writer, or reading an event's kind from its text.
_FORBIDDEN = re.compile(
    r"insert\(JobEvent\)|JobEvent\(|JobEvent\.reason\.|reason\.startswith|"
    r"startswith\([^)]*reason|re\.(match|search)\([^)]*reason"
)


def test_one_writer_and_no_reader_of_event_texts() -> None:
    """Only ``service/store/events.py`` writes ``job_events`` rows, and no code finds an
    event's kind in its text (the migration that backfilled kinds aside)."""
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for package in ("service", "worker")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != ROOT / "service" / "store" / "events.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _FORBIDDEN.search(line) and "class JobEvent(" not in line
    ]
    assert not found, "write events with service.store.events and read kind/data:\n" + "\n".join(
        found
    )


def test_every_field_a_wording_names_has_a_type_and_every_sample_passes_the_check() -> None:
    """``check_data`` (what a worker's notes and transitions pass) accepts what the code
    writes, and knows the type of every field a wording names."""
    named = {f.rstrip("?") for w in WORDING.values() for f in w.fields}
    assert named == set(FIELD_TYPES)
    for kind, (_, _, data, _) in SAMPLES.items():
        check_data(kind, data)


@pytest.mark.parametrize(
    ("kind", "data", "words"),
    [
        (EventKind.RETRIED, {"restart": 1, "max_restarts": 2}, "needs error"),
        (EventKind.NOTE, {"text": "t", "more": 1}, "not more"),
        (
            EventKind.MORE_RANKS_THAN_CORES,
            {"nproc_per_node": 3, "cpus": 1, "batch_size": "ab"},
            "batch_size: int expected",
        ),
        (EventKind.MORE_RANKS_THAN_CORES, {"nproc_per_node": True, "cpus": 1}, "not a boolean"),
        (EventKind.FRESH_START, {"attempt": 2, "damaged_steps": [1, "2"]}, "list of integers"),
        (EventKind.CHECKPOINT_DELETED, {"step": 2**64, "keep": 1}, "out of range"),
    ],
)
def test_data_a_wording_cannot_word_is_refused_in_words(
    kind: EventKind, data: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        check_data(kind, data)
