"""The bearer token (--api-token), checked the same way by every transport."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: str, token: bytes) -> bool:
    """Whether an `Authorization` value ("Bearer <token>") carries `token` (constant time)."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token)
