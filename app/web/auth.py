"""Bearer-token check for POST routes (and websocket sessions), when API_KEY is set.

Jev's shapes: no Authorization header is 403 ("Must supply an API key"), a wrong key is 401.
The comparison is constant-time. Without API_KEY any Authorization header is accepted.
"""

from __future__ import annotations

import hmac

from app.web.errors import HTTPError


def key_matches(expected: str, presented: str | None) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8"))


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip()


def check_authorization(api_key: str, authorization: str | None) -> None:
    """Raise the Jev-shaped 403/401 unless the header carries the key (or no key is set)."""
    if not api_key:
        return
    if not authorization:
        raise HTTPError(403, "Must supply an API key: send Authorization: Bearer <key>", param="authorization")
    if not key_matches(api_key, bearer_token(authorization)):
        raise HTTPError(401, "Cannot authenticate with the server: wrong bearer token", param="authorization")
