"""The checkpoint stores of one API process, built from its settings, and what the store
layer does with their bytes: serve a committed file, delete the files a transaction let go,
drop abandoned partial uploads. The rows decide (``retention``, ``uploads``); these
functions act only after that transaction committed, so a rolled-back one never leaves a
live row without its file."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import TypeAlias

from service.core.config import Settings
from service.core.errors import DdpqError, NotFoundError
from service.store.checkpoints.backends.base import CheckpointStore, CheckpointStoreError
from service.store.checkpoints.backends.database import DatabaseStore
from service.store.checkpoints.backends.filesystem import FilesystemStore
from service.store.checkpoints.values import DoomedFile, PendingDiscard, StoredFile
from service.store.db import Database

log = logging.getLogger(__name__)

# Every backend by name (a checkpoints row names its own ``store``).
CheckpointStores: TypeAlias = Mapping[str, CheckpointStore]


class StoredFileDamagedError(DdpqError):
    """The store holds another number of bytes than the checkpoint's row recorded (the file
    was truncated or replaced behind the service's back): no byte of it is served."""

    status_code = 410
    code = "checkpoint_damaged"


def make_stores(settings: Settings, db: Database) -> dict[str, CheckpointStore]:
    """Every backend by name, touching nothing yet (no I/O). A checkpoints row names its own
    ``store``, so a file stays readable after ``DDPQ_CHECKPOINT_STORE`` changed; new
    uploads go to ``stores[settings.checkpoint_store]``."""
    return {
        "filesystem": FilesystemStore(settings.resolved_artifact_dir),
        "database": DatabaseStore(db, max_bytes=settings.checkpoint_db_max_bytes),
    }


def shared_store_id(stores: CheckpointStores, upload_store: str) -> str | None:
    """The filesystem store's id when uploads go there (``upload_store``: the name of the
    store they go to): a rank whose artifact root holds the same id shares this filesystem.
    None for another store, or when the id cannot be read or written (then every rank
    uploads, which works whatever the hosts share)."""
    store = stores.get(upload_store)
    if not isinstance(store, FilesystemStore):
        return None
    try:
        return store.store_id()
    except CheckpointStoreError as exc:
        log.warning("no checkpoint store id: %s", exc.detail)
        return None


def verify_stored(stores: CheckpointStores, stored: StoredFile) -> None:
    """Check that ``stored``'s store still holds its bytes, all of them, before any is served.

    Raises:
        NotFoundError: no such store here, or no file at its location any more (404).
        StoredFileDamagedError: the store holds another size than recorded (410: a body cut
            short of its ``Content-Length`` would look like a network fault, and the receiver
            would retry it).
    """
    store = stores.get(stored.store)
    if store is None:
        raise NotFoundError(f"checkpoint store {stored.store!r} is not available here")
    held = store.size(stored.location)
    if held is None:
        raise NotFoundError("checkpoint file not found")
    if held != stored.size_bytes:
        raise StoredFileDamagedError(
            f"stored file is {held} bytes, recorded {stored.size_bytes}: the checkpoint is "
            "damaged, use an earlier one"
        )


def read_stored(stores: CheckpointStores, stored: StoredFile, start: int = 0) -> Iterator[bytes]:
    """The bytes of a verified ``stored`` file from byte ``start``, in blocks (never the whole
    file in memory; blocking: iterate it in a worker thread).

    Raises:
        NotFoundError: the file went away since ``verify_stored``.
    """
    store = stores.get(stored.store)
    if store is None:
        raise NotFoundError(f"checkpoint store {stored.store!r} is not available here")
    return store.open_read(stored.location, start)


def delete_files(stores: CheckpointStores, doomed: Iterable[DoomedFile]) -> None:
    """Remove the doomed files from their stores; a failure is logged, never raised (the rows
    are already marked deleted: nothing serves the file any more)."""
    for d in doomed:
        store = stores.get(d.store)
        if store is None:
            log.warning("job_id=%d: no checkpoint store %r for step %d", d.job_id, d.store, d.step)
            continue
        try:
            store.delete(d.location)
        except Exception:
            log.exception("job_id=%d: could not delete checkpoint step %d", d.job_id, d.step)


def discard_partials(stores: CheckpointStores, discards: Iterable[PendingDiscard]) -> None:
    """Drop the bytes of abandoned partial uploads from their stores (a store not configured
    here is skipped)."""
    for d in discards:
        store = stores.get(d.store)
        if store is not None:
            store.discard(d.key)
