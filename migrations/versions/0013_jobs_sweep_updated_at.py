"""ix_jobs_sweep_id_updated_at: a sweep's jobs by their stamp, for the trials delta poll

``GET /sweeps/{id}/trials?changed_since=`` reads the sweep's jobs with ``updated_at`` at or
after a time (``service.store.sweeps.view``): with this index a range scan of the few that
changed, where ix_jobs_sweep_id_state made it read every job of the sweep.

Revision ID: 0013
Revises: 0012
Create Date: 2027-02-10 10:00:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain CREATE INDEX, not batch mode: a batch may copy the jobs table on SQLite (0011).
    op.create_index("ix_jobs_sweep_id_updated_at", "jobs", ["sweep_id", "updated_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_sweep_id_updated_at", table_name="jobs")
