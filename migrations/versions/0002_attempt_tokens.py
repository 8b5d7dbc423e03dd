"""attempt tokens: a rank's per-attempt bearer token, stored hashed

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 16:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "attempt_tokens",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_attempt_tokens_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempt_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_attempt_tokens_token_hash")),
    )
    # Batch mode on SQLite, as 0001 does (render_as_batch in env.py).
    with op.batch_alter_table("attempt_tokens", schema=None) as batch_op:
        batch_op.create_index("ix_attempt_tokens_job_id", ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("attempt_tokens", schema=None) as batch_op:
        batch_op.drop_index("ix_attempt_tokens_job_id")
    op.drop_table("attempt_tokens")
