"""worker tokens: api_tokens.kind (user | worker) and name; workers.token_id

A worker reaches only the API, with a worker token (``ddpq token create --worker``). The
token's row says which kind it is; a worker's row says which token registered it, so a token
acts only for the workers it registered (and their jobs).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("kind", sa.String(length=16), nullable=False, server_default="user")
        )
        batch_op.add_column(sa.Column("name", sa.String(length=100), nullable=True))
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("token_id", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("token_id")
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.drop_column("name")
        batch_op.drop_column("kind")
