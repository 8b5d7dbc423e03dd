"""How rank 0's checkpoints reach the API's checkpoint store: ``shared`` (the API reads the
file rank 0 wrote, on a filesystem both see) or ``upload`` (rank 0 streams it through the
attempt API), as ``DDPQ_CHECKPOINT_TRANSPORT`` says; ``auto`` decides by the store id.

The API's filesystem store writes a random id into ``STORE_ID_FILE`` at its root and names it
in ``GET /attempts/self`` (``store_id``). A rank whose own artifact root holds the same id sees
the API's directory: shared. Any other rank (another host, another directory, a database
store whose ``store_id`` is None) uploads. ``shared`` forced on a rank without that id falls
back to upload with a warning, since the API would refuse every record.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from service.core.errors import StaleAttemptError
from service.core.wire.attempt import STORE_ID_FILE, AttemptSelf
from worker.runtime.attempt_client import ApiUnavailableError, AttemptClient, AttemptRequestError
from worker.runtime.checkpoints.reports import note_upload_fallback

log = logging.getLogger(__name__)

Transport = Literal["shared", "upload"]
TRANSPORT_SETTINGS = ("auto", "shared", "upload")


def local_store_id(artifact_dir: Path) -> str | None:
    """The store id in ``artifact_dir``'s ``STORE_ID_FILE`` (stripped), None when absent or
    unreadable."""
    try:
        text = (artifact_dir / STORE_ID_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def resolve_transport(setting: str, artifact_dir: Path, store_id: str | None) -> Transport:
    """The transport to use.

    Args:
        setting: ``DDPQ_CHECKPOINT_TRANSPORT``: ``auto`` | ``shared`` | ``upload``.
        artifact_dir: the rank's artifact root.
        store_id: ``AttemptSelf.store_id`` from the API (None: not a filesystem store).
    Raises:
        ValueError: ``setting`` is none of ``TRANSPORT_SETTINGS``.
    """
    if setting == "shared":
        return shared_or_upload(artifact_dir, store_id)
    if setting == "upload":
        return "upload"
    if setting != "auto":
        raise ValueError(
            f"DDPQ_CHECKPOINT_TRANSPORT={setting!r}: use one of {', '.join(TRANSPORT_SETTINGS)}"
        )
    local = local_store_id(artifact_dir)
    transport: Transport = "shared" if store_id is not None and local == store_id else "upload"
    log.info("checkpoint transport: %s (API store %s, local %s)", transport, store_id, local)
    return transport


def shared_or_upload(artifact_dir: Path, store_id: str | None) -> Transport:
    """``shared`` as asked, once this rank's artifact root holds the API's store id; else a
    warning and ``upload`` (the API could not read what this rank writes, so every record
    would be refused and every save lost)."""
    local = local_store_id(artifact_dir)
    if store_id is not None and local == store_id:
        return "shared"
    log.warning(
        "DDPQ_CHECKPOINT_TRANSPORT=shared, but %s does not hold the API's checkpoint store id "
        "(%s; here %s): this rank does not share the API's directory, uploading instead",
        artifact_dir / STORE_ID_FILE, store_id, local,
    )  # fmt: skip
    return "upload"


class TransportChoice:
    """One rank's transport, decided once from the API's store id: at start when
    ``attempt_self`` (``GET /attempts/self``) is given or the setting is ``upload``, else at
    the first save (``resolved``). A ``shared`` setting that falls back to upload is told to
    the job's events too, not only to this rank's log.

    Args:
        setting: ``DDPQ_CHECKPOINT_TRANSPORT`` (``auto`` | ``shared`` | ``upload``).
    """

    def __init__(
        self,
        client: AttemptClient,
        artifact_dir: Path,
        setting: str,
        attempt_self: AttemptSelf | None = None,
    ) -> None:
        self._client, self._artifact_dir, self._setting = client, artifact_dir, setting
        self.transport: Transport | None = None
        if setting == "upload" or attempt_self is not None:
            self.transport = self._decide(attempt_self.store_id if attempt_self else None)

    def resolved(self) -> Transport:
        """The transport, asking ``GET /attempts/self`` for the store id once. While the API
        cannot say, this save uploads (``shared``: records) and the next one asks again."""
        if self.transport is not None:
            return self.transport
        fallback: Transport = "shared" if self._setting == "shared" else "upload"
        try:
            me = self._client.self_check()
        except (ApiUnavailableError, AttemptRequestError) as exc:
            log.warning("checkpoint transport unknown (%s for this one): %s", fallback, exc)
            return fallback
        except StaleAttemptError:
            return fallback  # the record's or the upload's first call meets the fence and stops
        self.transport = self._decide(me.store_id)
        return self.transport

    def _decide(self, store_id: str | None) -> Transport:
        transport = resolve_transport(self._setting, self._artifact_dir, store_id)
        if self._setting == "shared" and transport == "upload":
            note_upload_fallback(self._client)
        return transport
