"""The stores of workspace file bytes: the checkpoint store backends
(``service.store.checkpoints.backends``), over workspace places of their own. The filesystem
store keeps partials and files under ``<artifact root>/workspaces/files/``; the database store keeps
chunk rows in ``workspace_chunks``. A workspace upload has no job or step: its ``UploadKey``
carries 0 for both, and only ``upload_id`` names its bytes."""

from __future__ import annotations

from pathlib import Path

from service.core.artifacts import workspace_file_path, workspace_upload_path
from service.core.config import Settings
from service.store.checkpoints.backends.base import CheckpointStore, UploadKey
from service.store.checkpoints.backends.database import DatabaseStore
from service.store.checkpoints.backends.filesystem import FilesystemStore
from service.store.db import Database
from service.store.models import WorkspaceChunk


class WorkspaceFilesystemStore(FilesystemStore):
    """The filesystem store with workspace names: ``workspaces/files/.upload-<id>.part``
    while it arrives, ``workspaces/files/upload-<id>`` once finalized (the ``location``)."""

    def _partial(self, key: UploadKey) -> Path:
        return workspace_upload_path(self.root, key.upload_id)

    def _final(self, key: UploadKey) -> Path:
        return workspace_file_path(self.root, key.upload_id)


def upload_key(upload_id: int) -> UploadKey:
    """The store key of workspace upload ``upload_id``."""
    return UploadKey(upload_id=upload_id, job_id=0, step=0)


def make_workspace_stores(settings: Settings, db: Database) -> dict[str, CheckpointStore]:
    """Every backend by name, touching nothing yet (no I/O); new uploads go to
    ``stores[settings.checkpoint_store]``, a file row names its own store."""
    return {
        "filesystem": WorkspaceFilesystemStore(settings.resolved_artifact_dir),
        "database": DatabaseStore(
            db, max_bytes=settings.checkpoint_db_max_bytes, chunks=WorkspaceChunk
        ),
    }
