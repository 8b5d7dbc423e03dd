"""``DDPQ_RANK_USERS`` (owner → Unix user, ``*`` for the rest) and its shorthand
``DDPQ_RANK_USER``: the settings refuse a bad map naming the setting, the API refuses an
owner the map does not cover (when every owner needs one), and a worker refuses to start
unless it is root and every user it names exists, then resolves each job's owner at launch."""

from __future__ import annotations

import os
import pwd
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.core.config import Settings
from service.core.errors import SpecValidationError
from service.core.owners.rank_users import RankUserMap, check_submitter
from worker.errors import LaunchError
from worker.launchers.local.launcher import LocalLauncher
from worker.launchers.local.rank_user import RankUsers, resolve_rank_user


def _some_user() -> pwd.struct_passwd:
    users = [u for u in pwd.getpwall() if u.pw_uid != 0]
    if not users:
        pytest.skip("no unprivileged user on this host")
    return users[0]


def test_a_worker_that_is_not_root_is_refused() -> None:
    user = _some_user()
    with pytest.raises(LaunchError, match="needs a worker running as root"):
        resolve_rank_user(user.pw_name, euid=1000)


def test_an_unknown_user_is_refused() -> None:
    with pytest.raises(LaunchError, match="no such user"):
        resolve_rank_user("ddpq-no-such-user-x", euid=0)


def test_root_itself_is_refused() -> None:
    with pytest.raises(LaunchError, match="unprivileged"):
        resolve_rank_user("root", euid=0)


def test_a_known_user_resolves() -> None:
    user = _some_user()
    resolved = resolve_rank_user(user.pw_name, euid=0)
    assert (resolved.uid, resolved.gid) == (user.pw_uid, user.pw_gid)
    assert resolved.env()["HOME"] == (user.pw_dir or "/")


def test_the_local_launcher_checks_at_construction(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, rank_user="ddpq-no-such-user-x")
    match = "needs a worker running as root" if os.geteuid() != 0 else "no such user"
    with pytest.raises(LaunchError, match=match):
        LocalLauncher(settings)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{alice", "DDPQ_RANK_USERS is not valid JSON"),
        ('["alice"]', "DDPQ_RANK_USERS must be a JSON object"),
        ('{"alice": 1000}', "DDPQ_RANK_USERS['alice']: 1000 is not a Unix user name"),
        ('{"alice": "../etc"}', "is not a Unix user name"),
        ('{"": "ranks"}', "owner '' must be 1–100 characters"),
    ],
)
def test_a_bad_map_is_a_settings_error_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, text: str, words: str
) -> None:
    monkeypatch.setenv("DDPQ_RANK_USERS", text)
    with pytest.raises(ValidationError, match=re.escape(words)):
        Settings()


def test_the_map_is_read_from_the_environment_and_resolves_each_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DDPQ_RANK_USERS", '{"alice": "alice", "bob": "ml-bob", "*": "ddpq-rank"}')
    users = Settings().rank_user_map
    assert users.configured
    assert [users.user_for(o) for o in ("alice", "bob", "carol", None)] == [
        "alice", "ml-bob", "ddpq-rank", "ddpq-rank",
    ]  # fmt: skip
    assert users.names() == ["alice", "ddpq-rank", "ml-bob"]
    without_default = RankUserMap({"alice": "alice"})
    assert without_default.user_for("bob") is None and without_default.user_for(None) is None


def test_rank_user_is_the_shorthand_of_a_map_for_every_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DDPQ_RANK_USERS", raising=False)
    monkeypatch.setenv("DDPQ_RANK_USER", "ranks")
    users = Settings().rank_user_map
    assert users.user_for("anyone") == "ranks" and users.users == {"*": "ranks"}
    monkeypatch.delenv("DDPQ_RANK_USER")
    assert not Settings().rank_user_map.configured  # neither: ranks run as the worker's user


def test_setting_both_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPQ_RANK_USER", "ranks")
    monkeypatch.setenv("DDPQ_RANK_USERS", '{"alice": "alice"}')
    with pytest.raises(
        ValidationError, match=re.escape('keep DDPQ_RANK_USERS and add {"*": "ranks"}')
    ):
        Settings()


def test_submit_needs_a_mapping_only_with_auth_on_and_user_code_allowed() -> None:
    alice_only = RankUserMap({"alice": "alice"})
    check_submitter(alice_only, "alice", required=True)
    check_submitter(alice_only, "bob", required=False)
    check_submitter(RankUserMap({"*": "ranks"}), "bob", required=True)
    for users in (alice_only, RankUserMap()):
        with pytest.raises(SpecValidationError) as refused:
            check_submitter(users, "bob", required=True)
        (error,) = refused.value.errors
        assert error["loc"] == ["owner"] and "DDPQ_RANK_USERS" in error["msg"], error
        assert "'bob'" in error["msg"]
    assert Settings(auth="on", user_code="allow").rank_users_required
    assert not Settings(auth="on", user_code="deny").rank_users_required
    assert not Settings(auth="off", user_code="allow").rank_users_required


def test_the_worker_resolves_each_owner_at_launch_and_refuses_an_unmapped_one() -> None:
    user = _some_user()
    users = RankUsers(RankUserMap({"alice": user.pw_name}), euid=0)
    resolved = users.for_owner("alice")
    assert resolved is not None and resolved.uid == user.pw_uid
    with pytest.raises(LaunchError, match=r"owner 'bob' has no Unix user.*DDPQ_RANK_USERS"):
        users.for_owner("bob")
    assert RankUsers(RankUserMap()).for_owner("bob") is None  # no map: the worker's own user


def test_a_worker_checks_every_user_of_the_map_at_start() -> None:
    user = _some_user()
    missing = re.escape("DDPQ_RANK_USERS (ddpq-no-such-user-x): no such user")
    with pytest.raises(LaunchError, match=missing):
        RankUsers(RankUserMap({"alice": user.pw_name, "bob": "ddpq-no-such-user-x"}), euid=0)
    with pytest.raises(LaunchError, match="needs a worker running as root"):
        RankUsers(RankUserMap({"alice": user.pw_name}), euid=1000)
