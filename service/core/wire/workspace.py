"""The workspace wire format: a user's working directory shipped over HTTP, content-addressed.

A workspace is a ``Manifest``: one ``WorkspaceFile`` (relative POSIX path, mode, size, sha256)
per shipped file. Its ``digest()`` is the sha256 of the sorted (path, mode, file sha256) list,
so the same tree packed twice, on any machine, in any order, has the same digest. Files are
stored once each by their sha256; a job's spec names its workspace by digest.

Routes (relative to the API prefix ``/api/v1``):

User token, owner only (another owner's digest, file or upload answers the same 404 as one
that does not exist; a file another owner uploaded still counts as missing for you):

1. ``POST MISSING_PATH`` ``MissingFiles`` → ``MissingAnswer``: which of these files the server
   lacks for this owner (at most ``MAX_MISSING_FILES`` per request: the client sends several).
2. Each missing file goes up with the checkpoint upload's protocol (``service.core.wire.attempt``
   describes it), on workspace paths: ``POST FILES_PATH`` ``FileUploadStart`` → 201
   ``FileUploadStatus`` (200 with the same upload when (owner, sha256) was begun before and
   not finished: resume at ``received_bytes``; 200 ``committed`` when the owner already has
   the file); ``PUT FILE_CHUNK_PATH?offset=N`` with the raw bytes and their sha256 in
   ``CHUNK_SHA256_HEADER`` → ``FileUploadStatus`` (409 with a ``FileUploadStatus`` detail
   when ``offset`` is not ``received_bytes``; 422 when the body does not match its sha256);
   ``GET FILE_UPLOAD_PATH`` → ``FileUploadStatus``; ``POST FILE_COMMIT_PATH`` →
   ``FileUploadStatus`` ``committed`` once the whole file's size and sha256 match (409 with
   the status when bytes are missing; 422 when the sha256 does not match: discarded).
   An empty file has no chunk: begin, then commit.
   Small files (at most ``BATCH_FILE_MAX_BYTES``, 1 MiB) may instead go many at once:
   ``POST FILES_BATCH_PATH`` with a body of one JSON line listing each file's sha256 and
   size, then their bytes concatenated in that order (``service.core.wire.batch`` gives the
   framing and its caps) → ``BatchAnswer``: the files you now have (sent, or had before) and
   each refused with its reason (bytes not matching the sha256; nothing kept of it: send it
   again, or with the chunk protocol); 422 for a body that does not split into its files;
   413 for one over the chunk cap in bytes. One request and one transaction per batch,
   instead of three of each per file.
3. ``POST WORKSPACES_PATH`` ``WorkspaceCreate`` → 201 ``WorkspaceSummary`` (200 for a digest
   the owner already has): 422 listing the files not uploaded, or declared with another
   size than the uploaded file's (``size_mismatch``); 413 ``WorkspaceTooLargeError`` beyond
   the server's limits.
4. ``GET WORKSPACE_PATH`` → ``Manifest``.

Attempt token (a rank of a job whose spec names the workspace):

5. ``GET ATTEMPT_WORKSPACE_PATH`` → the job's ``Manifest``.
6. ``GET ATTEMPT_WORKSPACE_FILE_PATH`` → the file's bytes (``Range: bytes=N-`` resumes;
   ``SHA256_HEADER`` carries its sha256), only files in the job's manifest.

Why not ``UploadStart``/``UploadStatus`` of the checkpoint uploads: those name a ``step`` and
``epoch`` (a workspace file has neither) and refuse empty files (``__init__.py`` is one).
``FileUploadStatus`` keeps the fields the chunk loop reads (``upload_id``, ``size_bytes``,
``received_bytes``, ``chunk_bytes``, ``state``) under the same names, so one client loop
(``service.core.wire.chunks.send_file_chunks``) sends both kinds.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import re
from collections.abc import Iterable
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from service.core.errors import DdpqError
from service.core.limits import MAX_PATH_BYTES
from service.core.wire.attempt import ATTEMPT_PREFIX, MAX_SIZE_BYTES

# -- the routes, relative to the API prefix -----------------------------------------------------
WORKSPACES_PATH = "/workspaces"  # POST WorkspaceCreate → 201 WorkspaceSummary
MISSING_PATH = "/workspaces/missing"  # POST MissingFiles → MissingAnswer
FILES_PATH = "/workspaces/files"  # POST FileUploadStart → 201 FileUploadStatus
FILES_BATCH_PATH = "/workspaces/files/batch"  # POST header line + bytes → BatchAnswer
FILE_UPLOAD_PATH = "/workspaces/files/{upload_id}"  # GET → FileUploadStatus
FILE_CHUNK_PATH = "/workspaces/files/{upload_id}/chunks"  # PUT ?offset=N → FileUploadStatus
FILE_COMMIT_PATH = "/workspaces/files/{upload_id}/commit"  # POST → FileUploadStatus
WORKSPACE_PATH = "/workspaces/{digest}"  # GET → Manifest
ATTEMPT_WORKSPACE_PATH = f"{ATTEMPT_PREFIX}/workspace"  # GET → Manifest (the job's)
ATTEMPT_WORKSPACE_FILE_PATH = f"{ATTEMPT_PREFIX}/workspace/files/{{sha256}}"  # GET → bytes

# -- the rules of a manifest -------------------------------------------------------------------
SHA256_PATTERN = r"^[0-9a-f]{64}$"
MODE_FILE = 0o644
MODE_EXECUTABLE = 0o755  # the executable bit is the only one kept
MAX_PART_BYTES = 255  # NAME_MAX on Linux
_BAD_PARTS = ("//", "/./", "/../")  # an empty, "." or ".." part, within "/" + path + "/"
_LONG_PART_RE = re.compile(rb"[^/]{%d}" % (MAX_PART_BYTES + 1))
_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1 control characters
MAX_MISSING_FILES = 5000  # files per MissingFiles request (~100 bytes of JSON each)
LARGEST_SHOWN = 5  # files a too-large error names
# The settings a too-large workspace names (service.core.config: workspace_max_*).
MAX_BYTES_SETTING = "DDPQ_WORKSPACE_MAX_BYTES"
MAX_FILES_SETTING = "DDPQ_WORKSPACE_MAX_FILES"


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot name a file of a workspace, or None when it can.

    A workspace path is a normalised relative POSIX path: no leading ``/``, no empty, ``.``
    or ``..`` part, no backslash, no NUL or other control character, valid UTF-8, at most
    ``MAX_PATH_BYTES`` bytes with parts of at most ``MAX_PART_BYTES``.
    """
    if not path:
        return "the path is empty"
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        return "the name is not valid UTF-8 (rename the file)"
    if _CONTROL_RE.search(path):
        return "it holds a NUL or another control character"
    if "\\" in path:
        return "it holds a backslash (paths are POSIX: parts joined by '/')"
    if path.startswith("/"):
        return "it is absolute (paths are relative to the workspace)"
    if len(encoded) > MAX_PATH_BYTES:
        return f"it is longer than {MAX_PATH_BYTES} bytes"
    # C-level checks first: a path of 2,000 parts is checked without a Python-level loop.
    wrapped = f"/{path}/"
    if any(bad in wrapped for bad in _BAD_PARTS) or _LONG_PART_RE.search(encoded):
        for part in path.split("/"):
            if part in ("", ".", ".."):
                shown = "an empty part ('//' or a trailing '/')" if not part else f"a {part!r} part"
                return f"it has {shown}: write the normalised path"
            if len(part.encode("utf-8")) > MAX_PART_BYTES:
                return f"its part {part[:40]!r}… is longer than {MAX_PART_BYTES} bytes"
    return None


