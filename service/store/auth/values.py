"""The auth resource's values: who is calling the API, and API tokens as listed (never the
secret, which exists only in ``CreatedToken`` once)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling the API: the owner their jobs get, and whether they see everyone's."""

    owner: str
    admin: bool

    @property
    def owner_filter(self) -> str | None:
        """The owner whose jobs this caller may touch; None for an admin (every job)."""
        return None if self.admin else self.owner


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One API token as stored: its id, owner, role, kind (a user's or a worker's) and name,
    and when it was created and revoked (None: live). The token itself is not kept, only its
    hash."""

    id: int
    owner: str
    admin: bool
    created_at: datetime
    revoked_at: datetime | None
    kind: str = "user"  # "user" | "worker"
    name: str | None = None  # a worker token's name (e.g. the host it is for)


@dataclass(frozen=True, slots=True)
class CreatedToken:
    """A token just created: its row and the token itself, which exists nowhere else
    afterwards (show it once)."""

    info: TokenInfo
    token: str
