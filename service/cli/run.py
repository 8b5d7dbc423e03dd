"""`ddpq run`: run the user's own script as a command job. Pack the working directory, print
what goes (file count, total size, the five largest files), upload what the API lacks, submit,
and with --wait follow the job as `ddpq submit --wait` does."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from service.cli.common import (
    app,
    err,
    fail,
    friendly_errors,
    load_settings,
    make_client,
    out,
    print_json,
)
from service.cli.jobs import wait_for_job, with_overrides
from service.cli.output import cell
from service.cli.queue_output import format_dry_run
from service.cli.workspace_output import (
    check_before_upload,
    pack_or_fail,
    print_missing,
    print_pack_summary,
    upload_and_say,
)
from service.core.launchers import launcher_names
from service.workspaces.command import command_job_spec, plan_command

COMMAND_HELP = (
    "What to run, as you would type it: train.py ARGS, -m pkg.train ARGS, python train.py "
    "ARGS or torchrun [--nproc-per-node N] [--nnodes N] [--standalone] train.py ARGS. Put "
    "it after `--` (or after ddpq run's own options: everything from the script on is the "
    "script's)."
)


def _launcher(value: str | None) -> str | None:
    if value is not None and value not in launcher_names():
        raise typer.BadParameter(f"{value!r}: choose one of {', '.join(launcher_names())}")
    return value


def parse_env(assignments: list[str]) -> dict[str, str]:
    """``["LR=0.1", "MODE=fast"]`` → ``{"LR": "0.1", "MODE": "fast"}`` (the last of a name
    wins); exits 2 for one without ``=`` or a name. Which names are allowed is the API's
    call (its 422 names the field)."""
    env: dict[str, str] = {}
    for assignment in assignments:
        name, eq, value = assignment.partition("=")
        if not eq or not name:
            fail(f"--env {assignment!r}: write NAME=VALUE", "e.g. --env LR=0.1 (repeatable)")
        env[name] = value
    return env


# ddpq run's flags that change what happens (a real job instead of a plan, a wait, the output
# format): after the script, without `--`, they are the script's, which is rarely meant.
_OWN_FLAGS = ("--dry-run", "--wait", "--json")
_SEPARATED = "ddpq_run_separated"


class _RunCommand(TyperCommand):
    """``ddpq run``'s command, noting whether its arguments hold ``--`` (click drops it)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer's vendored click
        ctx.meta[_SEPARATED] = "--" in args
        return super().parse_args(ctx, args)


def check_flag_placement(command: list[str], *, separated: bool) -> None:
    """Exit 2 when one of ``_OWN_FLAGS`` follows the script without a ``--`` having said
    where ddpq run's options end (``ddpq run -n 2 train.py --dry-run`` would else upload and
    queue a real job, handing ``--dry-run`` to the script)."""
    misplaced = [a for a in command[1:] if a in _OWN_FLAGS]
    if separated or not misplaced:
        return
    flags = " ".join(misplaced)
    fail(
        f"{flags} comes after the script {command[0]!r}, so it is the script's argument, not "
        "ddpq run's; nothing was sent",
        f"put ddpq run's options before the script (ddpq run {flags} … {command[0]} …), or, "
        f"if the script takes {flags} itself, write the command after `--`",
    )


@app.command(
    "run",
    cls=_RunCommand,
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def run_command(
    ctx: typer.Context,
    command: Annotated[
        list[str] | None, typer.Argument(metavar="COMMAND", help=COMMAND_HELP, show_default=False)
    ] = None,
    nproc_per_node: Annotated[
        int | None, typer.Option("-n", "--nproc-per-node", min=1, help="Ranks per node.")
    ] = None,
    nnodes: Annotated[int | None, typer.Option(min=1, help="Nodes.")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(min=0, help="GPUs per node.")] = None,
    launcher: Annotated[
        str | None,
        typer.Option(callback=_launcher, help=f"{' | '.join(launcher_names())} (default local)."),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="The job's name (default: the script's).")
    ] = None,
    workdir: Annotated[
        Path, typer.Option(help="The directory shipped and run in (default: this one).")
    ] = Path("."),
    set_values: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="PATH=VALUE",
            help="Set a spec field by dotted path, e.g. --set max_restarts=2. Repeatable.",
        ),
    ] = None,
    env_values: Annotated[
        list[str] | None,
        typer.Option("--env", metavar="NAME=VALUE", help="Environment of the ranks. Repeatable."),
    ] = None,
    checkpoint_path: Annotated[
        str | None,
        typer.Option(
            "--checkpoint-path",
            metavar="PATH",
            help="A file (or glob) your script saves, relative to the directory: each new "
            "version becomes a checkpoint and the newest is put back before a relaunch "
            "(spec checkpoints.path).",
        ),
    ] = None,
    tensorboard: Annotated[
        str | None,
        typer.Option(
            "--tensorboard",
            metavar="DIR",
            help="Where your script's SummaryWriter writes, relative to the directory: its "
            "scalars become the job's metrics (spec metrics.tensorboard).",
        ),
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the job until it ends.")] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Pack and show the plan; upload and store nothing."),
    ] = False,
    poll_s: Annotated[float, typer.Option(min=0.05, help="Seconds between polls.")] = 1.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the API's answer (the job, or the dry run).")
    ] = False,
) -> None:
    """Run your own training script (unchanged) as a job: ships the working directory (the
    files git lists there, else all but .ddpqignore's), runs it under torchrun on a worker.
    E.g. `ddpq run -n 2 -- train.py --epochs 3`. With --wait: exit 0 if it succeeds, 1 if
    not."""
    console = err if as_json else out  # with --json, stdout is the API's answer alone
    check_flag_placement(command or [], separated=bool(ctx.meta.get(_SEPARATED)))
    settings = load_settings()
    with friendly_errors():
        plan = plan_command(
            command or [],
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            gpus_per_node=gpus_per_node,
        )
        followed: dict[str, Any] = {}
        if checkpoint_path is not None:
            followed["checkpoints"] = {"path": checkpoint_path}
        if tensorboard is not None:
            followed["metrics"] = {"tensorboard": tensorboard}
        packed = pack_or_fail(workdir, settings, followed)
        print_pack_summary(console, packed)
        spec: dict[str, Any] = command_job_spec(
            plan, packed, name=name, launcher=launcher, env=parse_env(env_values or [])
        )
        spec = with_overrides({**spec, **followed}, set_values or [])
        client = make_client(settings)
        if dry_run:
            print_missing(console, client, packed)
            answer = client.dry_run(spec)
            if as_json:
                print_json(answer)
            else:
                out.print(format_dry_run(answer))
            return
        check_before_upload(spec, settings)
        upload_and_say(console, client, packed)
        job = client.submit(spec)
        if as_json:
            print_json(job)
            return
        url = f"{client.base_url}/jobs/{job['id']}"
        out.print(cell(f"job {job['id']} {job['name']!r} {job['state']}  {url}"))
        for warning in job.get("warnings") or []:
            err.print(cell(f"warning: {warning}"))
        if wait:
            raise typer.Exit(wait_for_job(client, job["id"], poll_s, settings=settings))
