"""Packing a working directory into a workspace manifest: which files go, their modes, sizes
and sha256, checked against the limits before anything is sent.

Which files: inside a git work tree, exactly what ``git ls-files --cached --others
--exclude-standard`` lists there (git's own rules: nested ``.gitignore``s, ``info/exclude``,
the global excludes file; tracked files deleted from disk are skipped; a submodule or nested
repository is listed by its own git), less ddpq's own state directory ``.ddpq/``, whose
database and artifacts no job should carry. Elsewhere: every file under DIR but those a
``.ddpqignore`` at DIR's top excludes (gitignore syntax, read with ``pathspec``) and the
always-excluded ``.git``, ``__pycache__/``, ``.ddpq/`` and virtualenvs (a directory holding
``pyvenv.cfg``).

What each file is: a regular file's content and executable bit (0o755 when the owner may
execute it, else 0o644). A symlink to a file inside DIR ships that file's content (as a regular
file: the rank's tree holds no symlink); one whose target leaves DIR, dangles or is a
directory is refused, and so is a file reached through a symlinked directory that leaves DIR;
fifos, sockets and devices are refused too: each refusal names the path and how to exclude
it. Hard links are regular files: each name ships as its own copy of the content (stored
once, by sha256), and the rank's tree has independent files, not links.

Left out as well, whatever the listing: the ``ddpq`` library's local checkpoint directory
(``ddpq-checkpoints/``, what a plain ``torchrun`` run of the script left) and the files a
command job names for ddpq to follow (``checkpoints.path``, ``metrics.tensorboard``: ddpq puts
the job's own newest checkpoint there before each attempt, and a local run's leftovers would
make the first attempt resume from them). ``leave_out_for`` names them from a spec.

Cost: one ``git ls-files`` (or one directory walk), one ``lstat`` per file, and one read per
file to hash it, streaming (``hashlib.file_digest``); the limits are checked on the sizes
before any file is read.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pathspec

from service.core.errors import DdpqError
from service.core.spec.followed import glob_matches, glob_parts
from service.core.wire.workspace import (
    LARGEST_SHOWN,
    Manifest,
    WorkspaceFile,
    check_limits,
    path_problem,
)

IGNORE_FILE = ".ddpqignore"
# The ddpq library's checkpoints of a plain (non-ddpq) run (ddpq._local).
LOCAL_CHECKPOINT_DIR = "ddpq-checkpoints"
# Directory names never shipped outside git (and ``.ddpq`` inside git too).
ALWAYS_EXCLUDED_DIRS = frozenset({".git", "__pycache__", ".ddpq"})
STATE_DIR = ".ddpq"
VENV_MARKER = "pyvenv.cfg"
GIT_TIMEOUT_S = 120.0
Listing = Literal["git", "walk"]
_SPECIAL_KINDS = (
    (stat.S_ISFIFO, "a fifo (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class WorkspacePackError(DdpqError):
    """A file of the working directory cannot be shipped (the message names it and the fix),
    or the directory cannot be listed."""

    status_code = 422
    code = "workspace_refused"


@dataclass(frozen=True)
class PackedWorkspace:
    """A packed working directory: ``manifest`` (what the API stores), ``root`` (the absolute
    directory packed), ``listing`` (``git`` or ``walk``: which rules chose the files) and
    ``sources``: where on disk each manifest path's bytes are (a symlink's target)."""

    root: Path
    manifest: Manifest
    sources: dict[str, Path]
    listing: Listing
    left_out: tuple[str, ...] = ()  # files listed but not shipped (``leave_out``)

    @property
    def digest(self) -> str:
        """The workspace's digest (``Manifest.digest``)."""
        return self.manifest.digest()

    @property
    def exclude_with(self) -> str:
        """Where the user excludes files from this directory."""
        return exclude_file(self.listing)

    def largest(self, n: int = LARGEST_SHOWN) -> list[WorkspaceFile]:
        """The ``n`` largest files, largest first (ties by path)."""
        ordered = sorted(self.manifest.files, key=lambda f: (-f.size_bytes, f.path))
        return ordered[:n]


@dataclass(frozen=True)
class _Entry:
    path: str  # relative POSIX path in the workspace
    source: Path  # what to read
    mode: int
    size_bytes: int


def leave_out_for(spec: Mapping[str, Any] | None) -> tuple[str, ...]:
    """What a packed directory leaves out for a job spec (a dict as submitted): the library's
    ``ddpq-checkpoints/`` and the spec's ``checkpoints.path`` and ``metrics.tensorboard``
    (workspace-relative paths or globs; a directory stands for everything under it)."""
    patterns = [LOCAL_CHECKPOINT_DIR]
    spec = spec or {}
    for field, key in (("checkpoints", "path"), ("metrics", "tensorboard")):
        value = spec.get(field)
        if isinstance(value, Mapping) and isinstance(value.get(key), str) and value[key]:
            patterns.append(value[key].strip("/"))
    return tuple(patterns)


