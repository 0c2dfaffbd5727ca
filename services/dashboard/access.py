"""Who may read the dashboard: every page and ``/api`` route needs the stack's read token
(the admin token also reads), as ``Authorization: Bearer`` or as the cookie a sign-in link
gives a browser. ``polar dashboard`` and ``polar up`` print that link
(``http://host:port/?token=<ticket>``: a one-time ticket signed with the read token,
``services/common/auth.py``); the dashboard redeems it for an HttpOnly, SameSite=Strict
cookie and redirects to the same page without it. ``/healthz``, ``/metrics`` and the
static files (no data: the script and style a sign-in page needs) are open. No I/O of
its own: the caller passes the clock, and how a link's use is recorded (the registry).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from services.common.auth import (
    COOKIE_SECONDS,
    READ,
    Tickets,
    bearer,
    cookie_valid,
    refusal,
    session_cookie,
)
from services.dashboard.config import DashboardConfig

SERVICE = "dashboard"
# records a sign-in link's first use: (service, nonce, expiry) -> False if used before
TicketUse = Callable[[str, str, int], Awaitable[bool]]
TICKET_PARAM = "token"  # the sign-in link's query parameter
SIGN_IN = (
    "sign in with the URL `polar dashboard` prints (a one-time link; `polar up` prints one "
    "too), or send `Authorization: Bearer <read token>`"
)


class Access:
    def __init__(self, cfg: DashboardConfig) -> None:
        self.read_token, self.admin_token = cfg.read_token, cfg.admin_token
        self.keys = [k for k in (cfg.read_token, cfg.admin_token) if k]
        # one name per port: two dashboards on one host keep their own cookie
        self.cookie_name = f"polar_dashboard_{cfg.port}"
        self.tickets = Tickets(self.keys, SERVICE, "run `polar dashboard` for a fresh one")

    def refusal(
        self, headers: Mapping[str, str], cookies: Mapping[str, str], *, now: float
    ) -> str | None:
        """Why this request may not read; None when it may."""
        if not self.keys:
            return (
                "the dashboard is closed: it has no read_token configured (`polar up` and "
                "`polar dashboard` give it the stack's; see docs/explanation/security.md)"
            )
        if bearer(headers) is not None:
            return refusal(
                READ,
                headers,
                admin_token=self.admin_token,
                read_token=self.read_token,
                service=SERVICE,
            )
        value = cookies.get(self.cookie_name)
        if value is None:
            return f"not signed in: {SIGN_IN}"
        if not cookie_valid(value, self.keys, SERVICE, now=now):
            return f"this browser's sign-in has expired or is from an earlier stack: {SIGN_IN}"
        return None

    async def sign_in(
        self, ticket: str, use: TicketUse, *, now: float
    ) -> tuple[str | None, str | None]:
        """(the cookie's value, None) for a good ticket, used up then (``use``: records
        its first use, False if it had one); (None, why) else."""
        checked = self.tickets.verify(ticket, now=now)
        if isinstance(checked, str):
            return None, checked
        try:
            first = await use(SERVICE, checked.nonce, checked.expiry)
        except Exception as exc:  # noqa: BLE001 - no record of its use: no sign-in
            return None, f"cannot sign in now (the registry did not answer: {exc}); try again"
        if not first:
            return None, self.tickets.used_up()
        return session_cookie(self.keys[0], SERVICE, now=now), None


def cookie_header(name: str, value: str, *, secure: bool) -> str:
    """The ``Set-Cookie`` value: script cannot read it, no other site's page sends it."""
    attrs = f"{name}={value}; Max-Age={COOKIE_SECONDS}; Path=/; HttpOnly; SameSite=Strict"
    return attrs + ("; Secure" if secure else "")


def without_ticket(path: str, query: list[tuple[str, str]]) -> str:
    """Where a redeemed link sends the browser: the same page, minus the ticket (so it is
    not left in the address bar or the history)."""
    from urllib.parse import urlencode

    rest = [(k, v) for k, v in query if k != TICKET_PARAM]
    return path + (f"?{urlencode(rest)}" if rest else "")
