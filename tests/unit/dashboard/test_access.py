"""Who may read the dashboard (``services/dashboard/access.py``): the read or admin
token as a bearer token, or the cookie a redeemed sign-in link set; nothing else."""

from __future__ import annotations

from services.common.auth import sign_in_ticket
from services.dashboard.access import Access, cookie_header, without_ticket
from services.dashboard.config import DashboardConfig

NOW = 1_800_000_000.0
READ, ADMIN = "pr_read", "pa_admin"


def access(**tokens) -> Access:
    tokens = tokens or {"read_token": READ, "admin_token": ADMIN}
    return Access(DashboardConfig(port=8161, **tokens))


class Uses:
    """Records a link's first use in memory, as the registry does (``use_ticket``)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    async def __call__(self, service: str, nonce: str, expiry: int) -> bool:
        assert service == "dashboard"
        first = nonce not in self.seen
        self.seen.setdefault(nonce, expiry)
        return first


async def sign_in(a: Access, ticket: str, uses: Uses | None = None):
    return await a.sign_in(ticket, uses or Uses(), now=NOW)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_bearer_tokens():
    a = access()
    assert a.refusal(bearer(READ), {}, now=NOW) is None
    assert a.refusal(bearer(ADMIN), {}, now=NOW) is None
    assert "not the dashboard's read token" in a.refusal(bearer("ps_a-session"), {}, now=NOW)
    assert "polar dashboard" in a.refusal({}, {}, now=NOW)  # the page says where to go


async def test_a_sign_in_link_gives_a_cookie_that_reads():
    a, uses = access(), Uses()
    cookie, why = await sign_in(a, sign_in_ticket(READ, "dashboard", now=NOW), uses)
    assert why is None and cookie
    assert a.refusal({}, {a.cookie_name: cookie}, now=NOW + 60) is None
    assert a.refusal({}, {"polar_dashboard_8160": cookie}, now=NOW) is not None  # another port's
    assert "expired" in a.refusal({}, {a.cookie_name: "1.x"}, now=NOW)
    # a bearer token that is wrong is refused even beside a good cookie
    assert a.refusal(bearer("wrong"), {a.cookie_name: cookie}, now=NOW) is not None
    # the same link twice: refused, no cookie
    ticket = sign_in_ticket(READ, "dashboard", now=NOW)
    assert (await sign_in(a, ticket, uses))[1] is None
    assert await sign_in(a, ticket, uses) == (None, a.tickets.used_up())
    assert "used already" in a.tickets.used_up()
    # cookies of another stack's dashboard (other tokens) are no good here
    other = access(read_token="pr_other")
    assert (
        a.refusal(
            {},
            {
                a.cookie_name: (
                    await sign_in(other, sign_in_ticket("pr_other", "dashboard", now=NOW))
                )[0]
            },
            now=NOW,
        )
        is not None
    )


async def test_a_dashboard_without_tokens_is_closed():
    a = access(read_token=None, admin_token=None)
    for headers in ({}, bearer("anything")):
        assert "closed" in a.refusal(headers, {}, now=NOW)
    assert (await sign_in(a, sign_in_ticket("", "dashboard", now=NOW)))[0] is None
    # the admin token alone also reads (and signs links)
    only_admin = access(admin_token=ADMIN)
    assert only_admin.refusal(bearer(ADMIN), {}, now=NOW) is None
    assert (await sign_in(only_admin, sign_in_ticket(ADMIN, "dashboard", now=NOW)))[1] is None


async def test_a_link_is_not_used_up_by_a_refusal_and_no_record_is_no_sign_in():
    a, uses = access(), Uses()
    # a forged or expired link is refused before its use is recorded
    assert (await sign_in(a, "1.nonce.mac", uses))[0] is None and not uses.seen

    async def unreachable(service: str, nonce: str, expiry: int) -> bool:
        raise ConnectionError("registry down")

    cookie, why = await a.sign_in(sign_in_ticket(READ, "dashboard", now=NOW), unreachable, now=NOW)
    assert cookie is None and "registry did not answer" in why and "try again" in why


def test_the_cookie_and_the_redirect():
    h = cookie_header("polar_dashboard_8161", "v", secure=False)
    assert "HttpOnly" in h and "SameSite=Strict" in h and "Path=/" in h and "Secure" not in h
    assert "; Secure" in cookie_header("n", "v", secure=True)
    assert without_ticket("/", [("token", "t")]) == "/"
    assert (
        without_ticket("/sessions/s1/trajectory", [("view", "per_request"), ("token", "t")])
        == "/sessions/s1/trajectory?view=per_request"
    )
