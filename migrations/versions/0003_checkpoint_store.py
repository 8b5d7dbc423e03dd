"""checkpoint store: uploads through the attempt API, chunked rows, init_from pins

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 19:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # Batch mode on SQLite, as 0001 does (render_as_batch in env.py).
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("store", sa.String(length=16), server_default="filesystem", nullable=False)
        )
        batch_op.add_column(sa.Column("location", sa.Text(), server_default="", nullable=False))
        batch_op.add_column(sa.Column("committed_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("resumed_by_attempt", sa.Integer(), nullable=True))
    # Every checkpoint recorded so far is a file in the artifact directory, committed when
    # it was recorded.
    op.execute("UPDATE checkpoints SET location = path, committed_at = created_at")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("init_from_job_id", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("init_from_step", sa.BigInteger(), nullable=True))
        batch_op.create_index("ix_jobs_init_from_job_id", ["init_from_job_id"], unique=False)
    op.create_table(
        "checkpoint_uploads",
        sa.Column("id", BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("received_bytes", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("store", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_checkpoint_uploads_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_uploads")),
    )
    with op.batch_alter_table("checkpoint_uploads", schema=None) as batch_op:
        batch_op.create_index(
            "ix_checkpoint_uploads_job_id_state", ["job_id", "state"], unique=False
        )
    op.create_table(
        "checkpoint_chunks",
        sa.Column("upload_id", sa.BigInteger(), nullable=False),
        sa.Column("offset_bytes", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["upload_id"],
            ["checkpoint_uploads.id"],
            name=op.f("fk_checkpoint_chunks_upload_id_checkpoint_uploads"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("upload_id", "offset_bytes", name=op.f("pk_checkpoint_chunks")),
    )


def downgrade() -> None:
    op.drop_table("checkpoint_chunks")
    with op.batch_alter_table("checkpoint_uploads", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoint_uploads_job_id_state")
    op.drop_table("checkpoint_uploads")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_init_from_job_id")
        batch_op.drop_column("init_from_step")
        batch_op.drop_column("init_from_job_id")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_column("resumed_by_attempt")
        batch_op.drop_column("committed_at")
        batch_op.drop_column("location")
        batch_op.drop_column("store")
