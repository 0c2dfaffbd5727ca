"""Every connection factory signs in with the credentials in its URL: servers started as
``polar up`` starts them (a NATS user, a Valkey password), real, on free ports."""

from __future__ import annotations

import pytest

from infra import localservers
from infra.credentials import with_userinfo
from proxy.io.resp import Resp
from schemas import subjects as S
from services.cli.connect import open_bus, open_registry
from services.cli.context import Unreachable
from services.client import TrajectoryClient
from services.common.bus import Bus
from services.common.jspub import JetStreamPublisher
from services.common.registry import Registry

pytestmark = pytest.mark.asyncio


@pytest.fixture
def locked_servers(tmp_path):
    nport, rport = localservers.free_port(), localservers.free_port()
    nats = localservers.start_nats(nport, tmp_path / "nats", users={"svc": "n-pass_1"})
    valkey = localservers.start_valkey(rport, tmp_path / "valkey", password="r-pass-2")
    yield f"nats://127.0.0.1:{nport}", f"redis://127.0.0.1:{rport}/0"
    localservers.stop_process(nats.pid)
    localservers.stop_process(valkey.pid)


async def test_every_factory_takes_credentials_from_the_url(locked_servers):
    nats_plain, redis_plain = locked_servers
    nats_url = with_userinfo(nats_plain, "svc", "n-pass_1")
    redis_url = with_userinfo(redis_plain, "", "r-pass-2")

    bus = await Bus.open(nats_url, "creds-bus")  # services (ServiceHost) and the trainer
    pub = JetStreamPublisher(
        nats_url, name="creds-jspub", fallback=bus.publish, fallback_above=1 << 20
    )
    assert await pub.publish(S.completions("creds"), b"x", msg_id="c:1") >= 1
    await pub.aclose()
    reg = Registry.from_url(redis_url)  # services
    assert await reg.ensure_epoch()
    resp = Resp.from_url(redis_url)  # the proxy's own connection
    assert await resp.call("PING") in (b"PONG", "PONG")
    await resp.aclose()
    cli_bus, cli_reg = await open_bus(nats_url), await open_registry(redis_url)  # CLI, export
    await cli_bus.close()
    await cli_reg.close()
    async with TrajectoryClient(nats_url, durable="creds-client", task_ids=["creds"]):
        pass  # the trainer's client
    await reg.close()
    await bus.close()

    with pytest.raises(Unreachable, match="(?i)authorization"):
        await open_bus(nats_plain)
    with pytest.raises(Unreachable, match="(?i)auth"):
        await open_registry(redis_plain)
    with pytest.raises(Unreachable) as refused:
        await open_registry(with_userinfo(redis_plain, "", "wrong-password"))
    assert "wrong-password" not in str(refused.value)  # the URL's password is redacted
