"""What the CLI says while it ships a workspace, and the shipping steps ``ddpq run``,
``ddpq submit`` and ``ddpq sweep submit`` share: pack (or exit 2 naming the largest files),
say what is missing, upload (resumable: Ctrl-C says so), and put a workspace's digest into a
spec file's command job."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from service.cli.common import err, exit_invalid, fail
from service.cli.output import cell
from service.client import ApiError, DdpqClient
from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.spec.deployment import spec_rules_only
from service.core.spec.model import validate_spec
from service.core.wire.workspace import SHA256_PATTERN, WorkspaceTooLargeError, format_size
from service.workspaces.pack import PackedWorkspace, leave_out_for, pack_workspace
from service.workspaces.upload import missing_files

_DIGEST_RE = re.compile(SHA256_PATTERN)


def files(count: int) -> str:
    """``1 file``, ``2 files``."""
    return f"{count} file{'' if count == 1 else 's'}"


def pack_or_fail(
    workdir: Path, settings: Settings, spec: dict[str, Any] | None = None
) -> PackedWorkspace:
    """``pack_workspace`` under this deployment's limits, leaving out what ddpq restores for
    ``spec`` (``leave_out_for``); a tree over the limits exits 2 naming its largest files and
    the fix, before any byte is sent."""
    try:
        return pack_workspace(
            workdir, max_bytes=settings.workspace_max_bytes,
            max_files=settings.workspace_max_files, leave_out=leave_out_for(spec),
        )  # fmt: skip
    except WorkspaceTooLargeError as exc:
        largest = "".join(f"\n  {format_size(size):>10}  {path}" for path, size in exc.largest)
        fail(f"{exc.summary}; its largest files:{largest}", exc.fix)


def print_pack_summary(console: Console, packed: PackedWorkspace) -> None:
    """The pack's file count, total size, digest and five largest files."""
    if packed.listing == "git":
        how = "the files git lists"
    elif (packed.root / ".ddpqignore").exists():
        how = "all files, less .ddpqignore's"
    else:
        how = "all files"
    manifest = packed.manifest
    console.print(cell(f"workspace {packed.root} ({how})"))
    console.print(
        cell(
            f"  {files(manifest.file_count)}, {format_size(manifest.total_bytes)}, "
            f"digest {packed.digest[:12]}"
        )
    )
    console.print("  largest:")
    for f in packed.largest():
        console.print(cell(f"    {format_size(f.size_bytes):>10}  {f.path}"))
    if packed.left_out:
        shown = ", ".join(packed.left_out[:5]) + (" …" if len(packed.left_out) > 5 else "")
        console.print(cell(f"  not shipped ({files(len(packed.left_out))}; ddpq restores the "
                           f"job's own checkpoints and logs there): {shown}"))  # fmt: skip


def print_missing(console: Console, client: DdpqClient, packed: PackedWorkspace) -> None:
    """What an upload would send (a dry run asks, and sends nothing)."""
    try:
        missing = missing_files(client, packed.manifest)
    except ApiError as exc:  # an API without workspaces: the plan below says the rest
        console.print(cell(f"  (the API did not say which files it lacks: HTTP {exc.status_code})"))
        return
    size = sum(ref.size_bytes for ref in missing)
    console.print(cell(f"  would upload {files(len(missing))} ({format_size(size)}); the API "
                       "has the rest"))  # fmt: skip


def upload_and_say(console: Console, client: DdpqClient, packed: PackedWorkspace) -> None:
    """Upload what the API lacks and say how much went; Ctrl-C exits 130 saying that the
    same command resumes it."""
    try:
        sent = client.upload_workspace(packed)
    except KeyboardInterrupt:
        err.print("upload stopped: run the same command again to resume it")
        raise typer.Exit(130) from None
    if sent.sent_files:
        size = format_size(sent.sent_bytes)
        console.print(cell(f"  uploaded {files(sent.sent_files)} ({size}) in "
                           f"{sent.elapsed_s:.1f} s"))  # fmt: skip
    else:
        console.print("  uploaded nothing: the API has every file")


def pack_spec_workspace(
    spec: dict[str, Any], base_dir: Path, console: Console, settings: Settings
) -> tuple[dict[str, Any], PackedWorkspace | None]:
    """A job spec from a file with its command job's workspace packed (nothing sent): when
    ``spec`` has a ``command`` and its ``workspace`` is absent or a directory (not a
    digest), that directory (relative to ``base_dir``, the spec file's; default ``base_dir``
    itself) is packed, its summary printed, and replaced by its digest.

    Returns:
        ``(spec, packed)``; ``packed`` is None, and ``spec`` as it was, for anything else.
    """
    if not isinstance(spec, dict) or spec.get("command") is None:
        return spec, None
    workspace = spec.get("workspace")
    if isinstance(workspace, str) and _DIGEST_RE.match(workspace):
        return spec, None
    if workspace is not None and not isinstance(workspace, str):
        return spec, None  # the API's 422 names the field
    packed = pack_or_fail(base_dir / (workspace or "."), settings, spec)
    print_pack_summary(console, packed)
    return {**spec, "workspace": packed.digest}, packed


def check_before_upload(spec: dict[str, Any], settings: Settings) -> None:
    """Validate the job ``spec`` (its workspace already a digest) as every deployment would
    (``spec_rules_only``) before its files are uploaded: a typo exits 2 listing every
    problem, with nothing sent. The deployment's own rules (caps, Slurm, allow-list) stay the
    API's, at submit."""
    try:
        validate_spec(spec, spec_rules_only(settings))
    except SpecValidationError as exc:
        exit_invalid("the job", exc.errors)


def ship_spec_workspace(
    spec: dict[str, Any],
    base_dir: Path,
    console: Console,
    client: DdpqClient,
    settings: Settings,
    *,
    upload: bool = True,
) -> dict[str, Any]:
    """A job spec from a file, with its command job's workspace shipped: packed as
    ``pack_spec_workspace`` packs it, uploaded unless ``upload`` is False (a dry run: it
    says what would go), and replaced by its digest. Anything else is returned as it is."""
    spec, packed = pack_spec_workspace(spec, base_dir, console, settings)
    if packed is not None:
        if upload:
            check_before_upload(spec, settings)
            upload_and_say(console, client, packed)
        else:
            print_missing(console, client, packed)
    return spec
