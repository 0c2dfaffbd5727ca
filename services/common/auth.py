"""Bearer-token checks for the services' HTTP APIs (scheduler, proxy admin).

Two roles: ``admin`` (anything that changes what runs: submit, cancel, pause, swap
weights) and ``read`` (task and session records). The admin token also reads. A
service with no token for a role refuses that role's routes: closed unless configured
(``polar up`` generates both, ``infra/credentials.py``). A browser signs in with a
one-time ticket that it exchanges for a signed cookie (below).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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
            "(`polar up` generates one; see docs/explanation/security.md)"
        )
    given = bearer(headers)
    if given is None:
        return f"this {service} route needs `Authorization: Bearer <{role} token>`"
    if not matches(given, accepted):
        return f"the bearer token is not the {service}'s {role} token"
    return None


# -- sign-in links and cookies (the dashboard's browsers) ------------------------------
# A browser cannot be handed a bearer token without friction, so whoever holds the read
# token (the operator's CLI, from credentials.json) mints a *ticket*: a signed, short-lived,
# single-use value that may show in a URL without giving the token away. The service
# exchanges it for a *session cookie*, signed the same way, that stops working when the
# token changes (a new `polar up`). Both are HMAC-SHA256 over their purpose, so neither
# passes for the other, nor for another service's.
TICKET_SECONDS = 900  # how long a printed sign-in URL is good for (once)
MAX_TICKET_SECONDS = 86400  # a ticket claiming to live longer is refused
COOKIE_SECONDS = 86400  # how long a browser stays signed in


def _mac(key: str, *parts: str) -> str:
    digest = hmac.new(key.encode(), "|".join(parts).encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def sign_in_ticket(key: str, service: str, *, now: float, ttl: float = TICKET_SECONDS) -> str:
    """A one-time ticket for ``service``'s sign-in: ``<expiry>.<nonce>.<mac>``."""
    expiry, nonce = str(int(now + ttl)), secrets.token_urlsafe(12)
    return f"{expiry}.{nonce}.{_mac(key, service, 'ticket', expiry, nonce)}"


def _signed_by(mac: str, keys: Iterable[str | None], *parts: str) -> bool:
    return any(key and hmac.compare_digest(mac, _mac(key, *parts)) for key in keys)


def _expiry(text: str) -> int | None:
    return int(text) if text.isdigit() and len(text) < 16 else None


@dataclass(frozen=True)
class Ticket:
    nonce: str
    expiry: int  # epoch seconds


class Tickets:
    """The tickets one service accepts (signed by one of ``keys``), each once: ``verify``
    checks one, and its first use is recorded in the registry until it expires
    (``Registry.use_ticket``: no restart or replica takes a link twice)."""

    def __init__(self, keys: Iterable[str | None], service: str, renew: str) -> None:
        self.keys = [k for k in keys if k]
        self.service, self.renew = service, renew  # renew: how to get a fresh link

    def verify(self, ticket: str, *, now: float) -> Ticket | str:
        """The ticket if it is this service's and unexpired, else why it is refused."""
        fresh = self.renew
        expiry_text, _, rest = ticket.partition(".")
        nonce, _, mac = rest.partition(".")
        expiry = _expiry(expiry_text)
        if (
            expiry is None
            or not nonce
            or not _signed_by(mac, self.keys, self.service, "ticket", expiry_text, nonce)
        ):
            return f"this sign-in link is not one of this {self.service}'s: {fresh}"
        if expiry <= now:
            return f"this sign-in link has expired: {fresh}"
        if expiry > now + MAX_TICKET_SECONDS:
            return f"this sign-in link claims to last more than a day: {fresh}"
        return Ticket(nonce, expiry)

    def used_up(self) -> str:
        return f"this sign-in link was used already: {self.renew}"


def session_cookie(key: str, service: str, *, now: float) -> str:
    """A signed-in browser's cookie value: ``<expiry>.<mac>``."""
    expiry = str(int(now + COOKIE_SECONDS))
    return f"{expiry}.{_mac(key, service, 'cookie', expiry)}"


def cookie_valid(value: str, keys: Iterable[str | None], service: str, *, now: float) -> bool:
    expiry_text, _, mac = value.partition(".")
    expiry = _expiry(expiry_text)
    if expiry is None or expiry <= now or expiry > now + COOKIE_SECONDS + 1:
        return False
    return _signed_by(mac, keys, service, "cookie", expiry_text)
