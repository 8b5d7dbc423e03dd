"""Uploading a packed workspace: ask which files the API lacks, send only those (the small ones
many per request, ``service.core.wire.batch``; the others, and any a batch refused, each with
the checkpoint uploads' chunk protocol and loop, ``service.core.wire.chunks``), then store the
manifest. An unchanged directory sends no file; after editing one file, only that one goes.

The HTTP calls are ``WorkspaceApi``'s (``DdpqClient`` implements it); this module decides
what to send and in which order, and how to go on after a refused or misplaced chunk.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from service.core.errors import DdpqError
from service.core.wire.attempt import MIN_CHUNK_BYTES
from service.core.wire.batch import (
    BATCH_FILE_MAX_BYTES,
    BATCH_MAX_BYTES,
    BATCH_MAX_FILES,
    BatchAnswer,
)
from service.core.wire.chunks import MAX_CHUNK_REFUSALS, FileShrankError, send_file_chunks
from service.core.wire.workspace import (
    MAX_MISSING_FILES,
    FileRef,
    FileUploadStart,
    FileUploadStatus,
    Manifest,
    WorkspaceSummary,
    format_size,
)
from service.workspaces.calls import FileOffsetError
from service.workspaces.pack import PackedWorkspace

COMMITTED, ABANDONED = "committed", "abandoned"
# Batches sent at once after the first: one read and sent while the API stores another (more
# only add memory, 16 MiB each, on a 2-core API).
BATCHES_IN_FLIGHT = 2
# Commits of one file that found bytes missing (the API lost some), before giving up.
MAX_COMMIT_TRIES = 5


class WorkspaceUploadError(DdpqError):
    """A file could not be uploaded (refused chunks, an abandoned upload, a server whose
    digest differs); the message says which file and that running again resumes."""

    status_code = 502
    code = "workspace_upload_failed"


class WorkspaceApi(Protocol):
    """The workspace routes, as ``DdpqClient`` calls them (``service.workspaces.calls``).
    ``send_workspace_chunk``/``commit_workspace_file`` raise ``FileOffsetError`` for a 409
    that carries the upload's status; any other error answer is the client's own error
    (a ``DdpqError`` whose ``status_code`` is the answer's)."""

    def workspace_missing(self, files: Sequence[FileRef]) -> list[str]: ...
    def send_workspace_batch(self, files: Sequence[tuple[FileRef, bytes]]) -> BatchAnswer: ...
    def begin_workspace_file(self, start: FileUploadStart) -> FileUploadStatus: ...
    def send_workspace_chunk(
        self, upload_id: int, offset: int, data: bytes
    ) -> FileUploadStatus: ...
    def commit_workspace_file(self, upload_id: int) -> FileUploadStatus: ...
    def create_workspace(self, manifest: Manifest) -> WorkspaceSummary: ...


@dataclass(frozen=True)
class WorkspaceUpload:
    """What an upload did: the workspace (``digest``, ``file_count``, ``total_bytes``) and
    what was sent (``sent_files``, ``sent_bytes``; 0 and 0 when the API had every file) in
    ``elapsed_s`` seconds."""

    digest: str
    file_count: int
    total_bytes: int
    sent_files: int
    sent_bytes: int
    elapsed_s: float


def missing_files(api: WorkspaceApi, manifest: Manifest) -> list[FileRef]:
    """The distinct files (by sha256) of ``manifest`` the API lacks for the caller, asked in
    requests of at most ``MAX_MISSING_FILES``, in manifest order."""
    refs = {f.sha256: FileRef(sha256=f.sha256, size_bytes=f.size_bytes) for f in manifest.files}
    wanted = list(refs.values())
    missing: set[str] = set()
    for i in range(0, len(wanted), MAX_MISSING_FILES):
        missing.update(api.workspace_missing(wanted[i : i + MAX_MISSING_FILES]))
    return [ref for ref in wanted if ref.sha256 in missing]


def upload_packed(
    api: WorkspaceApi,
    packed: PackedWorkspace,
    *,
    on_file: Callable[[str, int], None] | None = None,
) -> WorkspaceUpload:
    """Send what the API lacks of ``packed``, then store its manifest.

    Args:
        api: the workspace routes (``DdpqClient``).
        packed: from ``pack_workspace`` (limits already checked).
        on_file: called with ``(path, size_bytes)`` once per file, before it is sent (a
            batch's files before the batch).

    Raises:
        WorkspaceUploadError: a file's chunks refused ``MAX_CHUNK_REFUSALS`` times in a row,
            an upload the API abandoned, or a digest that is not ours.
        FileShrankError: a file shrank since it was packed.
        The client's errors (unreachable API, refusals): running again resumes, the files
        already sent are not sent twice.
    """
    started = time.monotonic()
    sent_files = sent_bytes = 0
    path_of = {f.sha256: f.path for f in packed.manifest.files}  # one path per content
    missing = missing_files(api, packed.manifest)
    small = [ref for ref in missing if ref.size_bytes <= BATCH_FILE_MAX_BYTES]
    single = [ref for ref in missing if ref.size_bytes > BATCH_FILE_MAX_BYTES]
    sources = {ref.sha256: packed.sources[path_of[ref.sha256]] for ref in small}
    told: set[str] = set()

    def tell(ref: FileRef) -> None:  # once per file, though a batch may go again after a 413
        if on_file is not None and ref.sha256 not in told:
            told.add(ref.sha256)
            on_file(path_of[ref.sha256], ref.size_bytes)

    batched = _send_batches(api, small, sources, tell)
    for ref in small:
        if ref.sha256 in batched:
            sent_files += 1
            sent_bytes += ref.size_bytes
        else:  # refused, or batches too big for this API: one by one
            single.append(ref)
    for ref in single:
        path = path_of[ref.sha256]
        tell(ref)
        sent_bytes += _upload_file(api, ref, packed.sources[path])
        sent_files += 1
    summary = api.create_workspace(packed.manifest)
    if summary.digest != packed.digest:
        raise WorkspaceUploadError(
            f"the API stored the workspace as {summary.digest}, not {packed.digest}: client and "
            "server disagree on the digest (different ddpq versions?)"
        )
    return WorkspaceUpload(
        digest=summary.digest,
        file_count=summary.file_count,
        total_bytes=summary.total_bytes,
        sent_files=sent_files,
        sent_bytes=sent_bytes,
        elapsed_s=time.monotonic() - started,
    )


def _read_whole(ref: FileRef, source: Path) -> bytes:
    """The file's first ``ref.size_bytes`` bytes (a file grown since it was packed is then
    refused by the API, its sha256 not matching, and sent again alone to say so).

    Raises:
        FileShrankError: it is shorter than when it was packed.
    """
    with open(source, "rb") as fh:
        data = fh.read(ref.size_bytes)
    if len(data) != ref.size_bytes:
        raise FileShrankError(
            f"{source} ended at byte {len(data)} of {ref.size_bytes}: it changed while it "
            "was being sent"
        )
    return data


def _take_batch(pending: deque[FileRef], budget: int) -> list[FileRef]:
    """The next files of ``pending`` that fit one batch of ``budget`` bytes (taken off it)."""
    taken: list[FileRef] = []
    size = 0
    while pending and len(taken) < BATCH_MAX_FILES:
        if size + pending[0].size_bytes > budget:
            break
        taken.append(pending.popleft())
        size += taken[-1].size_bytes
    return taken


def _send_batches(
    api: WorkspaceApi,
    refs: Sequence[FileRef],
    sources: dict[str, Path],
    announce: Callable[[FileRef], None],
) -> set[str]:
    """Send the small files ``refs`` in batches of at most ``BATCH_MAX_FILES`` files and a
    byte budget; the sha256 of each file the API now has. Those refused, or left over, are
    not in it: send them one by one.

    The budget starts at ``BATCH_MAX_BYTES`` and halves on each 413 of the first batch (an
    API with a smaller chunk cap), down to ``MIN_CHUNK_BYTES``; once one batch went, the
    rest go ``BATCHES_IN_FLIGHT`` at once (the client reads and sends one while the API
    hashes and stores another). ``announce`` is called with each file before it is sent
    (again when its batch goes again after a 413).
    """
    pending = deque(refs)
    budget = BATCH_MAX_BYTES
    stored: set[str] = set()

    def send(taken: list[FileRef]) -> BatchAnswer:
        pairs = [(ref, _read_whole(ref, sources[ref.sha256])) for ref in taken]
        return api.send_workspace_batch(pairs)

    while pending and budget >= MIN_CHUNK_BYTES:  # the first batch, until one fits
        taken = _take_batch(pending, budget)
        if not taken:  # the next file alone is over the (shrunk) budget: one by one
            pending.popleft()
            continue
        for ref in taken:
            announce(ref)
        try:
            stored.update(send(taken).stored)
            break
        except DdpqError as exc:
            if exc.status_code != 413:
                raise
            budget //= 2  # the API's chunk cap is lower than ours: smaller batches
            pending.extendleft(reversed(taken))
    groups: list[list[FileRef]] = []
    while pending and budget >= MIN_CHUNK_BYTES:
        taken = _take_batch(pending, budget)
        if taken:
            groups.append(taken)
        else:
            pending.popleft()  # over the budget alone: one by one
    for taken in groups:
        for ref in taken:
            announce(ref)
    with ThreadPoolExecutor(BATCHES_IN_FLIGHT) as pool:
        for answer in pool.map(send, groups):  # an error ends the upload, as one at a time
            stored.update(answer.stored)
    return stored


def _upload_file(api: WorkspaceApi, ref: FileRef, source: Path) -> int:
    """Begin (or resume) one file's upload, send its missing chunks, commit; the bytes sent."""
    path = str(source)
    status = api.begin_workspace_file(FileUploadStart(sha256=ref.sha256, size_bytes=ref.size_bytes))
    refusals = sent = 0

    def accepted(_n: int) -> None:
        nonlocal refusals
        refusals = 0

    def recover(exc: Exception, status: FileUploadStatus) -> FileUploadStatus:
        nonlocal refusals
        if isinstance(exc, FileOffsetError):
            return exc.status
        if isinstance(exc, DdpqError) and exc.status_code == 422:  # arrived damaged: again
            refusals += 1
            if refusals >= MAX_CHUNK_REFUSALS:
                raise WorkspaceUploadError(
                    f"upload of {path}: {refusals} chunks in a row refused ({exc}); run again "
                    "to resume"
                ) from None
            return status
        raise exc

    with open(path, "rb") as fh:
        for _ in range(MAX_COMMIT_TRIES + 1):  # the last round only looks
            if status.state == COMMITTED:
                return sent
            if status.state == ABANDONED:
                raise WorkspaceUploadError(
                    f"the API abandoned the upload of {path} ({format_size(ref.size_bytes)}): "
                    "run again to start it over"
                )
            status, n = send_file_chunks(
                fh, status, ref.size_bytes, api.send_workspace_chunk, recover, on_accepted=accepted
            )
            sent += n
            if status.state != "receiving":
                continue
            try:
                status = api.commit_workspace_file(status.upload_id)
            except FileOffsetError as exc:  # bytes went missing (an API restart): resend
                status = exc.status
            except DdpqError as exc:
                if exc.status_code == 422:
                    raise WorkspaceUploadError(
                        f"the API refused {path}: its content is not what was packed (it "
                        f"changed meanwhile?): {exc}; run again"
                    ) from None
                raise
    raise WorkspaceUploadError(
        f"upload of {path}: the API did not commit it after {MAX_COMMIT_TRIES} tries; run again"
    )
