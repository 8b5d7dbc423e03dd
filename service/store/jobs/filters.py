"""Text filters of the job list: a name substring, an exact tag (tags live in the spec's JSON).

The tag test is SQL on both databases (no schema change, no scan in Python), so the cursor
paging of ``jobs.list_jobs`` stays one indexed query whatever the filter.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, cast, column, exists, func, literal, or_, select
from sqlalchemy.dialects.postgresql import JSONB

from service.store.models import Job


def has_tag(dialect: str, tag: str) -> ColumnElement[bool]:
    """True for the jobs whose ``spec.tags`` holds exactly ``tag`` (case-sensitive).

    ``dialect``: the session's dialect name (``"postgresql"`` or ``"sqlite"``).
    """
    if dialect == "postgresql":
        # The column is json: cast to jsonb for containment (@>) of a one-tag array.
        return cast(Job.spec, JSONB)["tags"].contains([tag])
    tags = func.json_each(Job.spec, "$.tags").table_valued("value")
    return exists(select(literal(1)).select_from(tags).where(column("value") == tag))


def name_or_tag(dialect: str, q: str) -> ColumnElement[bool]:
    """True for the jobs whose name contains ``q`` (case-insensitive on both databases: LIKE
    is case-sensitive on PostgreSQL only, so both sides are lowered) or that carry the tag
    ``q`` exactly. ``%`` and ``_`` in ``q`` match themselves."""
    name = func.lower(Job.name).contains(q.lower(), autoescape=True)
    return or_(name, has_tag(dialect, q))
