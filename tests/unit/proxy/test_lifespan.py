"""``ProxyApp``'s lifespan: its context managers entered in order at start-up and left in
reverse at shutdown, around the native server's serving (``proxy.io.native.run_native``:
started before it listens, stopped after SIGTERM) or from ASGI's lifespan messages."""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import asynccontextmanager

import pytest

from proxy.app import create_app, unprepared
from proxy.io.native import run_native
from tests.unit.protocols.app_support import Scripted, resolve


def lifespans(events: list[str], fail: str | None = None) -> list:
    def named(name: str):
        @asynccontextmanager
        async def lifespan(app):
            assert app is not None  # each is given the app
            if name == fail:
                raise RuntimeError(f"{name}: no engine")
            events.append(f"start {name}")
            try:
                yield
            finally:
                events.append(f"stop {name}")

        return lifespan

    return [named("a"), named("b")]


def app_with(events: list[str], fail: str | None = None):
    return create_app(unprepared(Scripted()), resolve, lifespan=lifespans(events, fail))


def test_the_native_server_starts_before_serving_and_stops_after() -> None:
    events: list[str] = []
    app = app_with(events)
    seen: list[list[str]] = []

    async def main() -> None:
        def ready(port: int) -> None:  # listening: start-up has run, shutdown not yet
            seen.append(list(events))
            assert port > 0
            asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)

        await run_native(app, "127.0.0.1", 0, ready)

    asyncio.run(main())
    assert seen == [["start a", "start b"]]
    assert events == ["start a", "start b", "stop b", "stop a"]


def test_a_failed_native_startup_ends_the_process_with_its_reason(capsys) -> None:
    events: list[str] = []
    app = app_with(events, fail="b")
    with pytest.raises(SystemExit) as exit_:
        asyncio.run(run_native(app, "127.0.0.1", 0, lambda port: None))
    assert exit_.value.code == 1
    assert events == ["start a", "stop a"]  # what did start is stopped again
    err = capsys.readouterr().err
    assert err.startswith("lifespan startup failed:\nTraceback (most recent call last):")
    assert "RuntimeError: b: no engine" in err


async def asgi_lifespan(app, *messages: str) -> list[dict]:
    inbox: asyncio.Queue = asyncio.Queue()
    for m in messages:
        inbox.put_nowait({"type": f"lifespan.{m}"})
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, send)
    return sent


def test_asgi_lifespan_messages_start_and_stop_it() -> None:
    events: list[str] = []
    sent = asyncio.run(asgi_lifespan(app_with(events), "startup", "shutdown"))
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert events == ["start a", "start b", "stop b", "stop a"]


def test_a_failed_asgi_startup_reports_its_traceback() -> None:
    events: list[str] = []
    (failed,) = asyncio.run(asgi_lifespan(app_with(events, fail="a"), "startup"))
    assert failed["type"] == "lifespan.startup.failed"
    assert "RuntimeError: a: no engine" in failed["message"] and events == []
