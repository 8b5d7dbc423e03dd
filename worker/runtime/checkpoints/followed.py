"""A command job's followed checkpoint files (``checkpoints.path``, a workspace-relative file
or glob its script writes): rank 0 watches the workspace for each completed new version
(``FollowedFiles``) and saves it as a checkpoint (``Checkpointer.save_file``); before the next
attempt, on whichever host runs it, the newest is put back at its path (``restore_followed``),
so a script that loads ``snapshot.pt`` when it exists resumes.

A version is complete when the file was closed after writing (inotify's ``IN_CLOSE_WRITE``:
``torch.save(obj, "snapshot.pt")`` in place) or renamed into place (``IN_MOVED_TO``: written
to a temp name, then ``os.replace``). Linux inotify through ``inotify_simple``, a thin,
maintained wrapper of the three system calls: the watcher needs exactly these two events,
per directory, with no thread or polling backend of its own. ``pattern`` reads as
``pathlib``'s glob does: ``*``, ``?`` and ``[…]`` within one part, ``**`` any number of
directories.

Directories made after the start (``ckpt/`` of ``ckpt/*.pt``) are watched once seen, and
scanned then: a file written in one before its watch existed is taken when no process holds
it open for writing any more (a read lease, ``worker.runtime.checkpoints.leases``), else its
close is awaited. The same test drops a file whose version completed but that is being
rewritten already: its next close reports it again. Only regular files at their own path
under the root count: a symbolic link (of the file or of a directory on the way) is ignored,
and directories are watched without following links.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import select
import stat
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cache, lru_cache
from pathlib import Path

import inotify_simple
from inotify_simple import INotify, flags

from service.core import artifacts
from service.core.spec.followed import glob_matches, glob_parts
from service.core.wire.attempt import CheckpointEntry
from service.core.wire.workspace import path_problem
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.checkpoints.fetch import (
    CheckpointFetchError,
    first_usable_checkpoint,
    read_checkpoint_list,
)
from worker.runtime.checkpoints.files import (
    CheckpointWriteError,
    FileVersion,
    copy_hashed,
    file_version,
    publish_checkpoint,
)
from worker.runtime.checkpoints.leases import being_written

log = logging.getLogger(__name__)

# What each watched directory reports: completed files, and directories appearing or leaving.
_DIR_MASK = (
    flags.CLOSE_WRITE
    | flags.MOVED_TO
    | flags.MOVED_FROM
    | flags.CREATE
    | flags.ONLYDIR
    | flags.DONT_FOLLOW
    | flags.EXCL_UNLINK
)


def _open_inotify() -> INotify:
    """A non-blocking inotify instance. inotify_simple finds libc with
    ``ctypes.util.find_library``, which runs ``ldconfig -p`` (a child process) the first
    time; the interpreter's own symbols (``dlopen(NULL)``) hold libc's inotify calls already,
    so it is handed those when it has none yet."""
    if getattr(inotify_simple, "_libc", None) is None:
        inotify_simple._libc = ctypes.CDLL(None, use_errno=True)
    return INotify(nonblocking=True)


@lru_cache(maxsize=1024)
def _may_hold(pattern: tuple[str, ...], directory: str) -> bool:
    """Whether a file somewhere under the workspace-relative ``directory`` ("" is the root)
    could match ``pattern``: whether to watch it."""
    parts = directory.split("/") if directory else []

    @cache
    def fits(i: int, j: int) -> bool:
        if j == len(parts):
            return any(part != "**" for part in pattern[i:])
        if i == len(pattern):
            return False
        if pattern[i] == "**":
            return fits(i + 1, j) or fits(i, j + 1)
        return fnmatchcase(parts[j], pattern[i]) and fits(i + 1, j + 1)

    return fits(0, 0)


def relative_name(root: Path, path: Path) -> str:
    """``path`` (under ``root``) as the workspace-relative POSIX name a checkpoint keeps.

    Raises:
        ValueError: ``path`` is not under ``root``.
    """
    return Path(path).relative_to(root).as_posix()


class FollowedFiles:
    """Watches root for completed new versions of the files matching pattern (a
    workspace-relative path or glob). Files already there at the start are not reported
    until a new version of them completes. One caller thread; ``close`` when done.

    Raises (the constructor):
        ValueError: ``pattern`` is not a workspace path.
        OSError: inotify is not available, or ``root`` cannot be watched.
    """

    def __init__(self, root: Path, pattern: str) -> None:
        self._root = Path(root).absolute()  # the paths handed out are under it
        self._real = Path(os.path.realpath(self._root))  # the paths watched and read
        self._pattern = glob_parts(pattern)
        self._inotify = _open_inotify()
        self._dirs: dict[int, str] = {}  # watch descriptor → relative directory ("": root)
        self._pending: dict[str, None] = {}  # relative names, oldest completion first
        self._recheck: dict[str, None] = {}  # closed, but another writer still had them open
        self._versions: dict[str, FileVersion] = {}  # the last version known of each file
        self._scanned: dict[str, FileVersion] = {}  # versions a scan queued (not an event)
        try:
            self._inotify.add_watch(self._real, _DIR_MASK)  # a root that cannot be watched raises
            self._watch_tree("", report=False)
        except BaseException:
            self._inotify.close()
            raise

    def completed(self) -> list[Path]:
        """Each file (absolute path under root) a new version of which completed since the
        last call, once each, oldest first (by its newest completion). Non-blocking."""
        self._read_events()
        done: list[Path] = []
        for name in list(self._pending):
            del self._pending[name]
            version = self._complete_version(name)
            if version is not None:
                self._versions[name] = version
                done.append(self._root / name)
            elif self._version(name) is not None:  # still open for writing somewhere
                self._recheck[name] = None
        self._pending.update(self._recheck)  # asked again at the next call
        self._recheck.clear()
        return done

    def completed_version(self, path: Path) -> FileVersion | None:
        """The newest version of ``path`` (as ``completed`` handed it out) that completed:
        the one a copy of it should find (``copy_hashed``'s ``version``)."""
        return self._versions.get(relative_name(self._root, path))

    @property
    def rechecking(self) -> bool:
        """Whether a closed version waits for its file's last writer to close it (call
        ``completed`` again soon: no event may come for it)."""
        return bool(self._pending)

    def wait(self, timeout_s: float) -> bool:
        """Block until a watched directory changed or ``timeout_s`` seconds passed; True when
        something changed (``completed`` may then have a version to hand out)."""
        try:
            ready, _, _ = select.select([self._inotify.fileno()], [], [], timeout_s)
        except (OSError, ValueError):  # closed meanwhile
            return False
        return bool(ready)

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self._inotify.close()

    # -- events ---------------------------------------------------------------------------------
    def _read_events(self) -> None:
        overflow = False
        for event in self._inotify.read(timeout=0):
            if event.mask & flags.Q_OVERFLOW:
                overflow = True
            elif event.mask & flags.IGNORED:  # the directory is gone (or unwatched)
                self._dirs.pop(event.wd, None)
            elif event.wd in self._dirs and event.name:
                parent = self._dirs[event.wd]
                self._on_event(f"{parent}/{event.name}" if parent else event.name, event.mask)
        if overflow:
            log.warning("inotify queue overflowed: rescanning %s for %s", self._root,
                        "/".join(self._pattern))  # fmt: skip
            self._watch_tree("", report=True)

    def _on_event(self, name: str, mask: int) -> None:
        if mask & flags.ISDIR:
            if mask & flags.MOVED_FROM:
                self._unwatch(name)
            elif mask & (flags.CREATE | flags.MOVED_TO) and _may_hold(self._pattern, name):
                self._watch_tree(name, report=True)
        elif mask & (flags.CLOSE_WRITE | flags.MOVED_TO) and glob_matches(self._pattern, name):
            scanned = self._scanned.pop(name, None)
            if scanned is not None and scanned == self._version(name):
                return  # the scan of its new directory queued this very version already
            self._queue(name)

    def _queue(self, name: str) -> None:
        self._pending.pop(name, None)
        self._pending[name] = None  # last: its newest completion is the latest

    # -- directories ----------------------------------------------------------------------------
    def _watch_tree(self, directory: str, *, report: bool) -> None:
        """Watch ``directory`` and the directories under it that may hold a match; queue the
        matching files in them whose version is new (``report``), else only note their
        versions (the start)."""
        todo = [directory]
        while todo:
            rel = todo.pop()
            path = self._real / rel if rel else self._real
            try:
                wd = self._inotify.add_watch(path, _DIR_MASK)
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:  # gone, a symbolic link, or out of watches
                if exc.errno == errno.ENOSPC:
                    log.warning("cannot watch %s: out of inotify watches "
                                "(fs.inotify.max_user_watches)", path)  # fmt: skip
                continue
            self._dirs[wd] = rel
            try:
                entries = list(os.scandir(fd))
            except OSError:
                entries = []
            finally:
                os.close(fd)
            for entry in entries:
                name = f"{rel}/{entry.name}" if rel else entry.name
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        if _may_hold(self._pattern, name):
                            todo.append(name)
                    elif entry.is_file(follow_symlinks=False) and glob_matches(self._pattern, name):
                        self._found(name, report=report)

    def _found(self, name: str, *, report: bool) -> None:
        version = self._version(name)
        if version is None or version == self._versions.get(name):
            return
        if report:
            self._scanned[name] = version
            self._queue(name)
        else:
            self._versions[name] = version

    def _unwatch(self, directory: str) -> None:
        """Stop watching ``directory`` and everything under it (moved away)."""
        for wd, rel in list(self._dirs.items()):
            if rel == directory or rel.startswith(directory + "/"):
                del self._dirs[wd]
                with contextlib.suppress(OSError):
                    self._inotify.rm_watch(wd)

    # -- files ----------------------------------------------------------------------------------
    def _version(self, name: str) -> FileVersion | None:
        try:
            st = os.lstat(self._real / name)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return file_version(st)

    def _complete_version(self, name: str) -> FileVersion | None:
        """The version of ``name`` when it is a regular file at its own path under the root
        (no symbolic link on the way) that no process holds open for writing; else None."""
        if os.path.realpath(self._real / name) != str(self._real / name):
            return None
        version = self._version(name)
        if version is None or being_written(self._real / name):
            return None  # gone, not a regular file, or being rewritten: its close comes next
        return version


@dataclass(frozen=True)
class RestoredFile:
    """A followed checkpoint put back: its ``step``, its workspace-relative ``file_name``,
    and where it now lies (``path``, under the root)."""

    step: int
    file_name: str
    path: Path


def restore_followed(
    client: AttemptClient, artifact_dir: Path, job_id: int, attempt: int, root: Path,
    pattern: str,
) -> RestoredFile | None:  # fmt: skip
    """Put the job's followed checkpoints back: for each workspace file name matching
    ``pattern`` (a glob may match several files a script saves together), the newest committed
    checkpoint of that name that can be brought onto this host verified
    (``fetch.first_usable_checkpoint``: the previous one when the newest cannot be had; a
    damaged one is recorded deleted), copied atomically (temp file, rename) to
    ``root/file_name``. Call it before ``FollowedFiles`` starts watching ``root``.

    Returns:
        The newest of what was restored; None when the job has no such checkpoint.
    Raises:
        CheckpointFetchError: such checkpoints exist, but a name's could not be had or put in
            place.
        StaleAttemptError: the attempt is fenced off.
        ApiUnavailableError: the list could not be read (``fetch.RESUME_LIST_WAIT_S``).
    """
    parts = glob_parts(pattern)
    by_name: dict[str, list[CheckpointEntry]] = {}
    for e in read_checkpoint_list(client):  # newest step first
        if e.file_name is not None and glob_matches(parts, e.file_name):
            by_name.setdefault(e.file_name, []).append(e)
    restored = [
        _restore_one(client, entries, artifact_dir, job_id, attempt, Path(root))
        for entries in by_name.values()
    ]
    return max(restored, key=lambda r: r.step, default=None)


def _restore_one(
    client: AttemptClient, entries: list[CheckpointEntry], artifact_dir: Path, job_id: int,
    attempt: int, root: Path,
) -> RestoredFile:  # fmt: skip
    """The newest usable of ``entries`` (one file name's checkpoints) put back under
    ``root``."""
    entry = first_usable_checkpoint(client, entries, artifact_dir, job_id, attempt)
    if entry is None or entry.file_name is None:
        raise CheckpointFetchError(
            f"none of the job's {len(entries)} checkpoints of {entries[0].file_name!r} could be "
            "brought onto this host intact (see the log)"
        )
    source = artifacts.checkpoint_path(artifact_dir, job_id, entry.step)
    dest = _restore_path(root, entry.file_name)
    tmp = artifacts.temporary_path(dest)
    try:
        size_bytes, sha256 = copy_hashed(source, tmp, follow_symlinks=True)
        if (size_bytes, sha256) != (entry.size_bytes, entry.sha256):
            raise CheckpointWriteError(f"the copy of {source} does not match its sha256")
        publish_checkpoint(tmp, dest)
    except (OSError, CheckpointWriteError) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CheckpointFetchError(
            f"checkpoint step={entry.step} could not be put back at {dest}: {exc}"
        ) from exc
    log.info("followed checkpoint step=%d restored to %s", entry.step, dest)
    return RestoredFile(entry.step, entry.file_name, dest)


def _restore_path(root: Path, file_name: str) -> Path:
    """``root/file_name``, its directories made as real directories under ``root``.

    Raises:
        CheckpointFetchError: ``file_name`` is not a workspace path, or a directory on the
            way is a symbolic link or not a directory.
    """
    problem = path_problem(file_name)
    if problem is not None:
        raise CheckpointFetchError(f"checkpoint file name {file_name!r}: {problem}")
    directory = root
    for part in file_name.split("/")[:-1]:
        directory = directory / part
        with contextlib.suppress(FileExistsError):
            directory.mkdir()
        if directory.is_symlink() or not directory.is_dir():
            raise CheckpointFetchError(f"{directory} is not a directory of the workspace")
    return directory / file_name.split("/")[-1]
