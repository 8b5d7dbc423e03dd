"""A command job's workspace, brought onto this host through the attempt API.

Every rank of a node calls ``materialize``; an exclusive lock on a file in the attempt
directory lets the first one fetch while the others wait, and a marker file tells them it is
complete. So each host (each Slurm node) fetches through the API with the attempt's token,
and no shared filesystem is assumed. Each file is verified by size and sha256 (the manifest's)
and kept in the host's cache of this Unix user by sha256 (``user_workspace_cache_dir``), so a
host fetches a file once whatever job of that user names it; the working directory gets a
copy, owned by the ranks' user and writable (scripts write next to themselves).

What lands on disk is bounded by the manifest's rules (``service.core.wire.workspace``,
checked again here: the manifest crossed a network): relative normalised paths only, regular
files only, created by this code in a directory it just made, so no path of a manifest can
reach outside it (no ``..``, no absolute path, no symlink is ever created or followed).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from service.core.artifacts import attempt_dir, user_workspace_cache_dir, workspace_dir
from service.core.errors import DdpqError, StaleAttemptError
from service.core.wire import workspace as wire
from worker.attempt import FailureReason
from worker.runtime.attempt_client import ApiUnavailableError, AttemptClient, AttemptRequestError
from worker.runtime.checkpoints.fetch import CheckpointFetchError, fetch_file, verified

log = logging.getLogger(__name__)
LOCK_NAME = ".workspace.lock"
DONE_NAME = ".workspace.done"
MANIFEST_TRIES = 5


class WorkspaceFetchError(DdpqError):
    """The job's workspace could not be brought onto this host intact (the message says why).
    A setup failure: the same attempt relaunched would find the same workspace."""

    status_code = 502
    code = "workspace_fetch_failed"
    reason = FailureReason.SETUP


def materialize(
    client: AttemptClient,
    artifact_dir: Path,
    job_id: int,
    attempt: int,
    then: Callable[[Path], object] | None = None,
) -> Path:
    """This attempt's working directory on this host, with every file of the job's workspace.

    Args:
        then: called with the directory once its files are in place, by the rank that fetched
            them and before the others see it complete (e.g. restore a followed checkpoint).
    Returns:
        The directory (``workspace_dir``), complete and verified.
    Raises:
        WorkspaceFetchError: the API refused or kept failing, the manifest is not valid, or
            a file did not verify.
        StaleAttemptError: the attempt was fenced off.
    """
    root = workspace_dir(artifact_dir, job_id, attempt)
    parent = attempt_dir(artifact_dir, job_id, attempt)
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / LOCK_NAME, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        if (parent / DONE_NAME).exists():
            return root
        if root.exists():  # a rank that died half-way through: start over
            shutil.rmtree(root)
        root.mkdir()
        manifest = _manifest(client)
        cache = _usable_cache(user_workspace_cache_dir(artifact_dir, os.getuid()))
        for f in manifest.files:
            _place(client, f, root, cache, parent)
        if then is not None:
            then(root)
        (parent / DONE_NAME).touch()
    count = manifest.file_count
    log.info(
        "workspace: %d file%s, %s, in %s",
        count,
        "" if count == 1 else "s",
        wire.format_size(manifest.total_bytes),
        root,
    )
    return root


def _manifest(client: AttemptClient) -> wire.Manifest:
    """The job's manifest (parsed and checked by ``Manifest``: it crossed a network), asked
    up to ``MANIFEST_TRIES`` times while the API is unavailable."""
    for tries in range(1, MANIFEST_TRIES + 1):
        try:
            return client.workspace_manifest()
        except StaleAttemptError:
            raise
        except ApiUnavailableError as exc:
            if tries == MANIFEST_TRIES:
                raise WorkspaceFetchError(
                    f"could not read the job's workspace ({tries} tries): {exc.detail}"
                ) from None
            log.warning("workspace manifest: %s; asking again", exc.detail)
            time.sleep(min(0.5 * 2**tries, 5.0))
        except DdpqError as exc:
            raise WorkspaceFetchError(f"could not read the job's workspace: {exc.detail}") from None
    raise AssertionError("unreachable")


def _usable_cache(cache: Path) -> Path | None:
    """The host's cache directory, or None when this user cannot write it (then every file
    is fetched straight into the working directory)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return cache if os.access(cache, os.W_OK | os.X_OK) else None


def _place(
    client: AttemptClient, f: wire.WorkspaceFile, root: Path, cache: Path | None, tmp_dir: Path
) -> None:
    """Fetch (or take from the cache) one file and write it at ``root / f.path``."""
    if wire.path_problem(f.path) is not None:  # the model checked it; a second look is cheap
        raise WorkspaceFetchError(f"workspace path {f.path!r} is not allowed")
    dest = root.joinpath(*f.path.split("/"))
    url = wire.ATTEMPT_WORKSPACE_FILE_PATH.format(sha256=f.sha256)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if cache is None:
            # Staged under its sha256, then moved: fetch_file's temp name adds to the file's
            # own, which may already be NAME_MAX (255 bytes) long.
            staged = tmp_dir / f".workspace-{f.sha256}"
            fetch_file(
                client, url, staged, size_bytes=f.size_bytes, sha256=f.sha256, tmp_dir=tmp_dir
            )
            os.replace(staged, dest)
        else:
            cached = cache / f.sha256[:2] / f.sha256
            if not verified(cached, f.size_bytes, f.sha256):
                fetch_file(
                    client, url, cached, size_bytes=f.size_bytes, sha256=f.sha256,
                    tmp_dir=cached.parent,
                )  # fmt: skip
            shutil.copyfile(cached, dest, follow_symlinks=False)
            if not verified(dest, f.size_bytes, f.sha256):  # the cache is shared: check
                raise WorkspaceFetchError(f"workspace file {f.path}: its cached copy changed")
    except (CheckpointFetchError, AttemptRequestError) as exc:
        # AttemptRequestError: the API refused the file (404: its stored bytes are gone or
        # cut short), not retryable; still this workspace's failure, a setup failure.
        raise WorkspaceFetchError(f"workspace file {f.path}: {exc.detail}") from None
    except OSError as exc:  # a full disk, a quota: this host cannot hold the workspace
        raise WorkspaceFetchError(f"workspace file {f.path}: cannot write it here: {exc}") from None
    with contextlib.suppress(OSError):
        os.chmod(dest, f.mode)
