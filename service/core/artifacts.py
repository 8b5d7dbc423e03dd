"""Where a job's files live under the artifact root, every artifact file name with its parser
(one ``*_name`` to build and one ``parse_*`` to read back each), and confinement of paths to
the root.

Layout::

    <artifact_dir>/jobs/<job_id>/attempt-<n>/rank-<r>.log
    <artifact_dir>/jobs/<job_id>/attempt-<n>/rank-<r>.log.pipe   (local: the FIFO a rank writes
                                       its output into; the worker caps it into rank-<r>.log)
    <artifact_dir>/jobs/<job_id>/attempt-<n>/error-rank-<r>.json   (a rank that raised)
    <artifact_dir>/jobs/<job_id>/attempt-<n>/finished-rank-<r>     (its training code returned)
    <artifact_dir>/jobs/<job_id>/attempt-<n>/result.json, spec.json
    <artifact_dir>/jobs/<job_id>/attempt-<n>/launcher.log
    <artifact_dir>/jobs/<job_id>/attempt-<n>/metrics-spill.jsonl   (rank 0, only while behind)
    <artifact_dir>/jobs/<job_id>/attempt-<n>/workspace/   (a command job's files and cwd)
    <artifact_dir>/workspace-cache/<uid>/<sha256[:2]>/<sha256>   (workspace files this host
                                       fetched, one cache per Unix user the ranks run as)
    <artifact_dir>/jobs/<job_id>/attempt-<n>/slurm/       (submitit's folder, Slurm jobs only;
                                       a link to the array's folder for an array element)
    <artifact_dir>/slurm-arrays/<job_id>-<attempt>/  (a Slurm job array's submitit folder,
                                       named after its element 0; manifest elements.json)
    <artifact_dir>/jobs/<job_id>/checkpoints/step-<step>.pt
    <artifact_dir>/jobs/<job_id>/checkpoints/step-<step>.upload-<id>.pt  (the API's store)
    <artifact_dir>/jobs/<job_id>/checkpoints/.upload-<id>.part          (an upload arriving)
    <artifact_dir>/workspaces/files/upload-<id>    (a workspace file in the API's store)
    <artifact_dir>/workspaces/files/.upload-<id>.part   (a workspace file arriving)
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path, PurePosixPath

from service.core.errors import NotFoundError

# Each name's pattern, written once: its builder below writes exactly what its parser reads
# (a number as ``int`` writes it: ASCII digits, no leading zero; ``step-07.pt`` is not ours).
_N = "(0|[1-9][0-9]*)"
_RANK_LOG_RE = re.compile(rf"rank-{_N}\.log")
_RANK_ERROR_RE = re.compile(rf"error-rank-{_N}\.json")
_RANK_FINISHED_RE = re.compile(rf"finished-rank-{_N}")
_CHECKPOINT_RE = re.compile(rf"step-{_N}\.pt")
_UPLOADED_CHECKPOINT_RE = re.compile(rf"step-{_N}\.upload-{_N}\.pt")
_UPLOAD_PARTIAL_RE = re.compile(rf"\.upload-{_N}\.part")
_DOWNLOAD_RE = re.compile(rf"job-{_N}-step-{_N}\.pt")
_JOB_ID_RE = re.compile(_N)
_TEMPORARY_RE = re.compile(rf"\.(.+)\.(tmp|link)-{_N}-{_N}")
# Globs that find the candidates of a parser in a directory (the parser has the last word).
RANK_ERROR_GLOB = "error-rank-*.json"
RANK_FINISHED_GLOB = "finished-rank-*"
CHECKPOINT_GLOB = "step-*.pt"


def _ints(pattern: re.Pattern[str], name: str) -> tuple[int, ...] | None:
    match = pattern.fullmatch(name)
    return tuple(int(g) for g in match.groups()) if match else None


def rank_log_name(rank: int) -> str:
    """A rank's log file: ``rank-<r>.log``."""
    return f"rank-{int(rank)}.log"


def parse_rank_log_name(name: str) -> int | None:
    """The rank of a ``rank_log_name``; None for any other name."""
    found = _ints(_RANK_LOG_RE, name)
    return found[0] if found else None


def rank_error_name(rank: int) -> str:
    """The error file of a rank that raised: ``error-rank-<r>.json``."""
    return f"error-rank-{int(rank)}.json"


