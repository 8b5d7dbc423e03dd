"""How a bearer token (an API token or an attempt token) is stored and looked up: its hash."""

from __future__ import annotations

import hashlib


def hash_token(token: str) -> str:
    """The hex sha256 of ``token`` (64 characters), as stored in ``api_tokens.token_hash`` and
    ``attempt_tokens.token_hash``.

    No salt and no slow hash (bcrypt, argon2): those defend guessable secrets such as
    passwords against offline guessing. A token carries 256 random bits, so guessing it from
    its hash is as hopeless as guessing it outright, and one fast hash keeps the per-request
    lookup a single index probe. The lookup by hash also compares no secret bytes in Python,
    so there is no timing side channel on the token itself.
    """
    return hashlib.sha256(token.encode("utf-8")).hexdigest()
