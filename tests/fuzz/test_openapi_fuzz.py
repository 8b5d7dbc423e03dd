"""schemathesis against the served OpenAPI schema: every operation, valid and invalid input,
over real HTTP on loopback, on SQLite and PostgreSQL. No 5xx, and every answer matches the
schema (declared status code, content type, body shape, headers).

Two runs: hypothesis driving each operation from here (cases pinned to the seeded jobs and
valid specs too, so existing rows and stored jobs are exercised), and schemathesis' own runner
(`st run`: boundary values of every parameter, random cases, stateful sequences through the
API's links, auth and method checks). Both are deterministic: a failure reproduces as is.
``DDPQ_FUZZ_EXAMPLES`` sets the examples per operation (default 30; half for `st run`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.core.wire import API_PREFIX

EXAMPLES = int(os.environ.get("DDPQ_FUZZ_EXAMPLES", "30"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]

# Specs this deployment accepts; POST /jobs sends them with generated headers too
# (Idempotency-Key: a replay answers 200, the key with another spec 422).
VALID_SPECS: list[dict[str, Any]] = [
    {"name": "fuzz", "task": "regression"},
    {"name": "fuzz ✓", "task": "digits", "config": {"model": "mlp"}, "tags": ["a", "b"]},
    {
        "name": "fuzz-entrypoint",
        "task": "examples.fuzz:main",
        "config": {"k": [1, 2.5, None, "x"], "big": 2**70},
        "resources": {"nproc_per_node": 2, "mem_gb": 0.5},
        "training": {"max_steps": 10, "checkpoint_every_steps": 5, "lr": 0.01},
        "priority": -5,
    },
]


def _strategies(operation: Any, served: Any) -> list[Any]:
    """Valid and invalid cases of ``operation``; where it takes a job id, also valid cases
    pinned to each seeded job (and checkpoint step), so existing rows are read too."""
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    found = [operation.as_strategy(mode) for mode in modes]
    if operation.label == f"POST {API_PREFIX}/jobs":
        # Generated specs almost never name a real task; these get stored (201/200).
        found += [operation.as_strategy(GenerationMode.POSITIVE, body=body) for body in VALID_SPECS]
    names = {p.name for p in operation.path_parameters}
    if "job_id" in names:
        for job_id in served.job_ids:
            pinned: dict[str, Any] = {"job_id": job_id}
            if "step" in names:
                pinned["step"] = served.steps[0]
            found.append(operation.as_strategy(GenerationMode.POSITIVE, path_parameters=pinned))
    return found


def _fuzz(operation: Any, served: Any, http: requests.Session) -> None:
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(_strategies(operation, served)))
    def run(case: Any) -> None:
        case.call_and_validate(session=http, checks=CHECKS)

    run()


@pytest.mark.slow
def test_every_operation_answers_without_5xx_and_as_documented(served: Any) -> None:
    config = schemathesis.Config.from_dict(
        {
            # Through the schema's security scheme, so the negative cases that drop the
            # token still drop it (and must get 401).
            "auth": {"openapi": {"HTTPBearer": {"bearer": served.token}}},
            "headers": {"Connection": served.headers["Connection"]},
        }
    )
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json", config=config)
    failures: list[str] = []
    count = 0
    with requests.Session() as http:
        for result in schema.get_all_operations():
            operation = result.ok()
            count += 1
            try:
                _fuzz(operation, served, http)
            # schemathesis raises a BaseExceptionGroup; every operation runs, all are reported.
            except (Exception, BaseExceptionGroup) as exc:
                failures.append(f"{operation.label}:\n{exc}")
    assert count >= 10, f"only {count} operations in the schema: is /openapi.json complete?"
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_schemathesis_runner_finds_no_failure(served: Any, tmp_path: Path) -> None:
    # Every check but positive_data_acceptance: a schema-valid spec naming no real task is
    # rightly refused (422); the spec's cross-field rules do not fit in JSON Schema.
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{served.url}/openapi.json"),
        *("--header", f"Authorization: Bearer {served.token}"),
        *("--checks", "all", "--exclude-checks", "positive_data_acceptance"),
        # Half: its coverage and stateful phases add their own cases on top.
        *("--max-examples", str(max(10, EXAMPLES // 2)), "--generation-deterministic"),
        *("--request-timeout", "30", "--no-color"),
    ]
    # cwd: whatever the runner writes (cassettes, caches) stays in the test's directory.
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    output = (done.stdout + done.stderr).replace(served.token, "<token>")
    assert done.returncode == 0, f"st run exited {done.returncode}:\n{output[-12_000:]}"
    tested = re.search(r"Tested: (\d+)", output)
    assert tested and int(tested.group(1)) >= 10, f"too few operations tested:\n{output[-2000:]}"


def test_405_allows_every_method_of_the_path(served: Any) -> None:
    # GET and POST /jobs are two routes; Starlette's own 405 named only the first (POST).
    with served.client() as client:
        for method, path, allowed in (
            ("OPTIONS", "/jobs", "GET, POST"),
            ("DELETE", f"/jobs/{served.job_ids[0]}", "GET"),
            ("GET", f"/jobs/{served.job_ids[0]}/cancel", "POST"),
        ):
            r = client.request(method, path)
            assert r.status_code == 405, (method, path, r.text)
            assert r.headers["Allow"] == allowed, (method, path)