def parse_rank_error_name(name: str) -> int | None:
    """The rank of a ``rank_error_name``; None for any other name."""
    found = _ints(_RANK_ERROR_RE, name)
    return found[0] if found else None


def rank_finished_name(rank: int) -> str:
    """The marker of a rank whose training code returned: ``finished-rank-<r>``."""
    return f"finished-rank-{int(rank)}"


def finished_ranks(attempt_dir: Path) -> list[int]:
    """The ranks of one attempt whose training code returned (``rank_finished_name``), sorted."""
    found = (_ints(_RANK_FINISHED_RE, p.name) for p in attempt_dir.glob(RANK_FINISHED_GLOB))
    return sorted(f[0] for f in found if f)


def rank_error_files(attempt_dir: Path) -> list[Path]:
    """Every rank's error file in one attempt directory (``rank_error_name``), by rank."""
    found = [(parse_rank_error_name(p.name), p) for p in attempt_dir.glob(RANK_ERROR_GLOB)]
    return [p for rank, p in sorted((r, p) for r, p in found if r is not None)]


def checkpoint_name(step: int) -> str:
    """A checkpoint as the ranks write and read it: ``step-<step>.pt``."""
    return f"step-{int(step)}.pt"


def parse_checkpoint_name(name: str) -> int | None:
    """The step of a ``checkpoint_name``; None for any other name (an upload's own name,
    a temporary file)."""
    found = _ints(_CHECKPOINT_RE, name)
    return found[0] if found else None


def uploaded_checkpoint_name(step: int, upload_id: int) -> str:
    """The API's filesystem store's name for an upload's checkpoint, never the ranks'
    ``checkpoint_name`` (a rank sharing the directory may write that one):
    ``step-<step>.upload-<upload_id>.pt``."""
    return f"step-{int(step)}.upload-{int(upload_id)}.pt"


def parse_uploaded_checkpoint_name(name: str) -> tuple[int, int] | None:
    """``(step, upload_id)`` of an ``uploaded_checkpoint_name``; None for any other name."""
    found = _ints(_UPLOADED_CHECKPOINT_RE, name)
    return (found[0], found[1]) if found else None


def upload_partial_name(upload_id: int) -> str:
    """The bytes of an upload still arriving: ``.upload-<upload_id>.part`` (hidden, and no
    ``step-*.pt`` glob matches it)."""
    return f".upload-{int(upload_id)}.part"


def parse_upload_partial_name(name: str) -> int | None:
    """The upload id of an ``upload_partial_name``; None for any other name."""
    found = _ints(_UPLOAD_PARTIAL_RE, name)
    return found[0] if found else None


def checkpoint_download_name(job_id: int, step: int) -> str:
    """The file name a downloaded checkpoint is offered under (``Content-Disposition``, the
    CLI's example): ``job-<job_id>-step-<step>.pt``."""
    return f"job-{int(job_id)}-step-{int(step)}.pt"


def parse_checkpoint_download_name(name: str) -> tuple[int, int] | None:
    """``(job_id, step)`` of a ``checkpoint_download_name``; None for any other name."""
    found = _ints(_DOWNLOAD_RE, name)
    return (found[0], found[1]) if found else None


def slurm_stderr_name(handle: str, task: int = 0) -> str:
    """submitit's stderr file of one Slurm task, in the attempt's ``slurm_dir``:
    ``<handle>_<task>_log.err`` (``handle`` is the Slurm job id, ``<id>_<index>`` for an
    array element)."""
    return f"{handle}_{int(task)}_log.err"


def temporary_path(path: Path, kind: str = "tmp") -> Path:
    """A hidden sibling of ``path`` to write (``kind`` ``"tmp"``) or link (``"link"``) before
    an atomic rename onto ``path``, unique to this process and thread:
    ``.<name>.<kind>-<pid>-<thread>``. Hidden, so no glob of the names above (``step-*.pt``)
    takes it for a finished file."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{threading.get_ident()}")


def parse_temporary_name(name: str) -> tuple[str, str] | None:
    """``(final name, kind)`` of a ``temporary_path``'s name; None for any other name."""
    match = _TEMPORARY_RE.fullmatch(name)
    return (match[1], match[2]) if match else None


def relative_checkpoint_path(job_id: int, step: int) -> str:
    """``jobs/<id>/checkpoints/step-<step>.pt``, relative to an artifact root (POSIX)."""
    return checkpoint_path(Path(), job_id, step).as_posix()


