"""metric provenance and history: metrics.ranks, metrics_superseded, job_attempts

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 19:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INCLUDE_BEFORE = ["attempt", "epoch", "value", "time"]
_INCLUDE_AFTER = [*_INCLUDE_BEFORE, "ranks"]


def _rebuild_metrics_key(include: list[str]) -> None:
    """PostgreSQL: the metrics primary key again, covering ``include`` (polls stay
    index-only). SQLite has no INCLUDE: nothing to do."""
    if op.get_bind().dialect.name != "postgresql":
        return
    # One ALTER TABLE: the table is never without its key (nor a second copy of it).
    op.execute(
        "ALTER TABLE metrics DROP CONSTRAINT pk_metrics, "
        "ADD CONSTRAINT pk_metrics PRIMARY KEY (job_id, name, step) "
        f"INCLUDE ({', '.join(include)})"
    )


def upgrade() -> None:
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.add_column(sa.Column("ranks", sa.SmallInteger(), nullable=True))
    _rebuild_metrics_key(_INCLUDE_AFTER)
    op.create_table(
        "metrics_superseded",
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=True),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ranks", sa.SmallInteger(), nullable=True),
        sa.Column("superseded_by", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_metrics_superseded_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "job_id", "name", "step", "attempt", name=op.f("pk_metrics_superseded")
        ),
    )
    op.create_table(
        "job_attempts",
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("resume_step", sa.BigInteger(), nullable=True),
        sa.Column("restore_s", sa.Float(), nullable=True),
        sa.Column("training_started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("checkpoint_stall_s", sa.Float(), nullable=True),
        sa.Column("checkpoint_saves", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_attempts_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "attempt", name=op.f("pk_job_attempts")),
    )


def downgrade() -> None:
    op.drop_table("job_attempts")
    op.drop_table("metrics_superseded")
    _rebuild_metrics_key(_INCLUDE_BEFORE)
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.drop_column("ranks")
