"""Slurm job arrays: many attempts (a sweep's trials) as one sbatch submission.

``plan_arrays`` turns the attempts' own plans (``SlurmLauncher.plan``) into arrays: attempts
whose sbatch parameters agree (resources, partition, time…) share an array, chunked below the
cluster's ``MaxArraySize``; each element is a full DDP job (``--nodes`` × ``--ntasks-per-node``,
one Slurm task per rank, as a single job's). The array's script selects each element's ddpq
variables by ``SLURM_ARRAY_TASK_ID`` (a ``case``), so they are in every rank's environment
from its start; each element's attempt token travels in its own submitit pickle. The array's
folder (``artifacts.slurm_array_dir``) holds ``elements.json`` (index → job id, attempt), the
fact a worker that did not submit the array reads to follow its elements; each element's
attempt directory links ``slurm`` to it, so a job's Slurm logs are where a single job's are.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.core import artifacts
from worker.attempt import inherited_env
from worker.errors import LaunchError
from worker.launchers.base import ArrayPlan, LaunchPlan, write_plan_files
from worker.launchers.slurm.cluster import array_chunks, refusal_message
from worker.launchers.slurm.params import SlurmBatchRequest
from worker.launchers.slurm.rank import SlurmRank
from worker.launchers.slurm.states import parse_array_name, slurm_array_name
from worker.launchers.slurm.submitit_adapter import (
    sbatch_script,
    set_array_size,
    submission_script,
    submit_array,
    submit_with_environment,
    task_command,
)

MANIFEST = "elements.json"
# Per-attempt sbatch parameters: the array has its own name, and its setup picks each
# element's from these.
PER_ATTEMPT_PARAMETERS = frozenset({"job_name", "setup"})


@dataclass(frozen=True)
class SlurmArrayRequest:
    """What ``start_array_plan`` submits besides the script: submitit's ``folder`` for the
    array and the ``parameters`` (submitit's names; ``array_parallelism`` included) the
    script was rendered from. No secret: the tokens travel in the elements' pickles."""

    folder: str
    parameters: dict[str, Any]


def element_setup(setups: Sequence[Sequence[str]]) -> list[str]:
    """The array script's setup: element ``i`` runs ``setups[i]`` (its ``export`` lines),
    chosen by ``SLURM_ARRAY_TASK_ID``; an index with no element stops. Pure."""
    lines = ['case "${SLURM_ARRAY_TASK_ID:-}" in']
    for i, setup in enumerate(setups):
        lines.append(f"    {i})")
        lines += [f"        {line}" for line in setup]
        lines.append("        ;;")
    lines += [
        "    *)",
        '        echo "ddpq: no attempt for array index ${SLURM_ARRAY_TASK_ID:-unset}" >&2',
        "        exit 1",
        "        ;;",
        "esac",
    ]
    return lines


def _shared_key(request: SlurmBatchRequest) -> str:
    shared = {k: v for k, v in request.parameters.items() if k not in PER_ATTEMPT_PARAMETERS}
    return json.dumps(shared, sort_keys=True, default=str)


def plan_arrays(
    plans: Sequence[LaunchPlan[SlurmBatchRequest]],
    *,
    parallelism: int | None,
    python: str,
    artifact_dir: Path,
    max_array_size: int,
) -> list[ArrayPlan[SlurmArrayRequest]]:
    """The job arrays that start ``plans``, in order: plans with equal sbatch parameters (but
    name and setup) share arrays of at most ``max_array_size`` elements, at most
    ``parallelism`` (None: all) of each running at once (``%p``). Pure.

    Raises:
        LaunchError: a plan was not made by ``SlurmLauncher.plan``, or arrays are disabled
            (``max_array_size`` 0).
    """
    groups: dict[str, list[LaunchPlan[SlurmBatchRequest]]] = {}
    for plan in plans:
        if not isinstance(plan.request, SlurmBatchRequest):
            raise LaunchError("a Slurm array needs plans made by SlurmLauncher.plan()")
        groups.setdefault(_shared_key(plan.request), []).append(plan)
    arrays: list[ArrayPlan[SlurmArrayRequest]] = []
    for group in groups.values():
        try:
            chunks = array_chunks(len(group), max_array_size)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        for chunk in chunks:
            arrays.append(_array_plan(group[chunk.start : chunk.stop], parallelism, python,
                                      artifact_dir))  # fmt: skip
    return arrays


def _array_plan(
    elements: Sequence[LaunchPlan[SlurmBatchRequest]],
    parallelism: int | None,
    python: str,
    artifact_dir: Path,
) -> ArrayPlan[SlurmArrayRequest]:
    first = elements[0]
    assert first.request is not None  # checked by plan_arrays
    folder = artifacts.slurm_array_dir(artifact_dir, first.job_id, first.attempt)
    n = len(elements)
    p = max(1, min(parallelism or n, n))
    params = {k: v for k, v in first.request.parameters.items() if k not in PER_ATTEMPT_PARAMETERS}
    params["job_name"] = slurm_array_name(first.job_id, first.attempt)
    params["setup"] = element_setup([e.request.parameters["setup"] for e in elements if e.request])
    params["array_parallelism"] = p
    script = sbatch_script(task_command(python, folder), folder, {**params, "map_count": n})
    return ArrayPlan(
        launcher=first.launcher,
        elements=tuple(elements),
        parallelism=p,
        script=script,
        request=SlurmArrayRequest(folder=str(folder), parameters=params),
    )


def write_manifest(folder: Path, elements: Sequence[LaunchPlan[Any]]) -> None:
    """``elements.json`` in the array's folder: ``{"<index>": [job_id, attempt]}``."""
    data = {str(i): [e.job_id, e.attempt] for i, e in enumerate(elements)}
    tmp = artifacts.temporary_path(folder / MANIFEST)
    tmp.write_text(json.dumps(data))
    tmp.replace(folder / MANIFEST)


def element_attempt(artifact_dir: Path, job_name: str, handle: str) -> tuple[int, int] | None:
    """``(job_id, attempt)`` that array element ``handle`` (``<id>_<index>``) of the array
    named ``job_name`` runs, from the array's manifest; None when the name is no array's or
    the manifest does not say."""
    first = parse_array_name(job_name)
    _, sep, index = handle.partition("_")
    if first is None or not sep:
        return None
    path = artifacts.slurm_array_dir(artifact_dir, *first) / MANIFEST
    try:
        entry = json.loads(path.read_text()).get(index)
        return (int(entry[0]), int(entry[1])) if entry else None
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return None


def start_array_plan(
    plan: ArrayPlan[SlurmArrayRequest], *, python: str, artifact_dir: Path
) -> list[str]:
    """Prepare the array's folder (mode 0700: the pickles hold the tokens) and manifest, each
    element's attempt directory (its spec, its ``slurm`` link), then submit the array through
    submitit with the allow-listed environment. Returns the element ids, in element order.

    Raises:
        LaunchError: the folders could not be prepared, Slurm is not installed, the script
            submitit would submit differs from the plan, or sbatch refused the array.
    """
    from submitit.slurm.slurm import SlurmExecutor

    if plan.request is None or not plan.elements:
        raise LaunchError("a Slurm array needs its SlurmArrayRequest and elements (plan_array)")
    folder = Path(plan.request.folder)
    params = dict(plan.request.parameters)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)
        write_manifest(folder, plan.elements)
        for element in plan.elements:
            Path(element.log_dir).mkdir(parents=True, exist_ok=True)
            write_plan_files(element)
            link = artifacts.slurm_dir(artifact_dir, element.job_id, element.attempt)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(folder, target_is_directory=True)
    except (OSError, ValueError) as exc:
        raise LaunchError(f"could not prepare {folder}: {exc}") from exc
    try:
        executor = SlurmExecutor(folder=folder, python=shlex.quote(python))
    except RuntimeError as exc:
        raise LaunchError(f"cannot submit to Slurm: {exc}") from exc
    executor.update_parameters(**params)
    submit_with_environment(executor, inherited_env(os.environ))
    set_array_size(executor, len(plan.elements))
    if submission_script(executor) != plan.script:
        raise LaunchError("the sbatch script submitit would submit differs from the plan")
    ranks = [SlurmRank(env=dict(element.env)) for element in plan.elements]
    try:
        array_id = submit_array(executor, ranks)
    except Exception as exc:  # submitit wraps sbatch's failure in several types
        raise LaunchError(refusal_message(params, exc)) from exc
    return [f"{array_id}_{i}" for i in range(len(plan.elements))]
