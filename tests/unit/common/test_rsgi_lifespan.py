"""``proxy.io.rsgi.Lifespan``: an ASGI app's lifespan run from RSGI's init and
del hooks, each of which runs the event loop itself (as granian calls them)."""

from __future__ import annotations

import asyncio

import pytest
from litestar import Litestar, get

from proxy.io.rsgi import Lifespan


def _app_with(events: list[str], fail_startup: bool = False) -> Litestar:
    async def started() -> None:
        if fail_startup:
            raise RuntimeError("no engine")
        events.append("started")

    async def stopped() -> None:
        events.append("stopped")

    @get("/")
    async def index() -> str:
        return "ok"

    return Litestar([index], on_startup=[started], on_shutdown=[stopped])


def test_startup_runs_before_serving_and_shutdown_after() -> None:
    events: list[str] = []
    loop = asyncio.new_event_loop()
    try:
        lifespan = Lifespan(_app_with(events))
        lifespan.startup(loop)
        assert events == ["started"]
        loop.run_until_complete(asyncio.sleep(0))  # the server's loop runs in between
        lifespan.shutdown(loop)
        assert events == ["started", "stopped"]
        lifespan.shutdown(loop)  # once only
        assert events == ["started", "stopped"]
    finally:
        loop.close()


def test_a_failed_startup_ends_the_worker() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(SystemExit) as exit_:
            Lifespan(_app_with([], fail_startup=True)).startup(loop)
        assert exit_.value.code == 1
    finally:
        loop.close()


def test_an_app_that_ends_its_lifespan_early_fails_startup() -> None:
    async def no_lifespan(scope, receive, send) -> None:
        await receive()  # takes the startup message and returns without answering

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(SystemExit):
            Lifespan(no_lifespan).startup(loop)
    finally:
        loop.close()


def test_an_app_that_raises_in_its_lifespan_fails_startup() -> None:
    async def broken(scope, receive, send) -> None:
        raise ValueError("broken app")

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(SystemExit):
            Lifespan(broken).startup(loop)
    finally:
        loop.close()
