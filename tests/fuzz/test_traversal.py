"""Traversal attempts on log and checkpoint downloads, over real HTTP (auth on): whatever a
query, an encoded path, a database row or a symlink in the artifact directory says, the
answer is 4xx and nothing outside the artifact directory is read.

tests/integration/test_api_job_data.py covers a checkpoint row with an absolute or ``../``
path and a checkpoint symlinked outside; these add the rest.
"""

from __future__ import annotations

import http.client
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from service.core import artifacts
from service.core.wire import API_PREFIX
from service.store.checkpoints.crud import record_checkpoint

SECRET = "secret outside the artifact directory"
# Statuses that refuse a traversal: bad request, not found, or a parameter that fails its type.
REFUSED = {400, 404, 422}


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """A file next to (not inside) the served artifact directory."""
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def raw_get(served: Any, raw_path: str) -> tuple[int, str]:
    """GET ``raw_path`` byte for byte (no client-side normalisation of ``..`` or ``%2e``)."""
    url = urlsplit(served.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    try:
        conn.request("GET", raw_path, headers=served.headers)
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        conn.close()


def _refused(status: int, body: str, what: str) -> None:
    assert status in REFUSED, f"{what}: {status} {body[:300]}"
    assert SECRET not in body and "root:" not in body, f"{what} served a file from outside"


LOG_QUERIES = [
    "rank=../../etc/passwd",
    "rank=..%2F..%2Fetc%2Fpasswd",
    "rank=%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "rank=0/../../../../etc/passwd",
    "rank=-1",
    "attempt=-1",
    "attempt=0",
    "attempt=..%2f..",
    "offset=-1",
    "rank=0%00",
]
ENCODED_PATHS = [
    API_PREFIX + "/jobs/%2e%2e/logs",
    API_PREFIX + "/jobs/%2e%2e%2f%2e%2e%2fetc%2fpasswd/logs",
    API_PREFIX + "/jobs/..%2F..%2Fetc%2Fpasswd/logs",
    API_PREFIX + "/jobs/{job}/checkpoints/%2e%2e/file",
    API_PREFIX + "/jobs/{job}/checkpoints/..%2F..%2F..%2Fetc%2Fpasswd/file",
    API_PREFIX + "/jobs/{job}/checkpoints/%2e%2e%2f%2e%2e%2fetc%2fpasswd/file",
    API_PREFIX + "/jobs/{job}/checkpoints/10%2f..%2f..%2fsecret/file",
    API_PREFIX + "/jobs/{job}/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
]


def test_traversal_in_queries_and_encoded_paths_is_refused(served: Any) -> None:
    job_id = served.job_ids[0]
    raws = [f"{API_PREFIX}/jobs/{job_id}/logs?{q}" for q in LOG_QUERIES]
    raws += [p.format(job=job_id) for p in ENCODED_PATHS]
    for raw in raws:
        status, body = raw_get(served, raw)
        _refused(status, body, raw)


def _log_path(served: Any, rank: int, attempt: int = 1) -> Path:
    return artifacts.rank_log_path(
        served.settings.resolved_artifact_dir, served.job_ids[0], attempt, rank
    )


def test_a_log_symlinked_outside_is_not_read(served: Any, secret_file: Path) -> None:
    for rank, target in ((0, secret_file), (1, Path("/etc/passwd"))):
        log = _log_path(served, rank)
        log.unlink()
        log.symlink_to(target)
        with served.client() as client:
            r = client.get(f"/jobs/{served.job_ids[0]}/logs", params={"rank": rank})
        _refused(r.status_code, r.text, f"rank-{rank}.log -> {target}")


def test_a_job_dir_symlinked_outside_is_not_read(served: Any, secret_file: Path) -> None:
    # The job's whole directory swapped for a link to one that has the expected layout.
    outside = secret_file.parent
    (outside / "attempt-1").mkdir()
    (outside / "attempt-1" / "rank-0.log").write_text(SECRET)
    job_dir = artifacts.job_dir(served.settings.resolved_artifact_dir, served.job_ids[0])
    job_dir.rename(job_dir.with_name("moved"))
    job_dir.symlink_to(outside, target_is_directory=True)
    with served.client() as client:
        r = client.get(f"/jobs/{served.job_ids[0]}/logs", params={"rank": 0})
    _refused(r.status_code, r.text, "jobs/<id> -> outside")


def test_a_log_that_is_a_fifo_or_a_directory_answers_404_at_once(served: Any) -> None:
    # open() on a FIFO with no writer would block a server thread for good.
    os.mkfifo(_log_path(served, 0).with_name("fifo"))
    _log_path(served, 0).unlink()
    _log_path(served, 0).symlink_to("fifo")
    _log_path(served, 1).unlink()
    _log_path(served, 1).mkdir()
    with served.client() as client:
        for rank in (0, 1):
            r = client.get(f"/jobs/{served.job_ids[0]}/logs", params={"rank": rank}, timeout=10)
            assert r.status_code == 404, (rank, r.text)


def test_a_missing_log_inside_is_still_empty_text(served: Any) -> None:
    _log_path(served, 1).unlink()
    with served.client() as client:
        r = client.get(f"/jobs/{served.job_ids[0]}/logs", params={"rank": 1, "offset": 7})
    assert r.status_code == 200, r.text
    assert r.json() == {"text": "", "next_offset": 7, "rank": 1, "attempt": 1, "eof": True,
                        "found": False}  # fmt: skip


def test_checkpoint_rows_and_links_pointing_anywhere_else_are_404(
    served: Any, secret_file: Path
) -> None:
    job_id = served.job_ids[0]
    root = served.settings.resolved_artifact_dir
    loop = artifacts.checkpoint_path(root, job_id, 101)
    loop.symlink_to(loop.name)  # points at itself
    fifo = artifacts.checkpoint_path(root, job_id, 102)
    os.mkfifo(fifo)
    to_passwd = artifacts.checkpoint_path(root, job_id, 103)
    to_passwd.symlink_to("/etc/passwd")
    stored = {
        101: str(loop),
        102: str(fifo),
        103: str(to_passwd),
        104: str(artifacts.checkpoint_dir(root, job_id)),  # a directory
        105: f"jobs/{job_id}/checkpoints/../../../../outside/secret.txt",
        106: str(root / ".." / "outside" / "secret.txt"),
        107: "/etc/passwd",
        108: "",
    }
    if served.settings.resolved_database_url.startswith("sqlite"):
        stored[109] = f"jobs/{job_id}/checkpoints/step-10.pt\x00../../outside/secret.txt"
    with served.db.session() as session:
        for step, path in stored.items():
            record_checkpoint(
                session, job_id, 1, step=step, epoch=0, path=path, size_bytes=1, sha256="0" * 64
            )
    with served.client() as client:
        for step, path in stored.items():
            r = client.get(f"/jobs/{job_id}/checkpoints/{step}/file", timeout=10)
            assert r.status_code == 404, f"step {step} ({path!r}): {r.status_code}"
            _refused(r.status_code, r.text, path)
        listed = client.get(f"/jobs/{job_id}/checkpoints").json()["checkpoints"]
    paths = {c["step"]: c["path"] for c in listed}
    assert all(paths[step] is None for step in (103, 105, 106, 107, 108)), paths
    assert str(secret_file.parent) not in str(listed)
    # The real ones are still served.
    with served.client() as client:
        r = client.get(f"/jobs/{job_id}/checkpoints/{served.steps[0]}/file")
    assert r.status_code == 200 and r.content == f"checkpoint {served.steps[0]}".encode()
