"""The whole way of a workspace over real HTTP, on SQLite and PostgreSQL, from each store: the
user's client uploads a tree to the API, a job names it, and a rank's side
(``worker.runtime.script.workspace.materialize`` with its attempt token) lays out the same files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.app import create_app
from service.client import DdpqClient
from service.core.config import Settings
from service.store.db import Database
from tests.live import serve_app
from tests.uploads import mint, running_job
from tests.workspaces import name_workspace
from worker.runtime.attempt_client import AttemptClient
from worker.runtime.script.workspace import materialize


@pytest.mark.parametrize("store", ["filesystem", "database"])
def test_a_rank_lays_out_the_uploaded_tree(
    tmp_path: Path, settings: Settings, db: Database, store: str
) -> None:
    root = tmp_path / "w"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('epoch')\n")
    (root / "pkg" / "__init__.py").write_text("")  # empty: no chunk, no store row
    (root / "weights.bin").write_bytes(os.urandom(3 * 2**20 + 7))  # several chunks
    served = settings.model_copy(
        update={"checkpoint_chunk_bytes": 2**20, "checkpoint_store": store}
    )
    with serve_app(create_app(served)) as url:
        uploaded = DdpqClient(url, token="").upload_workspace(root)
        job_id = running_job(db, owner=settings.default_owner)
        name_workspace(db, job_id, uploaded.digest)
        token = mint(db, job_id)["Authorization"].removeprefix("Bearer ")
        where = materialize(AttemptClient(url, token), tmp_path / "rank", job_id, 1)
    for path in ("train.py", "pkg/__init__.py", "weights.bin"):
        assert (where / path).read_bytes() == (root / path).read_bytes(), path
