"""jobs.metric_window_at, jobs.metric_window_points: the per-job metric points rate window

The points one job stored in its current one-minute window (``DDPQ_METRIC_POINTS_PER_MINUTE``),
kept on the job's row: the metric ingest already locks and updates that row in its one
statement, so the count holds across API processes with no extra statement or table.

Revision ID: 0011
Revises: 0010
Create Date: 2027-01-20 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE ADD COLUMN, not batch mode: a batch may copy the jobs table on SQLite,
    # and dropping the old copy would cascade to every row that references a job (events).
    op.add_column("jobs", sa.Column("metric_window_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("metric_window_points", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # ALTER TABLE DROP COLUMN: SQLite ≥ 3.35 has it (no copy of the table either).
    op.drop_column("jobs", "metric_window_points")
    op.drop_column("jobs", "metric_window_at")
