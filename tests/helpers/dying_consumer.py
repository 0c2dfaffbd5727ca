"""A service process of one shared consumer whose handler ends the process on the message
``poison`` (``python -m tests.helpers.dying_consumer NATS_URL STREAM``), for the quarantine
tests. Other messages are ``slow:<seconds>``: handled after that long. What happens is
told on ``sig.<stream>.done`` and ``sig.<stream>.quarantined``."""

from __future__ import annotations

import asyncio
import os
import sys

from services.common.bus import Bus, work_consumer
from services.common.consumer import Consumer


async def main(url: str, stream: str) -> None:
    bus = await Bus.open(url, "dying-consumer", declare=False)

    async def handle(msg) -> None:
        if msg.data == b"poison":
            os._exit(70)
        await asyncio.sleep(float(msg.data.split(b":")[1]))
        await bus.nc.publish(f"sig.{stream}.done", msg.data)

    async def quarantined(msg, verdict) -> None:
        await bus.nc.publish(f"sig.{stream}.quarantined", msg.data)

    cfg = work_consumer("dying", f"{stream}.work", ack_wait=1.0, max_deliver=10)
    await Consumer(bus, stream, cfg, handle, concurrency=4, on_quarantine=quarantined).run()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