def _left_out(path: str, patterns: Sequence[str]) -> bool:
    """Whether workspace path ``path`` is ``patterns``' (a pattern matches the path or one of
    its parent directories: ``glob_matches``); a pattern that is no workspace path matches
    nothing (the API's 422 names it)."""
    parts = path.split("/")
    for pattern in patterns:
        try:
            wanted = glob_parts(pattern)
        except ValueError:
            continue
        if any(glob_matches(wanted, "/".join(parts[:d])) for d in range(1, len(parts) + 1)):
            return True
    return False


def pack_workspace(
    root: str | Path, *, max_bytes: int, max_files: int, leave_out: Sequence[str] = ()
) -> PackedWorkspace:
    """List, check and hash the files of the working directory ``root``.

    Args:
        root: the directory to ship (the job's working directory).
        max_bytes, max_files: the limits (``DDPQ_WORKSPACE_MAX_BYTES``/``_FILES``), checked
            on the listed sizes before any file is read.
        leave_out: workspace-relative paths or globs not to ship, a directory with all under
            it (``leave_out_for``); what was left out is ``PackedWorkspace.left_out``.

    Raises:
        WorkspacePackError: ``root`` is not a directory, git failed, a file cannot be shipped
            (symlink leaving ``root``, fifo, socket, device, a name that is not a workspace
            path), or there is no file to ship.
        WorkspaceTooLargeError: over a limit (naming the five largest files and the setting).
    """
    try:
        base = Path(root).resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise WorkspacePackError(f"cannot use {root} as the working directory: {exc}") from None
    if not base.is_dir():
        raise WorkspacePackError(f"{root} is not a directory: pass the job's working directory")
    listing: Listing = "git" if _in_git_work_tree(base) else "walk"
    paths = _git_files(base) if listing == "git" else _walk_files(base)
    skipped = tuple(sorted(p for p in paths if leave_out and _left_out(p, leave_out)))
    if skipped:
        paths = [p for p in paths if p not in set(skipped)]
    entries = [e for e in (_entry(base, path, listing) for path in paths) if e is not None]
    exclude_with = exclude_file(listing)
    if not entries:
        why = "git lists no file there (are they all ignored?)" if listing == "git" else ""
        raise WorkspacePackError(f"nothing to ship in {base}: {why or 'it has no file'}")
    check_limits(
        ((e.path, e.size_bytes) for e in entries), max_bytes, max_files, exclude_with=exclude_with
    )
    files = [_hashed(e) for e in entries]
    try:
        manifest = Manifest(files=files)
    except ValueError as exc:  # a file/dir clash cannot come from one tree; a bug if it does
        raise WorkspacePackError(f"{base}: {exc}") from None
    # Sizes as read: a file that grew since it was listed counts as it is now.
    check_limits(
        ((f.path, f.size_bytes) for f in files), max_bytes, max_files, exclude_with=exclude_with
    )
    return PackedWorkspace(
        root=base,
        manifest=manifest,
        sources={e.path: e.source for e in entries},
        listing=listing,
        left_out=skipped,
    )


# -- listing ------------------------------------------------------------------------------------


def exclude_file(listing: Listing) -> str:
    """Where a user excludes files from a directory packed with ``listing``."""
    return ".gitignore" if listing == "git" else IGNORE_FILE


