"""Who may submit a command job, over the real app on SQLite and PostgreSQL: a deployment
that does not run users' code (DDPQ_USER_CODE=deny, or auth on by default) answers 422
naming the setting while task jobs still go; with auth on and user code allowed, a command
job (or a sweep of them) naming another owner's workspace gets the same 422 at
``workspace`` as one naming a workspace nobody stored, and the digest itself is a 404; and
an owner without a Unix user in ``DDPQ_RANK_USERS`` (nor a ``*``) is refused at ``owner``,
naming the setting, nothing stored."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.app import create_app
from service.core.config import Settings
from service.core.wire import workspace as wire
from service.store.auth.tokens import create_token
from service.store.db import Database
from service.store.models import Job, Sweep
from tests.uploads import bearer
from tests.workspaces import API, digest, store_workspace

FILES = {"train.py": b"import os\nprint('LR', os.environ.get('LR'))\n"}
TASK_SPEC: dict[str, Any] = {"name": "reg", "task": "regression", "training": {"max_steps": 5}}


def command_spec(workspace: str) -> dict[str, Any]:
    return {"name": "cmd", "command": ["train.py", "--epochs", "1"], "workspace": workspace,
            "env": {"LR": "0.1"}}  # fmt: skip


def command_sweep(workspace: str) -> dict[str, Any]:
    return {"name": "sw", "base": command_spec(workspace),
            "axes": {"env.LR": {"grid": [0.1, 0.2]}}}  # fmt: skip


def job_count(db: Database, table: type[Job] | type[Sweep] = Job) -> int:
    with db.session(write=False) as s:
        return int(s.scalar(select(func.count()).select_from(table)) or 0)


def served(settings: Settings, **changes: Any) -> Iterator[TestClient]:
    with TestClient(create_app(settings.model_copy(update=changes))) as api:
        yield api


def tokens(db: Database, *owners: str) -> dict[str, dict[str, str]]:
    with db.session() as s:
        return {o: bearer(create_token(s, owner=o)[1]) for o in owners}


def assert_user_code_refused(r: Any) -> None:
    assert r.status_code == 422, r.text
    msgs = [e["msg"] for e in r.json()["detail"] if e["loc"][-1] == "command"]
    assert any("DDPQ_USER_CODE=allow" in m for m in msgs), r.json()["detail"]


@pytest.mark.parametrize(
    ("changes", "owner"),
    [({"user_code": "deny"}, None), ({"auth": "on"}, "alice")],
    ids=["user_code deny", "auth on, user_code by default"],
)
def test_a_deployment_without_user_code_refuses_command_jobs_naming_the_setting(
    settings: Settings, db: Database, changes: dict[str, Any], owner: str | None
) -> None:
    headers = tokens(db, owner)[owner] if owner else {}
    for api in served(settings, **changes):
        # The upload routes stay open (a workspace is just files); running one is not.
        assert store_workspace(api, headers, FILES).status_code == 201
        r = api.post(f"{API}/jobs", json=command_spec(digest(FILES)), headers=headers)
        assert_user_code_refused(r)
        r = api.post(f"{API}/sweeps", json=command_sweep(digest(FILES)), headers=headers)
        assert_user_code_refused(r)
        assert job_count(db) == 0
        r = api.post(f"{API}/jobs", json=TASK_SPEC, headers=headers)
        assert r.status_code == 201, r.text
        assert job_count(db) == 1


def test_another_owners_workspace_is_refused_as_one_that_does_not_exist(
    settings: Settings, db: Database
) -> None:
    users = tokens(db, "alice", "bob")
    alice, bob = users["alice"], users["bob"]
    theirs, nobodys = digest(FILES), "7" * 64
    for api in served(settings, auth="on", user_code="allow", rank_users={"*": "ddpq-rank"}):
        assert store_workspace(api, alice, FILES).status_code == 201

        answers = {}
        for name, workspace in (("theirs", theirs), ("nobody's", nobodys)):
            r = api.post(f"{API}/jobs", json=command_spec(workspace), headers=bob)
            assert r.status_code == 422, (name, r.text)
            (error,) = r.json()["detail"]
            assert error["loc"] == ["body", "workspace"], error
            answers[name] = (r.json()["code"], error["msg"].replace(workspace[:12], "<digest>"))
            r = api.post(f"{API}/sweeps", json=command_sweep(workspace), headers=bob)
            assert r.status_code == 422, (name, r.text)
            assert any(e["loc"][-1] == "workspace" for e in r.json()["detail"]), r.text
        assert answers["theirs"] == answers["nobody's"]  # nothing tells it exists
        assert job_count(db) == 0

        # The digest itself: 404 for bob, exactly as a digest nobody stored.
        r_theirs = api.get(API + wire.WORKSPACE_PATH.format(digest=theirs), headers=bob)
        r_nobodys = api.get(API + wire.WORKSPACE_PATH.format(digest=nobodys), headers=bob)
        assert r_theirs.status_code == r_nobodys.status_code == 404
        assert r_theirs.json()["code"] == r_nobodys.json()["code"] == "workspace_not_found"
        assert r_theirs.json()["detail"].replace(theirs, "<d>") == r_nobodys.json()[
            "detail"
        ].replace(nobodys, "<d>")

        # Alice's own: accepted, and bob's copy of the same tree would be his own workspace.
        r = api.post(f"{API}/jobs", json=command_spec(theirs), headers=alice)
        assert r.status_code == 201, r.text
        assert store_workspace(api, bob, FILES).status_code == 201
        r = api.post(f"{API}/jobs", json=command_spec(theirs), headers=bob)
        assert r.status_code == 201, r.text
        assert job_count(db) == 2


def test_an_owner_without_a_rank_user_is_refused_naming_the_setting(
    settings: Settings, db: Database
) -> None:
    users = tokens(db, "alice", "bob")
    work = digest(FILES)
    for api in served(settings, auth="on", user_code="allow", rank_users={"alice": "ml-alice"}):
        for owner in users:
            assert store_workspace(api, users[owner], FILES).status_code == 201
        # Any job of bob's would run as nobody: refused before it is stored (and planned).
        for path, body in (
            ("/jobs", TASK_SPEC),
            ("/jobs", command_spec(work)),
            ("/jobs?dry_run=true", TASK_SPEC),
            ("/sweeps", command_sweep(work)),
        ):
            r = api.post(f"{API}{path}", json=body, headers=users["bob"])
            assert r.status_code == 422, (path, r.text)
            (error,) = r.json()["detail"]
            assert error["loc"] == ["owner"], error
            assert "owner 'bob'" in error["msg"] and "DDPQ_RANK_USERS" in error["msg"], error
        assert job_count(db) == 0 and job_count(db, Sweep) == 0
        r = api.post(f"{API}/jobs", json=command_spec(work), headers=users["alice"])
        assert r.status_code == 201, r.text
        assert job_count(db) == 1
    # A "*" entry covers every other owner.
    for api in served(settings, auth="on", user_code="allow",
                      rank_users={"alice": "ml-alice", "*": "ddpq-rank"}):  # fmt: skip
        r = api.post(f"{API}/sweeps", json=command_sweep(work), headers=users["bob"])
        assert r.status_code == 201, r.text
        assert job_count(db, Sweep) == 1
