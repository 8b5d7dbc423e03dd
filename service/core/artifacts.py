"""Where a job's files live under the artifact root, and confinement of paths to it.

Layout::

    <artifact_dir>/jobs/<job_id>/attempt-<n>/rank-<r>.log
    <artifact_dir>/jobs/<job_id>/attempt-<n>/launcher.log
    <artifact_dir>/jobs/<job_id>/attempt-<n>/metrics-spill.jsonl   (rank 0, only while behind)
    <artifact_dir>/jobs/<job_id>/attempt-<n>/slurm/       (submitit's folder, Slurm jobs only;
                                       a link to the array's folder for an array element)
    <artifact_dir>/slurm-arrays/<job_id>-<attempt>/  (a Slurm job array's submitit folder,
                                       named after its element 0; manifest elements.json)
    <artifact_dir>/jobs/<job_id>/checkpoints/step-<step>.pt
"""

from __future__ import annotations

from pathlib import Path

from service.core.errors import NotFoundError


def job_dir(artifact_dir: Path, job_id: int) -> Path:
    """``<artifact_dir>/jobs/<job_id>``."""
    return artifact_dir / "jobs" / str(int(job_id))


def attempt_dir(artifact_dir: Path, job_id: int, attempt: int) -> Path:
    """Directory of one attempt's logs: ``…/jobs/<id>/attempt-<n>``."""
    return job_dir(artifact_dir, job_id) / f"attempt-{int(attempt)}"


def rank_log_path(artifact_dir: Path, job_id: int, attempt: int, rank: int) -> Path:
    """Log file of one rank of one attempt: ``…/attempt-<n>/rank-<r>.log``."""
    return attempt_dir(artifact_dir, job_id, attempt) / f"rank-{int(rank)}.log"


def checkpoint_dir(artifact_dir: Path, job_id: int) -> Path:
    """Checkpoints of a job, shared by its attempts so a relaunch finds them."""
    return job_dir(artifact_dir, job_id) / "checkpoints"


def checkpoint_path(artifact_dir: Path, job_id: int, step: int) -> Path:
    """``…/jobs/<id>/checkpoints/step-<step>.pt``."""
    return checkpoint_dir(artifact_dir, job_id) / f"step-{int(step)}.pt"


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
    return attempt_dir(artifact_dir, job_id, attempt) / f"error-rank-{int(rank)}.json"


def metrics_spill_path(artifact_dir: Path, job_id: int, attempt: int) -> Path:
    """Where rank 0 spills metric points it could not write yet (database down or slow), one
    JSON object per line, oldest first: ``…/attempt-<n>/metrics-spill.jsonl``. Removed once
    replayed; left behind (with every unsent point) only if the database never came back."""
    return attempt_dir(artifact_dir, job_id, attempt) / "metrics-spill.jsonl"
