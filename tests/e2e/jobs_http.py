"""What the e2e deployments share: polling, child processes, and a job as a user sees it
over HTTP.

``JobsOverHttp`` is mixed into ``conftest.Deployment`` (one host) and ``hosts.Cluster``
(several network namespaces); each gives ``http`` (an httpx client at ``/api/v1``) and
``diagnostics`` (what to print when a wait fails).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx

from tests.waiting import wait_until as wait_for

REPO = Path(__file__).resolve().parents[2]
TERMINAL = ("succeeded", "failed", "cancelled")
# torch 2.13's gloo now and then aborts a DDP script's process as Python exits, after its
# last line ran ("terminate called without an active exception"; 1 run in 75 of the
# unchanged tutorial under bare torchrun, 3 at a time on a 2-core box). A script job that
# must succeed gets this restart, and ``assert_restarted_only_on_exit_aborts`` accepts a
# restart for that failure alone.
EXIT_ABORT_RESTART = "max_restarts=1"


class Proc:
    """A child process (optionally inside a network namespace ``netns``) whose output goes
    to a file (shown when a test fails)."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], log_path: Path,
        netns: str | None = None,
    ) -> None:  # fmt: skip
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.popen = subprocess.Popen(
            [*prefix, *argv], env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, sig)

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, wait up to ``timeout_s`` seconds, SIGKILL the group; the exit code."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
        rc = self.popen.wait()
        self._log.close()
        return rc

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]


class JobsOverHttp:
    """Submit and follow jobs through the REST API, asserting each answer's status."""

    http: httpx.Client

    def diagnostics(self, job_id: int) -> str:
        """What to show when a wait for ``job_id`` fails (logs, processes)."""
        raise NotImplementedError

    def submit(self, spec: dict[str, Any]) -> int:
        r = self.http.post("/jobs", json=spec)
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    def job(self, job_id: int) -> dict[str, Any]:
        r = self.http.get(f"/jobs/{job_id}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def events(self, job_id: int) -> list[dict[str, Any]]:
        r = self.http.get(f"/jobs/{job_id}/events")
        assert r.status_code == 200, r.text
        events: list[dict[str, Any]] = r.json()["events"]
        return events

    def checkpoints(self, job_id: int) -> list[dict[str, Any]]:
        r = self.http.get(f"/jobs/{job_id}/checkpoints")
        assert r.status_code == 200, r.text
        entries: list[dict[str, Any]] = r.json()["checkpoints"]
        return entries

    def assert_restarted_only_on_exit_aborts(self, job_id: int) -> dict[str, Any]:
        """The job, once it is asserted that each of its restarts followed a rank killed as
        Python exited (``EXIT_ABORT_RESTART``'s reason): any other failure fails the test."""
        from worker.runtime.script.run import EXITING

        for event in self.events(job_id):
            if event["kind"] == "retried":
                assert EXITING in event["data"]["error"], (event, self.diagnostics(job_id))
        return self.job(job_id)

    def wait_state(self, job_id: int, states: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
        """Poll the job until its state is one of ``states``; fail early on another end."""

        def reached() -> dict[str, Any] | None:
            job = self.job(job_id)
            if job["state"] in states:
                return job
            if job["state"] in TERMINAL:
                raise AssertionError(
                    f"job {job_id} ended {job['state']} (expected {states}): {job['error']}"
                    f"\n{self.diagnostics(job_id)}"
                )
            return None

        try:
            job: dict[str, Any] = wait_for(reached, timeout_s, f"job {job_id} to be {states}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnostics(job_id)}") from None
        return job