def job_of_relative_path(relative: str, *, under: str | None = None) -> int | None:
    """The job whose directory holds ``relative`` (a POSIX path relative to the artifact
    root, ``artifact_relative_path``): ``jobs/<job_id>/…``, and with ``under`` (e.g.
    ``"checkpoints"``) only a file inside that sub-directory of it. None otherwise."""
    parts = PurePosixPath(relative).parts
    # Only the canonical spelling (``job_dir``'s): ``jobs/07`` is not job 7's directory.
    if len(parts) < 2 or parts[0] != "jobs" or not _JOB_ID_RE.fullmatch(parts[1]):
        return None
    if under is not None and (len(parts) < 4 or parts[2] != under):
        return None
    return int(parts[1])


def job_dir(artifact_dir: Path, job_id: int) -> Path:
    """``<artifact_dir>/jobs/<job_id>``."""
    return artifact_dir / "jobs" / str(int(job_id))


def attempt_dir(artifact_dir: Path, job_id: int, attempt: int) -> Path:
    """Directory of one attempt's logs: ``…/jobs/<id>/attempt-<n>``."""
    return job_dir(artifact_dir, job_id) / f"attempt-{int(attempt)}"


def workspace_dir(artifact_dir: Path, job_id: int, attempt: int) -> Path:
    """A command job's working directory on one host: its workspace's files, fetched for
    this attempt, writable by its ranks (``…/attempt-<n>/workspace``)."""
    return attempt_dir(artifact_dir, job_id, attempt) / "workspace"


def workspace_cache_dir(artifact_dir: Path) -> Path:
    """The parent of every rank user's workspace cache (``…/workspace-cache``)."""
    return artifact_dir / "workspace-cache"


def user_workspace_cache_dir(artifact_dir: Path, uid: int) -> Path:
    """Workspace files a host fetched for the ranks of Unix user ``uid``, by sha256
    (``…/workspace-cache/<uid>/<sha[:2]>/<sha>``), so a host fetches a file once whatever job
    or attempt of that user names it, and one owner's user never reads another's files."""
    return workspace_cache_dir(artifact_dir) / str(int(uid))


def workspace_store_dir(artifact_dir: Path) -> Path:
    """The API's filesystem store of workspace files (``…/workspaces``), read by the API only."""
    return artifact_dir / "workspaces"


def rank_log_path(artifact_dir: Path, job_id: int, attempt: int, rank: int) -> Path:
    """Log file of one rank of one attempt: ``…/attempt-<n>/rank-<r>.log``."""
    return attempt_dir(artifact_dir, job_id, attempt) / rank_log_name(rank)


def rank_log_pipe_path(artifact_dir: Path, job_id: int, attempt: int, rank: int) -> Path:
    """The FIFO a local rank points its fds 1/2 at: ``…/attempt-<n>/rank-<r>.log.pipe``
    (the local worker reads it and writes ``rank_log_path``, capped)."""
    return rank_log_path(artifact_dir, job_id, attempt, rank).with_name(
        f"{rank_log_name(rank)}.pipe"
    )


def checkpoint_dir(artifact_dir: Path, job_id: int) -> Path:
    """Checkpoints of a job, shared by its attempts so a relaunch finds them."""
    return job_dir(artifact_dir, job_id) / "checkpoints"


def checkpoint_path(artifact_dir: Path, job_id: int, step: int) -> Path:
    """``…/jobs/<id>/checkpoints/step-<step>.pt``."""
    return checkpoint_dir(artifact_dir, job_id) / checkpoint_name(step)


def workspace_upload_path(artifact_dir: Path, upload_id: int) -> Path:
    """Where the filesystem store keeps workspace upload ``upload_id``'s partial bytes (beside
    the file it becomes: finalizing is a rename within one directory)."""
    return workspace_store_dir(artifact_dir) / "files" / upload_partial_name(upload_id)


def workspace_file_path(artifact_dir: Path, upload_id: int) -> Path:
    """Where the filesystem store keeps the workspace file upload ``upload_id`` brought (named
    by the upload, not the sha256: two owners' copies of one content are two files)."""
    return workspace_store_dir(artifact_dir) / "files" / f"upload-{int(upload_id)}"


