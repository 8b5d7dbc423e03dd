"""metric_rollups: per-(job, name) step buckets of count, min, max, first and last

Kept at write time by the metric ingest (``service.store.metrics.rollups``) so a chart reads
buckets, not every point. This migration backfills the buckets of every stored point, with
one window query per level that both databases run alike; the levels are the code's
``rollups.LEVELS`` at the time of writing, copied here so a later change of the code does not
change what this revision does.

Revision ID: 0012
Revises: 0011
Create Date: 2027-02-01 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LEVELS = (6, 9, 12, 15)


def _backfill(level: int) -> str:
    part = f"PARTITION BY job_id, name, step >> {level}"
    return (
        "INSERT INTO metric_rollups (job_id, name, level, bucket, count, min_step, min_value, "
        "max_step, max_value, first_step, first_value, last_step, last_value) "
        f"SELECT job_id, name, {level}, bucket, count(*), "
        "max(CASE WHEN rn_min = 1 THEN step END), max(CASE WHEN rn_min = 1 THEN value END), "
        "max(CASE WHEN rn_max = 1 THEN step END), max(CASE WHEN rn_max = 1 THEN value END), "
        "min(step), max(CASE WHEN rn_first = 1 THEN value END), "
        "max(step), max(CASE WHEN rn_last = 1 THEN value END) "
        f"FROM (SELECT job_id, name, step, value, step >> {level} AS bucket, "
        # NULL (NaN) after every number, ties to the smaller step: the read-time order.
        f"row_number() OVER ({part} ORDER BY value IS NULL, value, step) AS rn_min, "
        f"row_number() OVER ({part} ORDER BY value IS NULL, value DESC, step) AS rn_max, "
        f"row_number() OVER ({part} ORDER BY step) AS rn_first, "
        f"row_number() OVER ({part} ORDER BY step DESC) AS rn_last "
        "FROM metrics) AS ranked GROUP BY job_id, name, bucket"
    )


def upgrade() -> None:
    op.create_table(
        "metric_rollups",
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("level", sa.SmallInteger(), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("min_step", sa.BigInteger(), nullable=False),
        sa.Column("min_value", sa.Float(), nullable=True),
        sa.Column("max_step", sa.BigInteger(), nullable=False),
        sa.Column("max_value", sa.Float(), nullable=True),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("first_value", sa.Float(), nullable=True),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("last_value", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_metric_rollups_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint(
            "job_id", "name", "level", "bucket", name=op.f("pk_metric_rollups")
        ),
    )
    for level in _LEVELS:
        op.execute(_backfill(level))


def downgrade() -> None:
    op.drop_table("metric_rollups")
