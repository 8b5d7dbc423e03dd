"""What the API checks before it records a shared-filesystem checkpoint
(``POST /attempts/self/checkpoints``): the file the rank names must really be there, in this
job's checkpoint directory of the filesystem store, with the size and sha256 the rank claims;
and the error every refused checkpoint input raises (422).

Without the check any attempt token could record a file that does not exist as the newest
checkpoint, and retention would then delete the real ones. The shared path is for shared
filesystems, where the API can read the file; with the database store there is no shared
directory, and the rank must upload.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from service.core.artifacts import artifact_relative_path, job_of_relative_path
from service.core.errors import DdpqError

_BLOCK = 1 << 20  # bytes read at a time while hashing


class CheckpointInputError(DdpqError):
    """A well-formed attempt request whose checkpoint cannot be accepted: a record whose file
    the server cannot verify (missing, another size or sha256, outside the job's checkpoint
    directory, no shared filesystem store), a chunk longer than allowed, empty, or not
    matching its sha256, an uploaded file not matching its sha256."""

    status_code = 422
    code = "invalid_attempt_input"


def storable_text(text: str) -> str:
    """``text`` without NUL and lone surrogates (neither database stores them)."""
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "\\0")


def own_checkpoint_path(root: Path, job_id: int, path: str) -> str:
    """``path`` as given, once it is known to resolve inside the job's own artifact directory
    (``jobs/<job_id>/`` under ``root``; symlinks followed), so a record can name no other
    job's file.

    Raises:
        CheckpointInputError: it lies elsewhere, or cannot be stored (NUL, lone surrogates).
    """
    if storable_text(path) != path:
        raise CheckpointInputError("checkpoint path holds NUL or a lone surrogate")
    relative = artifact_relative_path(root, path)
    if relative is None or job_of_relative_path(relative) != job_id:
        raise CheckpointInputError(
            f"checkpoint path must lie inside this job's artifact directory (jobs/{job_id}/ "
            "under the server's artifact root)"
        )
    return path


def _in_checkpoint_dir(root: Path, job_id: int, path: str) -> Path | None:
    """``path`` resolved (symlinks followed) when it lies in ``jobs/<job_id>/checkpoints/``
    under ``root``, else None."""
    relative = artifact_relative_path(root, path)
    if relative is None or job_of_relative_path(relative, under="checkpoints") != job_id:
        return None
    return root.resolve() / relative


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def shared_record_problem(
    root: Path,
    store_kind: str,
    job_id: int,
    *,
    path: str,
    staged_path: str | None,
    size_bytes: int,
    sha256: str,
) -> str | None:
    """Why a shared-filesystem record cannot be accepted, or None when it can.

    Blocking (reads the whole file to hash it): call it from a worker thread.

    Args:
        root: the API's artifact root (the filesystem store's directory).
        store_kind: ``Settings.checkpoint_store`` (``filesystem`` | ``database``).
        job_id: the attempt's job.
        path: where the checkpoint will lie (``CheckpointRecord.path``).
        staged_path: the written file not yet renamed to ``path`` (the rank records before
            it publishes), or None when the file is already at ``path``.
        size_bytes, sha256: what the rank says the file holds (bytes, lowercase hex).
    Returns:
        A reason for the 422 and the job's "checkpoint … not written" event.
    """
    if store_kind != "filesystem":
        return (
            "the server keeps checkpoints in its database, not on a shared filesystem: "
            "upload them (DDPQ_CHECKPOINT_TRANSPORT=upload or auto)"
        )
    final = _in_checkpoint_dir(root, job_id, path)
    file = _in_checkpoint_dir(root, job_id, staged_path) if staged_path else final
    if final is None or file is None:
        return (
            f"checkpoint path must lie inside this job's checkpoint directory (jobs/{job_id}/"
            "checkpoints/ under the server's artifact root); a rank that does not share the "
            "server's filesystem must upload"
        )
    try:
        if not file.is_file():
            return f"the server finds no file {file.name} in jobs/{job_id}/checkpoints/"
        actual_size = file.stat().st_size
        if actual_size != size_bytes:
            return f"{file.name} holds {actual_size} bytes on the server, not {size_bytes}"
        if _sha256(file) != sha256:
            return f"{file.name}'s sha256 on the server is not the one recorded"
    except OSError as exc:
        return f"the server cannot read {file.name}: {exc.strerror or exc}"
    return None
