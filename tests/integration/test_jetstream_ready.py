"""A starting service waits for JetStream to take its stream declarations (a cluster
still electing its leader, a loaded machine) instead of exiting: the multi-host test's
scheduler once exited at start with `nats: timeout` from `add_stream`.

Real nats-servers: first one without JetStream (every JetStream request unanswered),
then one with it, on the same port; the waiting client reconnects to it."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from infra import localservers
from services.common.bus import Bus, declare_when_ready

pytestmark = pytest.mark.timeout(120)


def _nats_without_jetstream(port: int, tmp_path) -> subprocess.Popen:
    binary = localservers.nats_server_binary()
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # its own group: stop_process kills it  # fmt: skip
    localservers.wait_listening("127.0.0.1", port, proc)
    return proc


async def test_declaring_waits_for_jetstream_and_succeeds_once_it_is_there(tmp_path):
    port = localservers.free_port()
    url = f"nats://127.0.0.1:{port}"
    plain = _nats_without_jetstream(port, tmp_path)
    with_js = None
    try:
        bus = await Bus.open(url, "test-ready", declare=False)
        waited = asyncio.Event()
        declaring = asyncio.create_task(
            declare_when_ready(bus.js, wait_s=90, on_wait=lambda exc: waited.set())
        )
        await asyncio.wait_for(waited.wait(), 60)  # told: not ready, trying again
        assert not declaring.done()
        localservers.stop_process(plain.pid)
        with_js = await asyncio.to_thread(localservers.start_nats, port, tmp_path / "js")
        await asyncio.wait_for(declaring, 80)
        info = await bus.js.stream_info("POLAR_TRAJECTORIES")
        assert info.config.name == "POLAR_TRAJECTORIES"
        await bus.close()
    finally:
        localservers.stop_process(plain.pid)
        if with_js is not None:
            localservers.stop_process(with_js.pid)


async def test_it_gives_up_after_its_wait_with_the_servers_error(tmp_path):
    port = localservers.free_port()
    plain = _nats_without_jetstream(port, tmp_path)
    try:
        bus = await Bus.open(f"nats://127.0.0.1:{port}", "test-ready", declare=False)
        waits = []
        with pytest.raises(Exception) as caught:
            await declare_when_ready(bus.js, wait_s=1.0, on_wait=waits.append)
        assert type(caught.value).__name__ in ("NoRespondersError", "TimeoutError",
                                               "ServiceUnavailableError")  # fmt: skip
        assert waits  # it waited before giving up
        await bus.close()
    finally:
        localservers.stop_process(plain.pid)
