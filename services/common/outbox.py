"""The outbox: a message that must follow a registry change reaches the bus, however long
the bus is away and whoever dies in between.

A hand-off (a retry's INIT work, a session's finish event) is kept in the registry in the
same step as the change it follows (``Registry.transition(outbox=...)``); a state event
the bus refused is kept there too (``Registry._emit``). The changer publishes at once
(``hand_off``) and marks the message sent. When that publish fails (the bus away longer
than ``publish_retrying``'s ~8 s) or the changer dies between the change and the publish,
the ``relay`` that every service with a registry runs publishes it later. Before this, a
30 s NATS outage left a retried session REGISTERED with no INIT work until its deadline
(issue 33). A second copy is harmless: the bus drops it by its dedupe id, and past the
stream's duplicate window each consumer's own fence (the attempt, the state) does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from prometheus_client import Counter, Gauge

from services.common.bus import Bus
from services.common.faults import BUS_DOWN, REGISTRY_DOWN
from services.common.registry import Outgoing, Registry

log = logging.getLogger(__name__)

# Older than this, a kept message is the relay's: longer than ``publish_retrying``'s tries,
# so the changer's own publish goes first and the relay sends only what it gave up on.
RELAY_GRACE_S = 15.0
RELAY_EVERY_S = 2.0

DEFERRED = Counter(
    "polar_outbox_deferred_total", "Hand-offs left to the outbox's relay (the bus was away)"
)
RELAYED = Counter("polar_outbox_relayed_total", "Messages the outbox's relay published")
WAITING = Gauge("polar_outbox_waiting", "Messages in the outbox past their grace, last look")


async def hand_off(registry: Registry, bus: Bus, out: Outgoing) -> bool:
    """Publish ``out``, which its registry change kept in the outbox, and mark it sent.
    False when the bus stayed away: the relay publishes it once the bus is back."""
    try:
        await bus.publish_retrying(out.subject, out.payload, msg_id=out.msg_id)
    except BUS_DOWN as exc:
        DEFERRED.inc()
        log.warning("%s not published (%r): left to the outbox's relay", out.msg_id, exc)
        return False
    # sent: if the registry is away now, the relay's later copy is deduplicated
    with contextlib.suppress(*REGISTRY_DOWN):
        await registry.outbox_sent(out.msg_id)
    return True


async def hand_off_all(registry: Registry, bus: Bus, outs: list[Outgoing]) -> int:
    """Keep ``outs`` in the outbox, publish them (a bounded fan-out of pending acks) and
    mark the ones published sent; the number the bus refused (left to the relay). For
    messages that follow a change made without the outbox (a task's registration)."""
    if not outs:
        return 0
    await registry.outbox_keep(*outs)
    sent: list[str] = []
    for i in range(0, len(outs), 256):
        batch = outs[i : i + 256]
        got = await asyncio.gather(
            *(bus.send(o.subject, o.payload, msg_id=o.msg_id) for o in batch),
            return_exceptions=True,
        )
        for out, result in zip(batch, got, strict=True):
            if isinstance(result, BUS_DOWN):
                continue
            if isinstance(result, BaseException):
                raise result
            sent.append(out.msg_id)
    if sent:
        with contextlib.suppress(*REGISTRY_DOWN):
            await registry.outbox_sent(*sent)
    if refused := len(outs) - len(sent):
        DEFERRED.inc(refused)
        log.warning("%d message(s) not published: left to the outbox's relay", refused)
    return refused


async def relay(registry: Registry, bus: Bus, grace: float = RELAY_GRACE_S) -> int:
    """Publish what the outbox has held longer than ``grace``, oldest first; the number
    published. Stops at the first publish the bus refuses (it is still away)."""
    due = await registry.outbox_due(time.time() - grace)
    WAITING.set(len(due))
    sent = 0
    for out in due:
        try:
            await bus.send(out.subject, out.payload, msg_id=out.msg_id)
        except BUS_DOWN as exc:
            log.info("outbox relay: the bus is still away (%r); %d waiting", exc, len(due) - sent)
            break
        await registry.outbox_sent(out.msg_id)
        RELAYED.inc()
        sent += 1
    if sent:
        log.warning("outbox relay published %d message(s) their changers could not", sent)
    return sent
