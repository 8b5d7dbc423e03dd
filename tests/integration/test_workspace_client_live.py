"""The real client (``DdpqClient.upload_workspace``, ``service.workspaces.upload``) against
the real API over loopback HTTP, on SQLite and PostgreSQL: a tree goes up whole once, an
unchanged tree sends nothing, and after one edit only that file goes."""

from __future__ import annotations

import os
from pathlib import Path

from service.app import create_app
from service.client import DdpqClient
from service.core.config import Settings
from service.store.db import Database
from tests.live import serve_app


def test_upload_sends_only_what_the_api_lacks(
    tmp_path: Path, settings: Settings, db: Database
) -> None:
    root = tmp_path / "w"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('epoch')\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "model.py").write_text("W = 1\n")
    (root / "weights.bin").write_bytes(os.urandom(200_000))  # > 3 chunks of 64 KiB
    app = create_app(settings.model_copy(update={"checkpoint_chunk_bytes": 64 * 1024}))
    with serve_app(app) as url:
        client = DdpqClient(url, token="")
        first = client.upload_workspace(root)
        assert (first.sent_files, first.file_count) == (4, 4)
        assert first.sent_bytes == first.total_bytes
        assert client.get_workspace(first.digest).digest() == first.digest

        again = client.upload_workspace(root)
        assert (again.sent_files, again.sent_bytes, again.digest) == (0, 0, first.digest)

        (root / "pkg" / "model.py").write_text("W = 2  # tuned\n")
        sent: list[str] = []
        edited = client.upload_workspace(root, on_file=lambda path, size: sent.append(path))
        assert sent == ["pkg/model.py"] and edited.sent_files == 1
        assert edited.sent_bytes == len("W = 2  # tuned\n") and edited.digest != first.digest
        assert client.get_workspace(edited.digest).digest() == edited.digest