def _git(base: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            ["git", *args], cwd=base, capture_output=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise WorkspacePackError(
            f"git {args[0]} in {base} took over {GIT_TIMEOUT_S:.0f} s"
        ) from None
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise WorkspacePackError(f"cannot run git in {base}: {exc}") from None


def _in_git_work_tree(base: Path) -> bool:
    """Whether ``base`` is inside a git work tree. No git installed: False (a walk, as for
    a directory outside git). A repository git refuses (e.g. "dubious ownership") is an
    error, not a silent switch to other rules."""
    try:
        result = _git(base, "rev-parse", "--is-inside-work-tree")
    except FileNotFoundError:  # no git on this machine
        return False
    if result.returncode == 0:
        return result.stdout.strip() == b"true"
    message = os.fsdecode(result.stderr).strip()
    if "not a git repository" in message:
        return False
    raise WorkspacePackError(f"git cannot list the files of {base}: {message}")


def _git_files(base: Path, prefix: str = "") -> list[str]:
    """What git lists under ``base`` (relative to it), with ``prefix`` before each path; a
    submodule or nested repository is listed by its own git."""
    result = _git(base, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if result.returncode != 0:
        message = os.fsdecode(result.stderr).strip()
        raise WorkspacePackError(f"git ls-files failed in {base}: {message}")
    paths: dict[str, None] = {}  # ordered set: an unmerged file is listed once per stage
    for raw in result.stdout.split(b"\0"):
        if not raw:
            continue
        name = os.fsdecode(raw).rstrip("/")
        if STATE_DIR in name.split("/")[:-1] or name == STATE_DIR:
            continue
        full = base / name
        if full.is_dir() and not full.is_symlink():
            if (full / ".git").exists():  # a submodule or an untracked nested repository
                paths.update(dict.fromkeys(_git_files(full, f"{prefix}{name}/")))
            continue  # an uninitialised submodule: an empty directory
        paths[prefix + name] = None
    return list(paths)


def _read_ignore_spec(base: Path) -> pathspec.GitIgnoreSpec | None:
    ignore = base / IGNORE_FILE
    if not ignore.is_file():
        return None
    try:
        lines = ignore.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkspacePackError(f"cannot read {ignore}: {exc}") from None
    try:
        return pathspec.GitIgnoreSpec.from_lines(lines)
    except (ValueError, TypeError) as exc:  # pathspec's GitWildMatchPatternError is a ValueError
        raise WorkspacePackError(f"{ignore}: {exc}") from None


def _walk_files(base: Path) -> list[str]:
    """Every file under ``base`` but the excluded ones (module docstring), relative paths.
    A directory excluded is not entered: nothing under it can be re-included (as git)."""
    spec = _read_ignore_spec(base)
    found: list[str] = []
    stack = [""]
    while stack:
        prefix = stack.pop()
        try:
            with os.scandir(base / prefix if prefix else base) as it:
                children = list(it)
        except OSError as exc:
            raise WorkspacePackError(f"cannot list {base / prefix}: {exc}") from None
        for child in children:
            rel = prefix + child.name
            if child.is_dir(follow_symlinks=False):
                if child.name in ALWAYS_EXCLUDED_DIRS or os.path.isfile(
                    os.path.join(child.path, VENV_MARKER)
                ):
                    continue
                if spec is None or not spec.match_file(rel + "/"):
                    stack.append(rel + "/")
            elif child.name != ".git" and (spec is None or not spec.match_file(rel)):
                found.append(rel)
    return found


# -- one file -----------------------------------------------------------------------------------


def _refuse(path: str, why: str, exclude_with: str) -> WorkspacePackError:
    return WorkspacePackError(
        f"cannot ship {path!r}: {why}; exclude it (list it in {exclude_with}) or replace it "
        "by a regular file"
    )


def _entry(base: Path, path: str, listing: Listing) -> _Entry | None:
    """The file ``path`` as it will be shipped, or None when it is gone (tracked by git,
    deleted from disk).

    Raises:
        WorkspacePackError: a name, symlink or file kind that cannot be shipped.
    """
    exclude_with = exclude_file(listing)
    problem = path_problem(path)
    if problem is not None:
        raise _refuse(path, f"its path cannot be a workspace path ({problem})", exclude_with)
    full = base / path
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _refuse(path, f"cannot read it ({exc})", exclude_with) from None
    source = full
    # Where the bytes really are: a symlink, or a parent directory that is one (git still
    # lists ``sub/f`` after ``sub`` became a symlink), must not lead out of ``base``.
    target = Path(os.path.realpath(full))
    if not target.is_relative_to(base):
        via = "it is a symlink to"
        if not stat.S_ISLNK(st.st_mode):
            via = "a directory above it is a symlink: the file is"
        raise _refuse(path, f"{via} {target}, outside the working directory {base}", exclude_with)
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(target)
        except OSError:
            raise _refuse(path, f"it is a symlink to {target}, which does not exist",
                          exclude_with) from None  # fmt: skip
        if stat.S_ISDIR(st.st_mode):
            raise _refuse(path, f"it is a symlink to the directory {target}", exclude_with)
        source = target
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _SPECIAL_KINDS if test(st.st_mode)), "not a regular file")
        raise _refuse(path, f"it is {kind}", exclude_with)
    mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
    return _Entry(path=path, source=source, mode=mode, size_bytes=st.st_size)


def _hashed(entry: _Entry) -> WorkspaceFile:
    """The entry with its content's sha256, read once, streaming. The size is what was read
    (a file that changed since its ``lstat`` is shipped as it is now)."""
    try:
        # Non-blocking: a file swapped for a fifo since its lstat must not hang the open.
        fd = os.open(entry.source, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise WorkspacePackError(
                    f"cannot ship {entry.path!r}: it stopped being a regular file while packed"
                )
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
            size = fh.tell()
    except OSError as exc:
        raise WorkspacePackError(f"cannot read {entry.path!r}: {exc}") from None
    return WorkspaceFile(path=entry.path, mode=entry.mode, size_bytes=size, sha256=digest)
