"""The one place that touches submitit's private names.

submitit's public API submits pickled functions; ddpq also needs the exact sbatch script it
would submit (to render and golden-test a plan before any side effect), its memory and node
list syntax, and the per-task command. Those live behind ``_``-prefixed names that a submitit
release may rename, so every use is wrapped here and ``PRIVATE_NAMES`` lists them for the
unit test that pins them against the installed submitit.

submitit is imported inside each function: importing the Slurm launcher's modules stays cheap
and needs no submitit until a Slurm plan is made.
"""

from __future__ import annotations

import importlib
import shlex
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from submitit.slurm.slurm import SlurmExecutor

# The module each Slurm task runs: it loads the pickled function and calls it.
SUBMIT_MODULE = "submitit.core._submit"

# Every private name used below, as (module, dotted attribute or "" for the module itself).
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("submitit.slurm.slurm", "_make_sbatch_string"),
    ("submitit.slurm.slurm", "_convert_mem"),
    ("submitit.slurm.slurm", "_parse_node_list"),
    ("submitit.slurm.slurm", "SlurmExecutor._make_submission_file_text"),
    ("submitit.slurm.slurm", "SlurmExecutor._submitit_command_str"),
    ("submitit.slurm.slurm", "SlurmExecutor._make_submission_command"),
    ("submitit.slurm.slurm", "SlurmExecutor._submit_command"),
    (SUBMIT_MODULE, ""),
)


def missing_private_names() -> list[str]:
    """The entries of ``PRIVATE_NAMES`` the installed submitit lacks, as ``module:attr``
    (``module`` alone for a missing module); empty when all exist."""
    missing: list[str] = []
    for module_name, attr in PRIVATE_NAMES:
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        for part in attr.split(".") if attr else ():
            if not hasattr(obj, part):
                missing.append(f"{module_name}:{attr}")
                break
            obj = getattr(obj, part)
    return missing


def submitit_version() -> str:
    """The installed submitit's version string."""
    import submitit

    return str(getattr(submitit, "__version__", "unknown"))


def task_command(python: str, folder: Path) -> str:
    """The command every Slurm task runs, as ``SlurmExecutor._submitit_command_str`` builds it
    (``<python> -u -m submitit.core._submit <folder>``, with ``python`` shell-quoted)."""
    return f"{shlex.quote(python)} -u -m {SUBMIT_MODULE} {shlex.quote(str(folder))}"


def sbatch_script(command: str, folder: Path, parameters: dict[str, Any]) -> str:
    """The sbatch script submitit writes for ``parameters`` (``SlurmExecutor``'s names).

    Wraps ``submitit.slurm.slurm._make_sbatch_string``. Pure.

    Raises:
        ValueError: submitit rejects a parameter.
    """
    from submitit.slurm.slurm import _make_sbatch_string

    return str(_make_sbatch_string(command=command, folder=folder, **parameters))


def submission_script(executor: SlurmExecutor) -> str:
    """The sbatch script ``executor`` will submit next, with its current parameters.

    Wraps ``executor._make_submission_file_text(executor._submitit_command_str, "")``: what
    ``executor.submit`` writes, so a plan can be checked against it before submitting.
    """
    return str(executor._make_submission_file_text(executor._submitit_command_str, ""))


def convert_mem(mem_gb: float) -> str:
    """sbatch's ``--mem`` value for ``mem_gb`` gigabytes (``4`` → ``"4GB"``, ``0.5`` →
    ``"512MB"``). Wraps ``submitit.slurm.slurm._convert_mem``."""
    from submitit.slurm.slurm import _convert_mem

    return str(_convert_mem(mem_gb))


def parse_node_list(nodelist: str) -> list[str]:
    """The host names of a Slurm node list (``ddpq-n[1-2],gpu7`` → ``["ddpq-n1", "ddpq-n2",
    "gpu7"]``). Wraps ``submitit.slurm.slurm._parse_node_list``.

    Raises:
        submitit.slurm.slurm.SlurmParseException: the list is malformed.
    """
    from submitit.slurm.slurm import _parse_node_list

    return [str(node) for node in _parse_node_list(nodelist)]


def submit_with_environment(executor: SlurmExecutor, environ: dict[str, str]) -> None:
    """Have ``executor`` run sbatch with exactly ``environ`` (``env -i NAME=value … sbatch``):
    sbatch hands its whole environment to the job (``--export=ALL``), and the worker's holds
    its database URL. Wraps ``SlurmExecutor._make_submission_command``. The values appear on
    sbatch's command line: pass only what is not secret (``worker.attempt.inherited_env``).
    """
    make_command = executor._make_submission_command
    assignments = [f"{name}={value}" for name, value in sorted(environ.items())]

    def _scrubbed(submission_file_path: Path) -> list[str]:
        return ["env", "-i", *assignments, *make_command(submission_file_path)]

    executor._make_submission_command = _scrubbed  # type: ignore[method-assign]


# submitit's own name for the size of a job array (an argument of ``_make_sbatch_string`` that
# ``update_parameters`` refuses: submitit sets it only on the executor copy it arrays with).
ARRAY_SIZE_PARAMETER = "map_count"


def set_array_size(executor: SlurmExecutor, n: int) -> None:
    """Make ``executor``'s next submission a job array of ``n`` elements (``--array=0-<n-1>%<p>``
    with ``p`` its ``array_parallelism``; stdout/stderr per element, ``%A_%a``)."""
    executor.parameters[ARRAY_SIZE_PARAMETER] = int(n)


def submit_array(executor: SlurmExecutor, functions: Sequence[Callable[[], Any]]) -> str:
    """Submit ``functions`` as one job array of ``executor`` (sized by ``set_array_size``);
    element ``i`` runs ``functions[i]``. Returns the array's job id (element ``i`` is
    ``<id>_<i>``).

    What ``SlurmExecutor.submit_array`` does, on ``executor`` itself: submitit's arrays go
    through a fresh ``SlurmExecutor`` copy, which would drop ``submit_with_environment`` (and
    sbatch would hand the job the worker's whole environment), and submitit submits one
    function as a plain job, not an array of one. Wraps ``SlurmExecutor._submit_command``.

    Raises:
        ValueError: ``functions`` is empty or its size differs from ``set_array_size``'s.
        Exception: whatever submitit raises when sbatch refuses (the pickles are removed).
    """
    from submitit.core import utils

    n = len(functions)
    if n == 0 or executor.parameters.get(ARRAY_SIZE_PARAMETER) != n:
        raise ValueError(f"call set_array_size(executor, {n}) before submitting {n} function(s)")
    folder = utils.JobPaths.get_first_id_independent_folder(executor.folder)
    folder.mkdir(parents=True, exist_ok=True)
    timeout_min = executor.parameters.get("time", 5)
    pickles: list[Path] = []
    try:
        for function in functions:
            delayed = utils.DelayedSubmission(function)
            path = folder / f"{uuid.uuid4().hex}.pkl"
            delayed.set_timeout(timeout_min, executor.max_num_timeout)
            delayed.dump(path)
            pickles.append(path)
        first = executor._submit_command(executor._submitit_command_str)
    except BaseException:
        for path in pickles:
            path.unlink(missing_ok=True)
        raise
    array_id = str(first.job_id)
    # The elements wait (up to 60 s) for their pickle under their own id, as submitit's do.
    for i, path in enumerate(pickles):
        utils.JobPaths(executor.folder, job_id=f"{array_id}_{i}").move_temporary_file(
            path, "submitted_pickle"
        )
    return array_id
