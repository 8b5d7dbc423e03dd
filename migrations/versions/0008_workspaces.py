"""workspaces: manifests by digest, content-addressed files per owner, their uploads

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 11:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "workspace_uploads",
        sa.Column("id", BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("owner", sa.String(length=100), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("received_bytes", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("store", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workspace_uploads")),
    )
    with op.batch_alter_table("workspace_uploads", schema=None) as batch_op:
        batch_op.create_index(
            "ix_workspace_uploads_owner_sha256", ["owner", "sha256"], unique=False
        )
        batch_op.create_index(
            "ix_workspace_uploads_state_updated_at", ["state", "updated_at"], unique=False
        )
    op.create_table(
        "workspace_chunks",
        sa.Column("upload_id", sa.BigInteger(), nullable=False),
        sa.Column("offset_bytes", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["upload_id"],
            ["workspace_uploads.id"],
            name=op.f("fk_workspace_chunks_upload_id_workspace_uploads"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("upload_id", "offset_bytes", name=op.f("pk_workspace_chunks")),
    )
    op.create_table(
        "workspace_files",
        sa.Column("id", BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("owner", sa.String(length=100), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("store", sa.String(length=16), nullable=False),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("upload_id", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["upload_id"],
            ["workspace_uploads.id"],
            name=op.f("fk_workspace_files_upload_id_workspace_uploads"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workspace_files")),
        sa.UniqueConstraint("owner", "sha256", name=op.f("uq_workspace_files_owner_sha256")),
    )
    with op.batch_alter_table("workspace_files", schema=None) as batch_op:
        batch_op.create_index("ix_workspace_files_last_used_at", ["last_used_at"], unique=False)
    op.create_table(
        "workspaces",
        sa.Column("id", BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("owner", sa.String(length=100), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("manifest", sa.JSON(), nullable=False),
        sa.Column("file_count", sa.Integer(), nullable=False),
        sa.Column("total_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workspaces")),
        sa.UniqueConstraint("owner", "digest", name=op.f("uq_workspaces_owner_digest")),
    )
    with op.batch_alter_table("workspaces", schema=None) as batch_op:
        batch_op.create_index("ix_workspaces_last_used_at", ["last_used_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("workspaces", schema=None) as batch_op:
        batch_op.drop_index("ix_workspaces_last_used_at")
    op.drop_table("workspaces")
    with op.batch_alter_table("workspace_files", schema=None) as batch_op:
        batch_op.drop_index("ix_workspace_files_last_used_at")
    op.drop_table("workspace_files")
    op.drop_table("workspace_chunks")
    with op.batch_alter_table("workspace_uploads", schema=None) as batch_op:
        batch_op.drop_index("ix_workspace_uploads_state_updated_at")
        batch_op.drop_index("ix_workspace_uploads_owner_sha256")
    op.drop_table("workspace_uploads")
