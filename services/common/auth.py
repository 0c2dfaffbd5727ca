"""Bearer-token checks for the services' HTTP APIs (scheduler, proxy admin).

Two roles: ``admin`` (anything that changes what runs: submit, cancel, pause, swap
weights) and ``read`` (task and session records). The admin token also reads. A
service with no token for a role refuses that role's routes: closed unless configured
(``polar up`` generates both, ``infra/credentials.py``).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

ADMIN, READ = "admin", "read"


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, None without one."""
    value = headers.get("authorization") or ""
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def matches(given: str | None, accepted: Iterable[str | None]) -> bool:
    """``given`` equals one of the configured tokens (compared in constant time)."""
    if not given:
        return False
    found = False
    for token in accepted:
        if token and hmac.compare_digest(given.encode(), token.encode()):
            found = True
    return found


def refusal(
    role: str,
    headers: Mapping[str, str],
    *,
    admin_token: str | None,
    read_token: str | None = None,
    service: str,
) -> str | None:
    """Why this request may not use a ``role`` route; None when it may."""
    accepted = (admin_token,) if role == ADMIN else (admin_token, read_token)
    if not any(accepted):
        return (
            f"the {service}'s {role} routes are closed: it has no {role}_token configured "
            "(`polar up` generates one; see docs/security.md)"
        )
    given = bearer(headers)
    if given is None:
        return f"this {service} route needs `Authorization: Bearer <{role} token>`"
    if not matches(given, accepted):
        return f"the bearer token is not the {service}'s {role} token"
    return None
