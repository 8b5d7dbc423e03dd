"""Where a rank starts from: its job's newest committed checkpoint (resume), else the
checkpoint the spec's ``init_from`` names, else nothing; and fetching either onto this host.

A checkpoint is used only once its file on this host has the recorded size and sha256. A file
that is not here (another host wrote it, the API keeps it in another store) is downloaded
through the attempt API (``CHECKPOINT_FILE_PATH`` / ``INIT_FILE_PATH``): streamed to a temp file
in the attempt's directory, resumed with ``Range`` after a cut, verified, then renamed into
place. If the newest cannot be had, the previous committed one is tried.

Rank 0 decides and broadcasts; then the first rank of every other node makes sure the same
file is on its node (a no-op where the nodes share the directory: the file verifies), and all
ranks agree that every node has it before anyone loads it. On one node all ranks share the
directory rank 0 fetched into.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist

from service.core import artifacts
from service.core.errors import DdpqError, StaleAttemptError
from service.core.wire import attempt as wire
from worker.runtime.attempt_client import (
    ApiUnavailableError,
    AttemptClient,
    AttemptRequestError,
    StoredFileDamagedError,
)
from worker.runtime.checkpoints.files import file_sha256
from worker.runtime.checkpoints.transport import local_store_id
from worker.runtime.distributed import DistContext, broadcast_int

log = logging.getLogger(__name__)
# How long rank 0 keeps asking for the checkpoint list at resume while the API is down
# (seconds); the other ranks wait in the broadcast meanwhile (well under the pg timeout).
RESUME_LIST_WAIT_S = 120.0
# Cuts in a row (no byte gained) before a download is given up; each resumes with Range.
DOWNLOAD_TRIES = 5
# The broadcast code of an init_from start (a positive value is a resume step).
_INIT_WEIGHTS, _INIT_FULL = -1, -2


class CheckpointFetchError(DdpqError):
    """A checkpoint could not be brought onto this host intact (the message says why)."""

    status_code = 502
    code = "checkpoint_fetch_failed"


class CheckpointDamagedError(CheckpointFetchError):
    """The bytes the API sent do not match the checkpoint's recorded size and sha256: its
    stored copy is damaged (not the network: a cut download resumes instead)."""

    code = "checkpoint_damaged"


@dataclass(frozen=True)
class StartPoint:
    """What a rank starts from: ``path`` on this host, and ``kind`` ``resume`` (this job's own
    checkpoint: everything is restored) or ``init`` (another job's, ``init_from``: ``mode``
    ``weights_only`` loads the model, ``full`` also the optimizer and the step count)."""

    path: Path
    kind: str
    mode: str = "full"
    step: int = 0  # the resumed checkpoint's step (0 for an init start)


def verified(path: Path, size_bytes: int, sha256: str) -> bool:
    """Whether ``path`` is a file of ``size_bytes`` bytes whose sha256 is ``sha256``."""
    try:
        return path.stat().st_size == size_bytes and file_sha256(path) == sha256
    except OSError:
        return False


def fetch_file(
    client: AttemptClient, url_path: str, dest: Path, *, size_bytes: int, sha256: str,
    tmp_dir: Path,
) -> None:  # fmt: skip
    """Download ``url_path`` to ``dest``: streamed into a temp file in ``tmp_dir`` (the same
    filesystem as ``dest``), resumed with ``Range`` after a cut, verified (size and sha256),
    then renamed into place (atomically: a reader never sees half a file).

    Raises:
        CheckpointFetchError: ``DOWNLOAD_TRIES`` cuts in a row.
        CheckpointDamagedError: the bytes do not verify, or the server says its stored copy
            is damaged (410).
        StaleAttemptError: the attempt was fenced off.
        AttemptRequestError: the server refused (e.g. 404: no such checkpoint any more).
    """
    tmp_dir.mkdir(parents=True, exist_ok=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir / f".download-{dest.name}-{os.getpid()}"
    fails = 0
    try:
        with open(tmp, "wb") as fh:
            while True:
                offset = fh.tell()
                try:
                    client.download(url_path, fh, offset)
                    break
                except StoredFileDamagedError as exc:  # said before any byte: give up now
                    raise CheckpointDamagedError(str(exc.detail)) from None
                except ApiUnavailableError as exc:
                    fails = 0 if fh.tell() > offset else fails + 1
                    if fails >= DOWNLOAD_TRIES:
                        raise CheckpointFetchError(
                            f"download of {url_path} failed {fails} times in a row at byte "
                            f"{fh.tell()}: {exc}"
                        ) from None
                    log.warning("download of %s cut at byte %d, resuming: %s",
                                url_path, fh.tell(), exc)  # fmt: skip
                    time.sleep(min(0.5 * 2**fails, 5.0))
            fh.flush()
            os.fsync(fh.fileno())
        if not verified(tmp, size_bytes, sha256):
            raise CheckpointDamagedError(
                f"{url_path}: the downloaded file ({tmp.stat().st_size} bytes) does not match "
                f"its recorded size {size_bytes} and sha256 {sha256[:12]}…"
            )
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def read_checkpoint_list(client: AttemptClient) -> list[wire.CheckpointEntry]:
    """The job's checkpoint list, retried with backoff (and ``Retry-After``) for up to
    ``RESUME_LIST_WAIT_S`` while the API is unavailable: a rank may start during an outage."""
    deadline_s = time.monotonic() + RESUME_LIST_WAIT_S
    delay_s = 0.25
    while True:
        try:
            return client.list_checkpoints()
        except ApiUnavailableError as exc:
            wait_s = max(delay_s, exc.retry_after_s or 0.0)
            if time.monotonic() + wait_s > deadline_s:
                raise
            log.warning("checkpoint list unavailable, retrying in %.1f s: %s", wait_s, exc)
            time.sleep(wait_s)
            delay_s = min(delay_s * 2, 5.0)


def ensure_local(
    client: AttemptClient, entry: wire.CheckpointEntry, artifact_dir: Path, job_id: int,
    attempt: int, *, shared: bool = False,
) -> Path:  # fmt: skip
    """This job's checkpoint ``entry`` as a verified file on this host (downloaded if need be).

    Args:
        shared: this host's artifact root is the API's store (``shares_api_store``): the
            file here is the API's own copy, so one that does not verify is damaged, and
            downloading it would only read the same bytes.
    Raises:
        CheckpointDamagedError: the file does not verify (and ``shared``), or the downloaded
            bytes do not.
        CheckpointFetchError, AttemptRequestError, StaleAttemptError, ApiUnavailableError:
            see ``fetch_file``.
    """
    path = artifacts.checkpoint_path(artifact_dir, job_id, entry.step)
    if verified(path, entry.size_bytes, entry.sha256):
        return path
    if path.is_file():
        log.warning("checkpoint step=%d at %s fails its sha256", entry.step, path)
    if shared and _link_store_file(path, entry):
        return path
    if shared:
        raise CheckpointDamagedError(
            f"checkpoint step={entry.step} at {path} is missing or fails its sha256"
        )
    log.info("checkpoint step=%d not on this host; downloading %d bytes", entry.step,
             entry.size_bytes)  # fmt: skip
    fetch_file(
        client, wire.CHECKPOINT_FILE_PATH.format(step=entry.step), path,
        size_bytes=entry.size_bytes, sha256=entry.sha256,
        tmp_dir=artifacts.attempt_dir(artifact_dir, job_id, attempt),
    )  # fmt: skip
    return path


def _link_store_file(path: Path, entry: wire.CheckpointEntry) -> bool:
    """Where this host shares the API's store: point ``path`` (``step-<n>.pt``) at the file
    an upload left under its own name in the same directory (``entry.path``'s name,
    ``step-<n>.upload-<id>.pt``), once that file verifies. False when there is none."""
    name = Path(entry.path).name
    uploaded = artifacts.parse_uploaded_checkpoint_name(name)
    if uploaded is None or uploaded[0] != entry.step:
        return False
    stored = path.with_name(name)
    if not verified(stored, entry.size_bytes, entry.sha256):
        return False
    link = artifacts.temporary_path(path, "link")
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(name)  # relative: the store removes it with its target
    os.replace(link, path)
    return True


def shares_api_store(
    client: AttemptClient, artifact_dir: Path, me: wire.AttemptSelf | None
) -> bool:
    """Whether ``artifact_dir`` is the API's filesystem store (it holds the API's store id):
    then checkpoint files here are the API's own. ``me``: ``GET /attempts/self`` if already
    read (else asked now; an API that cannot say means "no": downloads are tried)."""
    if me is None:
        try:
            me = client.self_check()
        except (ApiUnavailableError, AttemptRequestError):
            return False
    return me.store_id is not None and local_store_id(artifact_dir) == me.store_id


def find_resume_checkpoint(
    client: AttemptClient, artifact_dir: Path, job_id: int, attempt: int = 0,
    *, attempt_self: wire.AttemptSelf | None = None,
) -> int | None:  # fmt: skip
    """The step of the newest committed checkpoint of ddpq's own (a followed file's is put
    back by ``restore_followed``) that is, or could be brought, on this host intact
    (``first_usable_checkpoint``); None when there is nothing to resume from.
    ``attempt_self``: ``GET /attempts/self`` if read already (for ``shares_api_store``).

    Raises:
        StaleAttemptError: the attempt is fenced off.
        ApiUnavailableError: the list could not be read within ``RESUME_LIST_WAIT_S``
            (starting from nothing instead would redo finished steps: the rank fails).
    """
    entries = [e for e in read_checkpoint_list(client) if e.file_name is None]
    chosen = first_usable_checkpoint(
        client, entries, artifact_dir, job_id, attempt, attempt_self=attempt_self
    )
    return None if chosen is None else chosen.step


def first_usable_checkpoint(
    client: AttemptClient, entries: list[wire.CheckpointEntry], artifact_dir: Path, job_id: int,
    attempt: int, *, attempt_self: wire.AttemptSelf | None = None,
) -> wire.CheckpointEntry | None:  # fmt: skip
    """The first of ``entries`` (newest first) whose file is, or could be brought, on this
    host intact (``ensure_local``); None when none could be had. One whose bytes are damaged
    at the source (the download does not verify) or gone (404) is recorded deleted so nothing
    picks it again (best effort); one that could not be fetched (the API unavailable, a link
    cut too often) is only skipped: its stored copy may be fine. Raises StaleAttemptError
    when the attempt is fenced off."""
    bad: list[int] = []
    chosen: wire.CheckpointEntry | None = None
    shared = bool(entries) and shares_api_store(client, artifact_dir, attempt_self)
    for entry in entries:
        try:
            ensure_local(client, entry, artifact_dir, job_id, attempt, shared=shared)
        except (CheckpointDamagedError, AttemptRequestError) as exc:
            log.warning("checkpoint step=%d unusable, trying the previous one: %s", entry.step,
                        exc)  # fmt: skip
            bad.append(entry.step)
        except (CheckpointFetchError, ApiUnavailableError) as exc:
            log.warning("checkpoint step=%d could not be fetched, trying the previous one: %s",
                        entry.step, exc)  # fmt: skip
        else:
            chosen = entry
            break
    if bad:
        try:
            client.record_deletions(bad)
        except (ApiUnavailableError, AttemptRequestError) as exc:
            log.warning("damaged checkpoints %s not recorded deleted: %s", bad, exc)
    return chosen


def init_path(artifact_dir: Path, job_id: int) -> Path:
    """Where this job keeps its ``init_from`` checkpoint on this host (a file, or a link to
    the source job's own file where this host sees the API's directory)."""
    return artifacts.job_dir(artifact_dir, job_id) / "init-from.pt"


def ensure_init_local(
    client: AttemptClient, init: wire.InitFrom, artifact_dir: Path, job_id: int, attempt: int
) -> Path:
    """The ``init_from`` checkpoint as a verified file on this host at ``init_path``: a link
    to the source job's own file where this host has it intact, else downloaded
    (``INIT_FILE_PATH``).

    Raises:
        CheckpointFetchError, AttemptRequestError, StaleAttemptError, ApiUnavailableError:
            see ``fetch_file``.
    """
    path = init_path(artifact_dir, job_id)
    if verified(path, init.size_bytes, init.sha256):
        return path
    source = artifacts.checkpoint_path(artifact_dir, init.job_id, init.step)
    if verified(source, init.size_bytes, init.sha256):
        link = artifacts.temporary_path(path, "link")
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(source)
        os.replace(link, path)
        log.info("init_from job %d step %d: this host's copy", init.job_id, init.step)
        return path
    log.info("init_from job %d step %d: downloading %d bytes", init.job_id, init.step,
             init.size_bytes)  # fmt: skip
    fetch_file(
        client, wire.INIT_FILE_PATH, path, size_bytes=init.size_bytes, sha256=init.sha256,
        tmp_dir=artifacts.attempt_dir(artifact_dir, job_id, attempt),
    )  # fmt: skip
    return path


def _all_ok(ok: bool, ctx: DistContext) -> bool:
    """Whether ``ok`` holds on every rank (a MIN over the gloo control group)."""
    if not ctx.is_distributed or ctx.world_size == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MIN, group=ctx.control_group)
    return bool(flag.item())


def agree_on_start(
    ctx: DistContext,
    client: AttemptClient | None,
    artifact_dir: Path,
    job_id: int,
    attempt: int,
    attempt_self: wire.AttemptSelf | None,
) -> StartPoint | None:
    """Rank 0 picks the start (its job's resume checkpoint, else ``init``), broadcasts it, the
    first rank of every other node fetches the same file, and all agree every node has it.
    Every rank returns the same start (None: from scratch). A collective: all ranks call it.

    Args:
        client: this rank's attempt API client (needed on rank 0 and on the first rank of
            every other node; others may pass None).
        attempt_self: ``GET /attempts/self`` as this rank read it at start (its ``init_from``
            says where a job without checkpoints starts); None when the API could not be
            asked then (rank 0 asks again).
    Raises:
        ValueError: rank 0 (or another node's first rank) without a client.
        CheckpointFetchError: a node could not get the file (on every rank).
    """
    code = 0
    if ctx.rank == 0:
        if client is None:
            raise ValueError("rank 0 needs an AttemptClient to find its start checkpoint")
        code = (
            find_resume_checkpoint(client, artifact_dir, job_id, attempt, attempt_self=attempt_self)
            or 0
        )
        if code == 0 and attempt_self is None:
            attempt_self = client.self_check()
        init = attempt_self.init_from if attempt_self is not None else None
        if code == 0 and init is not None:
            ensure_init_local(client, init, artifact_dir, job_id, attempt)
            code = _INIT_WEIGHTS if init.mode == "weights_only" else _INIT_FULL
    code = broadcast_int(code, ctx)
    if code == 0:
        return None
    ok = True
    if ctx.rank != 0 and ctx.local_rank == 0:  # the first rank of another node
        init = attempt_self.init_from if attempt_self is not None else None
        ok = _fetch_on_this_node(client, code, artifact_dir, job_id, attempt, init)
    if not _all_ok(ok, ctx):
        raise CheckpointFetchError("a node could not fetch the start checkpoint (see its log)")
    if code > 0:
        path = artifacts.checkpoint_path(artifact_dir, job_id, code)
        return StartPoint(path, "resume", step=code)
    mode = "weights_only" if code == _INIT_WEIGHTS else "full"
    return StartPoint(init_path(artifact_dir, job_id), "init", mode)


def _fetch_on_this_node(
    client: AttemptClient | None, code: int, artifact_dir: Path, job_id: int, attempt: int,
    init: wire.InitFrom | None,
) -> bool:  # fmt: skip
    """The first rank of a node other than rank 0's: make the chosen file present here."""
    if client is None:
        raise ValueError("the first rank of every node needs an AttemptClient")
    try:
        if code > 0:
            entries = {e.step: e for e in read_checkpoint_list(client)}
            if code not in entries:
                raise CheckpointFetchError(f"checkpoint step {code} is no longer listed")
            ensure_local(client, entries[code], artifact_dir, job_id, attempt)
        else:
            init = init if init is not None else client.self_check().init_from
            if init is None:
                raise CheckpointFetchError("rank 0 starts from init_from, the API names none")
            ensure_init_local(client, init, artifact_dir, job_id, attempt)
    except StaleAttemptError:
        raise
    except (CheckpointFetchError, AttemptRequestError, ApiUnavailableError) as exc:
        log.error("could not fetch the start checkpoint onto this node: %s", exc)
        return False
    return True
