"""Which Unix user runs each owner's ranks: ``DDPQ_RANK_USERS`` (owner → user, ``*`` for any
other owner) or its shorthand ``DDPQ_RANK_USER`` (one user for every owner, ``{"*": user}``).

The one place an owner is resolved to a user name. The API asks ``check_submitter`` at
submit (an owner the map does not cover is refused with 422, nothing stored); a root-run
local worker asks ``RankUserMap.user_for`` at each launch and starts the job's ranks as that
user (``worker.launchers.local.rank_user`` turns the name into a uid and gid). The API and the
workers may run on different hosts with different settings: the API checks that an owner has
a mapping, each worker resolves it with its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.core.errors import SpecValidationError

RANK_USERS_SETTING = "DDPQ_RANK_USERS"
RANK_USER_SETTING = "DDPQ_RANK_USER"
# The key of the user every owner without an entry of their own runs as.
ANY_OWNER = "*"
# A Unix user name as useradd accepts it (POSIX portable characters, at most 32 bytes).
UNIX_USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}$")
MAX_OWNER_CHARS = 100  # an API token's owner (service.store.auth) is at most this long


def parse_rank_users(value: Any) -> dict[str, str] | None:
    """``DDPQ_RANK_USERS`` as read from the environment (JSON text) or given in code (a dict).

    Returns:
        owner → Unix user name; None when unset (None or blank text).
    Raises:
        ValueError: not a JSON object, a key that is empty or too long, or a value that is not
            a Unix user name (each message names the setting and the entry).
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str | bytes):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(
                f"{RANK_USERS_SETTING} is not valid JSON ({exc}): give a JSON object of owner "
                'to Unix user, e.g. {"alice": "alice", "*": "ddpq-rank"}'
            ) from None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{RANK_USERS_SETTING} must be a JSON object of owner to Unix user, e.g. "
            f'{{"alice": "alice", "*": "ddpq-rank"}}, not {type(value).__name__}'
        )
    users: dict[str, str] = {}
    for owner, user in value.items():
        if not isinstance(owner, str) or not 1 <= len(owner) <= MAX_OWNER_CHARS:
            raise ValueError(f"{RANK_USERS_SETTING}: owner {owner!r} must be 1–100 characters")
        if not isinstance(user, str) or not UNIX_USER_RE.match(user):
            raise ValueError(
                f"{RANK_USERS_SETTING}[{owner!r}]: {user!r} is not a Unix user name (a string "
                "of letters, digits, '_', '.', '-', at most 32, not starting with '-' or '.')"
            )
        users[owner] = user
    return users


@dataclass(frozen=True)
class RankUserMap:
    """Owner → Unix user name, ``*`` for any other owner. Empty: no map is set (ranks run as
    the worker's own user, as before there was one)."""

    users: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, rank_users: Mapping[str, str] | None, rank_user: str | None) -> RankUserMap:
        """The map of the two settings (at most one is set: ``Settings`` refuses both)."""
        if rank_users:
            return cls(dict(rank_users))
        return cls({ANY_OWNER: rank_user} if rank_user else {})

    @property
    def configured(self) -> bool:
        """Whether ranks run as mapped users at all (either setting is set)."""
        return bool(self.users)

    def user_for(self, owner: str | None) -> str | None:
        """The Unix user ``owner``'s ranks run as: its own entry, else ``*``'s; None when the
        map covers it not (an unknown owner, None included, gets ``*`` only)."""
        if owner is not None and owner in self.users:
            return self.users[owner]
        return self.users.get(ANY_OWNER)

    def names(self) -> list[str]:
        """Every Unix user the map names, once each, sorted."""
        return sorted(set(self.users.values()))


def unmapped_owner_message(owner: str | None) -> str:
    """Why a job of ``owner`` cannot run: the map covers it not (the fix is named)."""
    return (
        f"owner {owner!r} has no Unix user to run its ranks as: add it to {RANK_USERS_SETTING} "
        f'(e.g. {{"{owner}": "<unix user>"}}, or a "*" entry for every other owner) on the API '
        "and the workers"
    )


def check_submitter(users: RankUserMap, owner: str, *, required: bool) -> None:
    """Refuse a submission (a job, a sweep) of ``owner`` when its ranks would have no user.

    Args:
        users: the API's map (``Settings.rank_user_map``).
        required: whether every owner needs one (``Settings.rank_users_required``: auth on
            and users' code allowed); else nothing is checked.
    Raises:
        SpecValidationError: 422 at ``owner``, naming ``DDPQ_RANK_USERS``.
    """
    if required and users.user_for(owner) is None:
        raise SpecValidationError(
            [{"loc": ["owner"], "msg": unmapped_owner_message(owner), "type": "value_error"}]
        )
