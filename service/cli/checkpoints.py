"""`ddpq checkpoints N`: a job's committed checkpoints as a table (or JSON), and
`--download STEP -o FILE`: one of them, streamed from whichever store holds it, with a
progress bar for big files, verified by sha256 before it takes the file's name."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from service.cli.common import (
    JSON_OPTION,
    app,
    err,
    fail,
    friendly_errors,
    make_client,
    out,
    print_json,
)
from service.cli.job_data import checkpoints_table
from service.cli.output import format_bytes
from service.client import ChecksumMismatchError
from service.core.artifacts import checkpoint_download_name

# Files at least this big get a progress bar (on stderr, when it is a terminal).
PROGRESS_MIN_BYTES = 16 * 2**20


@app.command()
def checkpoints(
    job_id: Annotated[int, typer.Argument(help="Job id.")],
    download: Annotated[
        int | None,
        typer.Option("--download", metavar="STEP", help="Download the checkpoint at STEP."),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="File to write the download to (with --download)."),
    ] = None,
    as_json: Annotated[bool, JSON_OPTION] = False,
) -> None:
    """Print a job's checkpoints, newest step first (--json: {"checkpoints": [...]}, epoch
    0-based there, as the API gives it); or, with --download STEP -o FILE, save one."""
    if download is None:
        if output is not None:
            fail(
                "-o/--output needs --download STEP",
                "e.g. ddpq checkpoints 7 --download 100 -o ckpt.pt",
            )
        with friendly_errors():
            job_checkpoints = make_client().checkpoints(job_id)
        if as_json:
            print_json({"checkpoints": job_checkpoints})
            return
        out.print(checkpoints_table(job_id, job_checkpoints))
        return
    if output is None:
        fail(
            "--download needs -o FILE",
            f"e.g. ddpq checkpoints {job_id} --download {download} -o ckpt.pt",
        )
    if output.is_dir():
        fail(
            f"{output} is a directory",
            f"name a file, e.g. -o {output / checkpoint_download_name(job_id, download)}",
        )
    _download(job_id, download, output)


def _download(job_id: int, step: int, output: Path) -> None:
    progress = Progress(
        TextColumn("[bold]step {task.fields[step]}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )
    task = progress.add_task("download", total=None, step=step, visible=False)

    def on_progress(done: int, total: int) -> None:
        if total >= PROGRESS_MIN_BYTES:
            progress.update(task, completed=done, total=total, visible=True)

    with friendly_errors(), progress:
        try:
            path = make_client().download_checkpoint(job_id, step, output, on_progress=on_progress)
        except ChecksumMismatchError as exc:
            fail(str(exc.detail), "run the same command again", code=1)
        except OSError as exc:
            fail(f"cannot write {output}: {exc.strerror or exc}", "choose a file you may write")
    size = path.stat().st_size
    out.print(
        f"saved job {job_id}'s checkpoint at step {step} to {path} "
        f"({format_bytes(size)}, sha256 verified)"
    )
