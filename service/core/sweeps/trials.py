"""The trials table's query vocabulary: the columns it sorts by, and the delta poll's window.

One fact each, shared by the store (which sorts and filters) and the API (which validates
``sort`` and turns ``changed_since`` into a time).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

# Columns of the trials table a page may be sorted by (the API's field names), plus
# ``overrides.<dotted.path>`` for an override's value. Missing values sort last either way.
TRIAL_SORT_FIELDS = (
    "position",
    "job_id",
    "outcome",
    "objective_value",
    "steps_done",
    "attempts",
    "run_time_s",
)
OVERRIDE_SORT_PREFIX = "overrides."
TRIAL_SORT_PATTERN = (
    "^(" + "|".join(TRIAL_SORT_FIELDS) + "|" + re.escape(OVERRIDE_SORT_PREFIX) + r"[^\x00]+)$"
)

# A delta poll's next ``changed_since`` is the time its read began minus this overlap: a job
# row is stamped (``jobs.updated_at``, the writer's clock) before its transaction commits,
# so a row committed up to this long after the stamp, or stamped by an API process whose
# clock is this much behind, is still in the next answer. Clients dedupe by trial key.
CHANGED_OVERLAP_S = 5.0


def next_changed_since(read_started_at: datetime) -> datetime:
    """The ``changed_since`` a client sends with its next delta poll, for a read that began
    at ``read_started_at`` (tz-aware UTC): ``CHANGED_OVERLAP_S`` earlier."""
    return read_started_at - timedelta(seconds=CHANGED_OVERLAP_S)