def _check_path(path: str) -> str:
    problem = path_problem(path)
    if problem is not None:
        raise ValueError(f"workspace path {path!r}: {problem}")
    return path


def _check_mode(mode: int) -> int:
    if mode not in (MODE_FILE, MODE_EXECUTABLE):
        raise ValueError(f"mode {mode:#o}: a workspace file is 0o644 or 0o755 (executable)")
    return mode


WorkspacePath = Annotated[str, AfterValidator(_check_path)]
Sha256 = Annotated[str, Field(pattern=SHA256_PATTERN)]
# Strict: JSON ``false`` is not a size of 0 bytes (lax mode would take it for one).
SizeBytes = Annotated[int, Field(ge=0, le=MAX_SIZE_BYTES, strict=True)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkspaceFile(_Wire):
    """One shipped file: ``path`` (see ``path_problem``), ``mode`` 0o644 or 0o755,
    ``size_bytes`` and the sha256 (64 lowercase hex) of its content."""

    path: WorkspacePath
    mode: Annotated[int, AfterValidator(_check_mode)]
    size_bytes: SizeBytes
    sha256: Sha256


class Manifest(_Wire):
    """A workspace: its files, each path once, no path both a file and a directory of
    another (``a`` and ``a/b``). Order carries no meaning (``digest()`` sorts)."""

    files: list[WorkspaceFile]

    @model_validator(mode="after")
    def _one_tree(self) -> Manifest:
        # Sorted, a path's descendants ``p/…`` follow one another from the first path not
        # below ``p + "/"``: one bisect per file. Linear in the bytes of the paths (times a
        # log), where walking each path's parents is quadratic in a deep path's length
        # (8 s for an 11 MB body of 2,700 paths 2,000 levels deep).
        ordered = sorted(f.path for f in self.files)
        for before, path in itertools.pairwise(ordered):
            if before == path:
                raise ValueError(f"workspace path {path!r} is listed twice")
        for path in ordered:
            below = path + "/"
            i = bisect.bisect_left(ordered, below)
            if i < len(ordered) and ordered[i].startswith(below):
                raise ValueError(
                    f"workspace path {path!r} is a file and also the directory of {ordered[i]!r}"
                )
        return self

    def digest(self) -> str:
        """The workspace's id: sha256 hex of the UTF-8 bytes of
        ``"".join(f"{path}\\0{mode:o}\\0{sha256}\\n")`` over the files sorted by path."""
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.path):
            h.update(f"{f.path}\0{f.mode:o}\0{f.sha256}\n".encode())
        return h.hexdigest()

    @property
    def total_bytes(self) -> int:
        """The files' sizes added up (bytes)."""
        return sum(f.size_bytes for f in self.files)

    @property
    def file_count(self) -> int:
        """How many files it has."""
        return len(self.files)

    def check_limits(self, *, max_bytes: int, max_files: int) -> None:
        """Raise unless the workspace fits ``max_bytes`` in total and ``max_files`` files.

        Raises:
            WorkspaceTooLargeError: naming the setting to raise and the five largest files.
        """
        check_limits(((f.path, f.size_bytes) for f in self.files), max_bytes, max_files)


