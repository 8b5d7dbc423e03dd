"""sweeps: the sweeps and sweep_trials tables; jobs.sweep_id and jobs.trial_key

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 18:50:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("owner", sa.String(length=100), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("objective", sa.JSON(), nullable=False),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("max_failed", sa.Integer(), nullable=True),
        sa.Column("stop_reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweeps")),
    )
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.create_index("ix_sweeps_owner_id", ["owner", "id"], unique=False)
        batch_op.create_index("ix_sweeps_state", ["state"], unique=False)
    op.create_table(
        "sweep_trials",
        sa.Column("id", BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("sweep_id", sa.BigInteger(), nullable=False),
        sa.Column("trial_key", sa.String(length=64), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("overrides", sa.JSON(), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("rungs", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["sweep_id"],
            ["sweeps.id"],
            name=op.f("fk_sweep_trials_sweep_id_sweeps"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_sweep_trials_job_id_jobs"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweep_trials")),
        sa.UniqueConstraint(
            "sweep_id", "trial_key", name=op.f("uq_sweep_trials_sweep_id_trial_key")
        ),
    )
    with op.batch_alter_table("sweep_trials", schema=None) as batch_op:
        batch_op.create_index("ix_sweep_trials_job_id", ["job_id"], unique=False)
    # Plain ADD COLUMN (no foreign key), so SQLite does not rebuild the jobs table.
    op.add_column("jobs", sa.Column("sweep_id", sa.BigInteger(), nullable=True))
    op.add_column("jobs", sa.Column("trial_key", sa.String(length=64), nullable=True))
    op.create_index("ix_jobs_sweep_id_state", "jobs", ["sweep_id", "state"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_sweep_id_state", table_name="jobs")
    with op.batch_alter_table(
        "jobs", schema=None, table_kwargs={"sqlite_autoincrement": True}
    ) as batch_op:
        batch_op.drop_column("trial_key")
        batch_op.drop_column("sweep_id")
    with op.batch_alter_table("sweep_trials", schema=None) as batch_op:
        batch_op.drop_index("ix_sweep_trials_job_id")
    op.drop_table("sweep_trials")
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.drop_index("ix_sweeps_state")
        batch_op.drop_index("ix_sweeps_owner_id")
    op.drop_table("sweeps")
