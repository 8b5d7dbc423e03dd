"""sweeps.idempotency_key: a retried POST /sweeps returns the sweep it made

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 19:45:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("idempotency_key", sa.String(length=200), nullable=True))
        batch_op.create_unique_constraint(
            batch_op.f("uq_sweeps_owner_idempotency_key"), ["owner", "idempotency_key"]
        )


def downgrade() -> None:
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_sweeps_owner_idempotency_key"), type_="unique")
        batch_op.drop_column("idempotency_key")