def format_size(size_bytes: int) -> str:
    """``1536`` → ``"1.5 KiB"``: sizes in messages, in binary units."""
    size = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size_bytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class WorkspaceTooLargeError(DdpqError):
    """A workspace over ``DDPQ_WORKSPACE_MAX_BYTES`` or ``DDPQ_WORKSPACE_MAX_FILES``.

    Attributes: ``setting`` (the variable to raise), ``limit`` and ``actual`` (bytes or files),
    ``file_count``, ``total_bytes`` and ``largest``: up to five ``(path, size_bytes)``,
    largest first. ``exclude_with`` names where the client excludes files (``.gitignore``).
    ``summary`` and ``fix`` are the message's first and last parts, for a CLI to lay out.
    """

    status_code = 413
    code = "workspace_too_large"

    def __init__(
        self,
        *,
        setting: str,
        limit: int,
        file_count: int,
        total_bytes: int,
        largest: list[tuple[str, int]],
        exclude_with: str | None = None,
    ) -> None:
        self.setting, self.limit, self.largest = setting, limit, largest
        self.file_count, self.total_bytes = file_count, total_bytes
        if setting == MAX_BYTES_SETTING:
            self.actual = total_bytes
            what = f"{format_size(total_bytes)} is more than {format_size(limit)}"
        else:
            self.actual = file_count
            what = f"{file_count} files are more than {limit}"
        where = f" (list them in {exclude_with})" if exclude_with else ""
        self.summary = f"the workspace is too large: {what} ({setting})"
        self.fix = (
            f"exclude what the job does not need{where}, or raise {setting} on the API server "
            "and where ddpq runs"
        )
        shown = ", ".join(f"{path} ({format_size(size)})" for path, size in largest)
        super().__init__(f"{self.summary}; its largest files: {shown}. To fix: {self.fix}")


def check_limits(
    sizes: Iterable[tuple[str, int]],
    max_bytes: int,
    max_files: int,
    *,
    exclude_with: str | None = None,
) -> None:
    """Raise unless the files ``(path, size_bytes)`` fit ``max_bytes`` and ``max_files``:
    the check a client makes before sending a byte and the API makes again.
    ``exclude_with`` (e.g. ``".gitignore"``) goes into the message's fix.

    Raises:
        WorkspaceTooLargeError: the bytes limit first (when both are passed), with the
            ``LARGEST_SHOWN`` largest files.
    """
    items = list(sizes)
    total = sum(size for _, size in items)
    if total <= max_bytes and len(items) <= max_files:
        return
    largest = heapq.nlargest(LARGEST_SHOWN, items, key=lambda item: (item[1], item[0]))
    over_bytes = total > max_bytes
    raise WorkspaceTooLargeError(
        setting=MAX_BYTES_SETTING if over_bytes else MAX_FILES_SETTING,
        limit=max_bytes if over_bytes else max_files,
        file_count=len(items),
        total_bytes=total,
        largest=largest,
        exclude_with=exclude_with,
    )


# -- request and answer bodies -----------------------------------------------------------------


class FileRef(_Wire):
    """A file by content: its sha256 and size."""

    sha256: Sha256
    size_bytes: SizeBytes


class MissingFiles(_Wire):
    """``POST /workspaces/missing``: the files the client means to use."""

    files: list[FileRef] = Field(max_length=MAX_MISSING_FILES)


class MissingAnswer(_Wire):
    """The sha256 of each asked-for file the server lacks for the caller (upload these)."""

    missing: list[str]


class FileUploadStart(_Wire):
    """``POST /workspaces/files``: one file the client will send (size 0 allowed)."""

    sha256: Sha256
    size_bytes: SizeBytes


class FileUploadStatus(_Wire):
    """Where a file's upload stands: ``received_bytes`` of ``size_bytes`` arrived (the next
    chunk goes at that offset); ``state`` ``receiving`` | ``committed`` | ``abandoned``;
    ``chunk_bytes`` the most one chunk may carry. The same fields, by name, as the
    checkpoint upload's ``UploadStatus`` (less ``step``, plus ``sha256``)."""

    upload_id: int
    sha256: Sha256
    size_bytes: SizeBytes
    received_bytes: SizeBytes
    chunk_bytes: int
    state: str


class WorkspaceCreate(_Wire):
    """``POST /workspaces``: the manifest of uploaded files."""

    manifest: Manifest


class WorkspaceSummary(_Wire):
    """A stored workspace: its digest, file count and total size in bytes."""

    digest: Sha256
    file_count: int
    total_bytes: int
