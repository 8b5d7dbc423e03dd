"""``DdpqClient``'s workspace routes and command jobs (``run``, ``upload_workspace``): a base
class of ``DdpqClient``, kept apart so the client module stays one screenful per resource.
The routes and bodies are ``service.core.wire.workspace``'s; errors are the client's own
(``ApiError``, ``ApiUnreachableError``), plus ``FileOffsetError`` for a chunk or commit the
API answered with the upload's status (409: go on from its ``received_bytes``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.core.config import Settings
from service.core.errors import DdpqError
from service.core.spec.overrides import apply_overrides
from service.core.wire import batch
from service.core.wire import workspace as wire
from service.core.wire.attempt import CHUNK_SHA256_HEADER
from service.workspaces.command import command_job_spec, plan_command

if TYPE_CHECKING:  # imported when used: packing needs git and pathspec, most calls do not
    from service.workspaces.pack import PackedWorkspace
    from service.workspaces.upload import WorkspaceUpload


class FileOffsetError(DdpqError):
    """The API holds another offset of a file's upload than the chunk was sent at (409 with
    the upload's status): go on from ``status.received_bytes``."""

    status_code = 409
    code = "upload_state"

    def __init__(self, status: wire.FileUploadStatus) -> None:
        self.status = status
        super().__init__(f"upload {status.upload_id} is at byte {status.received_bytes}")


