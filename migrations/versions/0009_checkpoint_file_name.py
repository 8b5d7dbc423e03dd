"""checkpoints.file_name: the workspace file a followed checkpoint is a version of

A command job's ``checkpoints.path`` (a file or glob its script writes) is followed: each
completed version is a checkpoint, put back at its file name before the next attempt. The
upload carries the name from its begin to the commit that writes the row.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Batch mode on SQLite, as the others do (render_as_batch in env.py).
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("file_name", sa.Text(), nullable=True))
    with op.batch_alter_table("checkpoint_uploads", schema=None) as batch_op:
        batch_op.add_column(sa.Column("file_name", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoint_uploads", schema=None) as batch_op:
        batch_op.drop_column("file_name")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_column("file_name")
