"""The rank's side of the metric-name quota (``worker.runtime.metrics.names.NameQuota``): what
the sink sends in a refused batch's place, from the refusal's ``stored_names``."""

from __future__ import annotations

from service.core.metrics.points import CheckedPoint, MetricPoint, checked_point
from worker.runtime.metrics.names import NameQuota, answered_names


def batch(*names: str, step: int = 1) -> list[CheckedPoint]:
    return [checked_point(MetricPoint(name, step, 1.0)) for name in names]


def test_a_refused_batch_is_sent_again_with_only_the_names_the_api_says_the_job_has() -> None:
    quota = NameQuota()  # a resumed attempt: it knows no name yet
    again = quota.refused(batch("loss", "acc", "n1", "n2"), ["acc", "loss"])
    assert [p.name for p in again] == ["loss", "acc"] and quota.dropped == 2
    assert quota.full
    # From then on, new names are dropped before they are sent; known ones go on.
    assert [p.name for p in quota.admit(batch("loss", "n3", step=2))] == ["loss"]
    assert quota.dropped == 3


def test_the_answer_wins_over_what_the_rank_believed_it_had_stored() -> None:
    quota = NameQuota()
    quota.note_stored(batch("loss", "gone"))  # "gone" was taken, then superseded away
    again = quota.refused(batch("loss", "gone", "new"), ["loss"])
    assert [p.name for p in again] == ["loss"]
    assert quota.stored == {"loss"}


def test_a_batch_refused_though_every_name_is_the_jobs_is_dropped_not_resent() -> None:
    quota = NameQuota()
    assert quota.refused(batch("loss", "acc"), ["acc", "loss"]) == []  # never a resend loop
    assert quota.dropped == 2


def test_without_the_field_only_names_this_attempt_stored_go_on() -> None:
    quota = NameQuota()
    quota.note_stored(batch("loss"))
    assert [p.name for p in quota.refused(batch("loss", "n1"), None)] == ["loss"]
    assert answered_names({"detail": "…"}) is None
    assert answered_names({"stored_names": ["a", 3, None, "b"]}) == ["a", "b"]
    assert answered_names({"stored_names": "a"}) is None