def confine(artifact_dir: Path, path: str | Path, *, must_exist: bool = True) -> Path:
    """Resolve ``path`` (symlinks followed) and require it to lie inside ``artifact_dir``.

    Whatever a job's ranks left there (a ``rank-0.log`` symlinked to ``/etc/passwd``, a
    ``jobs/<id>`` directory linked elsewhere) or a database row names, the resolved path is
    what gets read. Open the returned path, not ``path``.

    Args:
        must_exist: also require an existing regular file; False lets a file that is not
            written yet (a rank's log) pass, as long as it would lie inside.
    Raises:
        NotFoundError: the path escapes the artifact directory, cannot be resolved (a
            symlink loop), is something other than a regular file (a directory, a FIFO),
            or (``must_exist``) does not exist.
    """
    root = artifact_dir.resolve()
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        raise NotFoundError("file not found") from None
    if not resolved.is_relative_to(root):
        raise NotFoundError("file not found")
    # Not a regular file: a directory, or a FIFO whose open() would block a server thread.
    if (must_exist or resolved.exists()) and not resolved.is_file():
        raise NotFoundError("file not found")
    return resolved


def artifact_relative_path(artifact_dir: Path, stored: str) -> str | None:
    """``stored`` (absolute, or relative to ``artifact_dir``) as a POSIX path relative to
    ``artifact_dir``, symlinks resolved; None when it lies outside (never leak server paths)."""
    root = artifact_dir.resolve()
    path = Path(stored)
    try:
        resolved = (path if path.is_absolute() else root / path).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        return None
    if not resolved.is_relative_to(root) or resolved == root:
        return None
    return resolved.relative_to(root).as_posix()


def result_path(artifact_dir: Path, job_id: int, attempt: int) -> Path:
    """Written by rank 0 once training finished, before teardown: ``…/attempt-<n>/result.json``.

    Its presence decides success even if the process group aborts at interpreter exit.
    """
    return attempt_dir(artifact_dir, job_id, attempt) / "result.json"


def spec_path(artifact_dir: Path, job_id: int, attempt: int) -> Path:
    """The job spec the worker wrote for one attempt before starting its ranks, as JSON:
    ``…/attempt-<n>/spec.json`` (ranks read it there, not from the database)."""
    return attempt_dir(artifact_dir, job_id, attempt) / "spec.json"


def launcher_log_path(artifact_dir: Path, job_id: int, attempt: int) -> Path:
    """The launcher's own stdout/stderr (torchrun's output): ``…/attempt-<n>/launcher.log``."""
    return attempt_dir(artifact_dir, job_id, attempt) / "launcher.log"


def slurm_dir(artifact_dir: Path, job_id: int, attempt: int) -> Path:
    """submitit's folder for one Slurm attempt (sbatch script, pickles, per-task stdout/stderr):
    ``…/attempt-<n>/slurm``. It must be on a file system every Slurm node shares."""
    return attempt_dir(artifact_dir, job_id, attempt) / "slurm"


def slurm_array_dir(artifact_dir: Path, first_job_id: int, first_attempt: int) -> Path:
    """submitit's folder for one Slurm job array, shared by its elements (one sbatch script,
    a pickle and stdout/stderr per element, the ``elements.json`` manifest):
    ``<artifact_dir>/slurm-arrays/<job_id>-<attempt>`` after element 0's attempt."""
    return artifact_dir / "slurm-arrays" / f"{int(first_job_id)}-{int(first_attempt)}"


def rank_error_path(artifact_dir: Path, job_id: int, attempt: int, rank: int) -> Path:
    """Written by a rank that raised: ``…/attempt-<n>/error-rank-<r>.json``
    (``{"rank", "exc_type", "message", "traceback", "time"}``)."""
    return attempt_dir(artifact_dir, job_id, attempt) / rank_error_name(rank)


def metrics_spill_path(artifact_dir: Path, job_id: int, attempt: int, writer: str = "") -> Path:
    """Where rank 0 spills metric points it could not write yet (database down or slow), one
    JSON object per line, oldest first: ``…/attempt-<n>/metrics-spill.jsonl``, or
    ``metrics-spill-<writer>.jsonl`` for a second writer of the same rank (a command job's
    script beside its rank process). Removed once replayed; left behind (with every unsent
    point) only if the database never came back."""
    suffix = f"-{writer}" if writer else ""
    return attempt_dir(artifact_dir, job_id, attempt) / f"metrics-spill{suffix}.jsonl"