class WorkspaceCalls:
    """The workspace half of ``DdpqClient`` (it provides ``_json``, ``submit``, ``dry_run``)."""

    if TYPE_CHECKING:

        def _json(self, method: str, path: str, **kwargs: Any) -> Any: ...
        def submit(
            self, spec: dict[str, Any], idempotency_key: str | None = None
        ) -> dict[str, Any]: ...
        def dry_run(self, spec: dict[str, Any], job_id: int | None = None) -> dict[str, Any]: ...

    # ---- the routes ---------------------------------------------------------------------

    def workspace_missing(self, files: Sequence[wire.FileRef]) -> list[str]:
        """The sha256 of each of ``files`` (at most ``MAX_MISSING_FILES``) the API lacks for
        the caller."""
        body = wire.MissingFiles(files=list(files)).model_dump()
        return wire.MissingAnswer.model_validate(
            self._json("POST", wire.MISSING_PATH, json=body)
        ).missing

    def begin_workspace_file(self, start: wire.FileUploadStart) -> wire.FileUploadStatus:
        """Begin (or find again, to resume) the upload of one workspace file."""
        answer = self._json("POST", wire.FILES_PATH, json=start.model_dump())
        return wire.FileUploadStatus.model_validate(answer)

    def send_workspace_batch(
        self, files: Sequence[tuple[wire.FileRef, bytes]]
    ) -> batch.BatchAnswer:
        """Send many whole small files in one request (``service.core.wire.batch``):
        ``(ref, data)`` pairs, at most ``BATCH_MAX_FILES``, each at most
        ``BATCH_FILE_MAX_BYTES``.

        Returns:
            The files the API now has for the caller and those it refused (with why).
        Raises:
            ApiError: 413 for a body over the API's chunk cap (send smaller batches); 422
                for a body that does not split into its files.
        """
        headers = {"Content-Type": batch.BATCH_CONTENT_TYPE}
        body = batch.encode_batch(files)
        answer = self._json("POST", wire.FILES_BATCH_PATH, content=body, headers=headers)
        return batch.BatchAnswer.model_validate(answer)

    def workspace_file_status(self, upload_id: int) -> wire.FileUploadStatus:
        """Where a workspace file's upload stands (its resume point)."""
        path = wire.FILE_UPLOAD_PATH.format(upload_id=int(upload_id))
        return wire.FileUploadStatus.model_validate(self._json("GET", path))

    def send_workspace_chunk(
        self, upload_id: int, offset: int, data: bytes
    ) -> wire.FileUploadStatus:
        """Send ``data`` at byte ``offset`` of an upload, its sha256 in ``CHUNK_SHA256_HEADER``.

        Raises:
            FileOffsetError: the API holds another offset (its status attached).
            ApiError: 422 when the chunk arrived damaged or too big (nothing kept).
        """
        path = wire.FILE_CHUNK_PATH.format(upload_id=int(upload_id))
        headers = {
            "Content-Type": "application/octet-stream",
            CHUNK_SHA256_HEADER: hashlib.sha256(data).hexdigest(),
        }
        return self._upload_step(
            "PUT", path, content=data, headers=headers, params={"offset": int(offset)}
        )

    def commit_workspace_file(self, upload_id: int) -> wire.FileUploadStatus:
        """Every byte was sent: the API checks the whole file's size and sha256.

        Raises:
            FileOffsetError: bytes are missing (resend from its ``received_bytes``).
            ApiError: 422 when the sha256 does not match (the upload is discarded).
        """
        return self._upload_step("POST", wire.FILE_COMMIT_PATH.format(upload_id=int(upload_id)))

    def _upload_step(self, method: str, path: str, **kwargs: Any) -> wire.FileUploadStatus:
        try:
            answer = self._json(method, path, **kwargs)
        except DdpqError as exc:  # the client's ApiError
            # The server's code says the body is the upload's status, not an error text.
            if exc.code == FileOffsetError.code and isinstance(exc.detail, dict):
                try:
                    status = wire.FileUploadStatus.model_validate(exc.detail)
                except ValueError:
                    raise exc from None
                raise FileOffsetError(status) from None
            raise
        return wire.FileUploadStatus.model_validate(answer)

    def create_workspace(self, manifest: wire.Manifest) -> wire.WorkspaceSummary:
        """Store a manifest whose files were all uploaded; idempotent for one digest.

        Raises:
            ApiError: 422 listing files not uploaded; 413 over the API's workspace limits.
        """
        body = wire.WorkspaceCreate(manifest=manifest).model_dump_json()
        headers = {"Content-Type": "application/json"}
        answer = self._json("POST", wire.WORKSPACES_PATH, content=body, headers=headers)
        return wire.WorkspaceSummary.model_validate(answer)

    def get_workspace(self, digest: str) -> wire.Manifest:
        """The caller's workspace ``digest`` (ApiError 404 for one that is not theirs)."""
        path = wire.WORKSPACE_PATH.format(digest=digest)
        return wire.Manifest.model_validate(self._json("GET", path))

    # ---- what users call ----------------------------------------------------------------

    def upload_workspace(
        self,
        workdir: str | Path | PackedWorkspace,
        *,
        on_file: Callable[[str, int], None] | None = None,
    ) -> WorkspaceUpload:
        """Pack ``workdir`` (unless already packed) within the workspace limits
        (``DDPQ_WORKSPACE_MAX_BYTES``/``_FILES``), send the files the API lacks, and store
        the manifest. An unchanged directory sends no file.

        Args:
            workdir: the directory, or what ``pack_workspace`` made of it.
            on_file: called with ``(path, size_bytes)`` before each file is sent.

        Returns:
            ``WorkspaceUpload``: the digest (a spec's ``workspace``), sizes, what was sent.
        Raises:
            WorkspacePackError, WorkspaceTooLargeError: before anything is sent.
            WorkspaceUploadError, ApiError, ApiUnreachableError: running again resumes.
        """
        from service.workspaces.pack import PackedWorkspace, pack_workspace
        from service.workspaces.upload import upload_packed

        if not isinstance(workdir, PackedWorkspace):
            settings = Settings()
            workdir = pack_workspace(
                workdir,
                max_bytes=settings.workspace_max_bytes,
                max_files=settings.workspace_max_files,
            )
        return upload_packed(self, workdir, on_file=on_file)

    def run(
        self,
        command: Sequence[str],
        *,
        workdir: str | Path = ".",
        name: str | None = None,
        nproc_per_node: int | None = None,
        nnodes: int | None = None,
        gpus_per_node: int | None = None,
        launcher: str | None = None,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        checkpoint_path: str | None = None,
        tensorboard: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Run a script of ``workdir`` as a command job: pack the directory, upload what the
        API lacks, submit. ``command`` is what one would type: ``["train.py", "--epochs",
        "3"]``, ``["-m", "pkg.train"]``, ``["python", "train.py"]`` or ``["torchrun",
        "--nproc-per-node=2", "train.py"]`` (``service.workspaces.command``); ``overrides``
        sets other spec fields by dotted path (``{"max_restarts": 2}``). ``checkpoint_path``
        and ``tensorboard`` are the spec's ``checkpoints.path`` and ``metrics.tensorboard``
        (the files ddpq follows; a local run's copies of them are not shipped).

        Returns:
            The Job; with ``dry_run``, the API's dry-run answer (and no file is sent).
        Raises:
            RunCommandError: a command ddpq cannot run, a flag that disagrees with a
                torchrun option, a script that is not in the workspace.
            WorkspacePackError, WorkspaceTooLargeError: before anything is sent.
            ApiError: 422 for a bad spec.
        """
        from service.workspaces.pack import leave_out_for, pack_workspace

        settings = Settings()
        plan = plan_command(
            command, nproc_per_node=nproc_per_node, nnodes=nnodes, gpus_per_node=gpus_per_node
        )
        followed: dict[str, Any] = {}
        if checkpoint_path is not None:
            followed["checkpoints"] = {"path": checkpoint_path}
        if tensorboard is not None:
            followed["metrics"] = {"tensorboard": tensorboard}
        packed = pack_workspace(
            workdir, max_bytes=settings.workspace_max_bytes,
            max_files=settings.workspace_max_files,
            leave_out=leave_out_for({**followed, **(overrides or {})}),
        )  # fmt: skip
        spec = command_job_spec(plan, packed, name=name, launcher=launcher, env=env)
        spec = apply_overrides({**spec, **followed}, overrides or {})
        if dry_run:
            return self.dry_run(spec)
        self.upload_workspace(packed)
        return self.submit(spec)
