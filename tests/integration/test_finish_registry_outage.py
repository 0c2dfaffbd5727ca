"""A run that ends while the registry is down is still finished as it ended.

Real NATS and a Valkey of the test's own, killed (``kill -9``) and started again on its
directory 1.5 s later, while ``finish_session`` moves a RUNNING session to POSTRUN. Before,
the transition's ConnectionError went up to the executor, which ended the session as
ERROR ("executor failed: Connection closed by server.", seen in the chaos test during a
Valkey outage) although its harness had completed.
"""

from __future__ import annotations

import asyncio

import pytest

from infra import localservers
from schemas import Artifacts, Outcome, SessionFinished, SessionState, decode
from schemas import subjects as S
from services.common.bus import Bus
from services.common.finish import finish_session
from services.common.registry import Registry
from tests.helpers.stack import running_session

pytestmark = pytest.mark.asyncio


async def test_finish_waits_out_a_registry_restart(nats_url, tmp_path):
    port = localservers.free_port()
    valkey = localservers.start_valkey(port, tmp_path / "valkey")
    bus = await Bus.open(nats_url, "test-finish-outage")
    reg = Registry.from_url(f"redis://127.0.0.1:{port}/0")
    try:
        (session,) = await running_session(reg, "finish-outage")
        finished = await bus.nc.subscribe(S.SESSIONS_FINISHED)
        valkey.kill()
        valkey.wait(10)
        finish = asyncio.create_task(
            finish_session(
                reg, bus, session, 0, Outcome.COMPLETED, None, Artifacts(exit_code=0), None
            )
        )
        await asyncio.sleep(1.5)
        assert not finish.done()  # waiting for the registry, not failed
        valkey = localservers.start_valkey(port, tmp_path / "valkey")  # same dir: the AOF
        assert await asyncio.wait_for(finish, 30)
        now = await reg.get_session(session.session_id)
        assert (now.state, now.outcome) == (SessionState.POSTRUN, Outcome.COMPLETED)
        while True:  # the shared bus may carry other tests' events
            ev = decode(await bus.payload(await finished.next_msg(timeout=60)), SessionFinished)
            if ev.session_id == session.session_id:
                break
        assert ev.outcome == Outcome.COMPLETED
    finally:
        await bus.close()
        localservers.stop_process(valkey.pid)
