"""The bearer-token roles and the browser sign-in (one-time tickets, signed cookies) of
``services/common/auth.py``: plain functions, the clock passed in."""

from __future__ import annotations

from services.common.auth import (
    ADMIN,
    COOKIE_SECONDS,
    MAX_TICKET_SECONDS,
    READ,
    TICKET_SECONDS,
    Ticket,
    Tickets,
    bearer,
    cookie_valid,
    refusal,
    session_cookie,
    sign_in_ticket,
)

NOW = 1_800_000_000.0
KEY, OTHER = "pr_the-read-token", "pr_another-stacks-token"


def tickets(*keys: str) -> Tickets:
    return Tickets(keys or (KEY,), "dashboard", "run `polar dashboard` for a fresh one")


def test_bearer_and_the_roles():
    assert bearer({"authorization": "Bearer abc"}) == "abc"
    assert bearer({"authorization": "Basic abc"}) is None and bearer({}) is None
    ok = {"authorization": "Bearer r"}
    assert refusal(READ, ok, admin_token="a", read_token="r", service="x") is None
    assert refusal(ADMIN, ok, admin_token="a", read_token="r", service="x") is not None
    assert "no admin_token" in refusal(ADMIN, ok, admin_token=None, service="x")


def test_a_ticket_carries_its_own_nonce_and_says_nothing_of_the_token():
    """Its one use is recorded by nonce in the registry (tests/unit/dashboard/test_access.py,
    tests/integration/test_dashboard_auth.py): each link has its own."""
    t = sign_in_ticket(KEY, "dashboard", now=NOW)
    assert KEY not in t and KEY.removeprefix("pr_") not in t
    checked = tickets().verify(t, now=NOW + 1)
    assert checked == Ticket(t.split(".")[1], int(NOW) + TICKET_SECONDS)
    again = sign_in_ticket(KEY, "dashboard", now=NOW)
    assert again != t and tickets().verify(again, now=NOW + 3).nonce != checked.nonce


def test_a_ticket_is_refused_when_expired_forged_or_for_another_service():
    t = sign_in_ticket(KEY, "dashboard", now=NOW)
    assert "expired" in tickets().verify(t, now=NOW + TICKET_SECONDS + 1)
    assert "fresh one" in tickets().verify(t, now=NOW + TICKET_SECONDS + 1)
    assert "not one of" in tickets(OTHER).verify(t, now=NOW)  # another stack's key
    assert "not one of" in tickets().verify(sign_in_ticket(KEY, "scheduler", now=NOW), now=NOW)
    expiry, nonce, mac = t.split(".")
    for forged in (
        f"{int(expiry) + 3600}.{nonce}.{mac}",  # a later expiry is not what was signed
        f"{expiry}.other.{mac}",
        f"{expiry}.{nonce}.{mac[:-2]}AA",
        "",
        "...",
        "x.y.z",
        f"-1.{nonce}.{mac}",
    ):
        assert "not one of" in tickets().verify(forged, now=NOW), forged
    long = sign_in_ticket(KEY, "dashboard", now=NOW, ttl=MAX_TICKET_SECONDS + 60)
    assert "more than a day" in tickets().verify(long, now=NOW)
    # the admin token is a key too: a dashboard given both takes either's tickets
    assert isinstance(
        tickets(KEY, OTHER).verify(sign_in_ticket(OTHER, "dashboard", now=NOW), now=NOW), Ticket
    )


def test_a_cookie_is_good_for_its_key_service_and_day_only():
    c = session_cookie(KEY, "dashboard", now=NOW)
    assert KEY not in c
    assert cookie_valid(c, [KEY], "dashboard", now=NOW + 10)
    assert cookie_valid(c, [OTHER, KEY], "dashboard", now=NOW + 10)
    assert not cookie_valid(c, [OTHER], "dashboard", now=NOW)  # a new stack's token
    assert not cookie_valid(c, [KEY], "scheduler", now=NOW)
    assert not cookie_valid(c, [KEY], "dashboard", now=NOW + COOKIE_SECONDS + 1)
    expiry, mac = c.split(".")
    assert not cookie_valid(f"{int(expiry) + 999}.{mac}", [KEY], "dashboard", now=NOW)
    assert not cookie_valid("", [KEY], "dashboard", now=NOW)
    assert not cookie_valid(c, [None, ""], "dashboard", now=NOW)  # no key: nothing is
    # a ticket is no cookie, nor a cookie a ticket
    t = sign_in_ticket(KEY, "dashboard", now=NOW)
    assert not cookie_valid(t, [KEY], "dashboard", now=NOW)
    assert isinstance(tickets().verify(c, now=NOW), str)
