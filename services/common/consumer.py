"""A durable pull consumer loop shared by every service.

- Concurrency is bounded; each handler's message is kept alive with ``in_progress``
  while it runs (long jobs outlive ``ack_wait``), by one loop for all of them (a task
  per message cost a start and a cancel on every message).
- A handler returns normally → ack; raises ``Retry`` → nak with delay; raises
  ``Poison`` (or keeps failing until ``max_deliver``) → the message goes to
  ``polar.dlq.<stream>`` with the reason and is terminated.
- A message whose handling kills the process (no settle, delivery after delivery) runs
  alone after a few such deaths and is then quarantined: ``on_quarantine`` ends its
  session with the reason, and it is dead-lettered (``services/common/quarantine.py``).
- ``drain=True`` processes what is queued and returns: deterministic tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig

from schemas import subjects as S
from services.common.bus import Bus, ensure_consumer
from services.common.faults import TRANSIENT_WAIT_S, retry_faults
from services.common.metrics import HANDLER_SECONDS, INFLIGHT, MESSAGES
from services.common.quarantine import QUARANTINE_AFTER, Trial, Trials, Verdict

log = logging.getLogger(__name__)
# the age a process reaches before it runs a message that killed one before: beyond
# supervisors' crash-loop windows (granian's: a worker dead within 5.5 s of its respawn)
SUSPECT_AFTER_S = 7.0


def process_age() -> float:
    """Seconds since this process started (a granian worker forked from its server: not
    the age of the modules it inherited), from /proc; 0 where that cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return 0.0


Handler = Callable[[Msg], Awaitable[None]]
# Ends the session of a quarantined message with the verdict's reason; one that raises is
# tried again at the message's next delivery
OnQuarantine = Callable[[Msg, Verdict], Awaitable[None]]
# Asked before a message that died with its process is run again: why not to (quarantine
# it now), or None
GiveUp = Callable[[Msg], Awaitable[str | None]]


class Retry(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Not now: redeliver after ``delay`` seconds (does not count as poison)."""

    def __init__(self, delay: float = 1.0, reason: str = "") -> None:
        super().__init__(reason or f"retry in {delay}s")
        self.delay = delay


class Poison(Exception):  # noqa: N818
    """This message can never be handled: dead-letter it with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def dead_letter(bus: Bus, stream: str, msg: Msg, reason: str) -> None:
    headers = {
        "Polar-Reason": reason[:2000],
        "Polar-Subject": msg.subject,
        "Polar-Stream": stream,
    }
    with contextlib.suppress(Exception):
        headers["Polar-Seq"] = str(msg.metadata.sequence.stream)
    await bus.js.publish(S.dead_letter(stream), msg.data, headers=headers)


class Consumer:
    def __init__(
        self,
        bus: Bus,
        stream: str,
        config: ConsumerConfig,
        handler: Handler,
        *,
        concurrency: int = 16,
        on_quarantine: OnQuarantine | None = None,
        give_up: GiveUp | None = None,
        quarantine_after: int = QUARANTINE_AFTER,
    ) -> None:
        self.bus, self.stream, self.config, self.handler = bus, stream, config, handler
        self.name = config.durable_name or "ephemeral"
        self.concurrency = concurrency
        self.on_quarantine, self.give_up = on_quarantine, give_up
        self.trials = Trials(bus, self.name, after=quarantine_after)
        self._alone = asyncio.Lock()  # the suspects of killing the process, one at a time
        self._inflight: set[asyncio.Task] = set()
        # the messages of the handlers running now, by id (a Msg is not hashable)
        self._handling: dict[int, Msg] = {}
        self._stopping = asyncio.Event()

    async def run(self, *, drain: bool = False) -> None:
        await ensure_consumer(self.bus.js, self.stream, self.config)
        sub = await self.bus.js.pull_subscribe_bind(self.config.durable_name, self.stream)
        idle_timeout = 0.3 if drain else 2.0
        keepalive = asyncio.create_task(self._keepalive())
        try:
            while not self._stopping.is_set():
                room = self.concurrency - len(self._inflight)
                if room <= 0:
                    await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    msgs = await sub.fetch(room, timeout=idle_timeout)
                except (TimeoutError, NatsTimeout):
                    if drain and not self._inflight:
                        return
                    if drain:
                        await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                for msg in msgs:
                    task = asyncio.create_task(self._handle(msg))
                    self._inflight.add(task)
                    task.add_done_callback(self._inflight.discard)
        finally:
            if self._inflight:
                await asyncio.gather(*self._inflight, return_exceptions=True)
            keepalive.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def stop(self) -> None:
        self._stopping.set()

    async def _keepalive(self) -> None:
        """Every third of ``ack_wait``, mark each message being handled in progress: each
        hears from us at least that often, however long ago its handler started."""
        period = max((self.config.ack_wait or 30.0) / 3, 0.5)
        while True:
            await asyncio.sleep(period)
            for msg in list(self._handling.values()):
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    async def _handle(self, msg: Msg) -> None:
        self._handling[id(msg)] = msg
        start = time.perf_counter()
        INFLIGHT.labels(self.name).inc()
        result = "cancelled"
        try:
            again = (msg.metadata.num_delivered or 1) > 1
            trial = await self.trials.open(
                msg,
                self.stream,
                self.config.max_deliver or -1,
                running=again and self._running(msg),
            )
            await self._maybe_give_up(msg, trial)
            result = await self._settle(msg, trial)
        finally:
            self._handling.pop(id(msg), None)
            INFLIGHT.labels(self.name).dec()
            HANDLER_SECONDS.labels(self.name).observe(time.perf_counter() - start)
            MESSAGES.labels(self.name, result).inc()

    async def _settle(self, msg: Msg, trial: Trial) -> str:
        """Run the handler (or quarantine the message) and settle the message; what
        became of it, for the metrics."""
        result = "ack"
        try:
            if trial.verdict.action in ("quarantine", "dead", "given_up"):
                result = "quarantined"
                await self._quarantine(msg, trial)
            else:
                await self._run(msg, trial)
                if not msg._ackd:
                    await msg.ack()
        except Retry as r:
            result = "retry"
            if self._last_delivery(msg):  # JetStream would drop it silently: dead-letter it
                result = "dead_letter"
                await self._dead(
                    msg, f"still not ready after {msg.metadata.num_delivered} tries: {r}"
                )
            else:
                await msg.nak(delay=r.delay)
        except Poison as p:
            result = "dead_letter"
            await self._dead(msg, p.reason)
        except Exception as exc:  # noqa: BLE001 - a bad message must not kill the service
            result = await self._failed(msg, exc)
        if result in ("retry", "nak"):
            await self.trials.nakked(trial)
        else:
            await self.trials.settled(trial)
        return result

    async def _maybe_give_up(self, msg: Msg, trial: Trial) -> None:
        verdict = trial.verdict
        if self.give_up is None or not verdict.deaths or verdict.action not in ("run", "alone"):
            return
        try:
            why = await self.give_up(msg)
        except Exception:  # noqa: BLE001 - no answer: run it as judged
            log.warning("%s: give_up failed", self.name, exc_info=True)
            return
        if why:
            trial.verdict = Verdict("given_up", verdict.deaths, why)

    def _running(self, msg: Msg) -> bool:
        """Whether an earlier delivery of ``msg`` is still being handled here."""
        seq = msg.metadata.sequence.stream
        return any(
            m is not msg and m.metadata.sequence.stream == seq for m in self._handling.values()
        )

    async def _run(self, msg: Msg, trial: Trial) -> None:
        if trial.verdict.deaths:
            # A suspect runs only once this process is SUSPECT_AFTER_S old: a supervisor
            # that restarts it (granian's own respawn, systemd) may take a process dead
            # sooner for a crash loop and stop restarting it. Kept in progress meanwhile.
            await asyncio.sleep(max(0.0, SUSPECT_AFTER_S - process_age()))
        if trial.verdict.action != "alone":
            return await self._run_handler(msg)
        async with self._alone:  # a death now is this message's own
            log.warning(
                "%s: stream message %s died with its process %d times: running it alone",
                self.name,
                msg.metadata.sequence.stream,
                trial.verdict.deaths,
            )
            await self.trials.begin_alone(trial)
            await self._run_handler(msg)

    async def _quarantine(self, msg: Msg, trial: Trial) -> None:
        """End the message's session (``on_quarantine``) and dead-letter it."""
        verdict = trial.verdict
        log.error(
            "%s: stream message %s %s", self.name, msg.metadata.sequence.stream, verdict.reason
        )
        hook = self.on_quarantine
        if hook is not None and verdict.action in ("quarantine", "given_up"):
            await self.trials.begin_hook(trial)
            await retry_faults(
                lambda: hook(msg, verdict),
                seconds=TRANSIENT_WAIT_S,
                on_retry=lambda exc, delay: log.warning(
                    "%s: quarantine: %r; trying again in %.2fs", self.name, exc, delay
                ),
            )
        await self._dead(msg, verdict.reason)

    async def _run_handler(self, msg: Msg) -> None:
        """The handler, run again here (the message kept in progress) while it fails on a
        fault of the system, up to ``TRANSIENT_WAIT_S``: a registry restart or a bus
        blip must not use up ``max_deliver`` and dead-letter good work (a READY hand-off
        lost that way left its session READY forever)."""
        return await retry_faults(
            lambda: self.handler(msg),
            seconds=TRANSIENT_WAIT_S,
            on_retry=lambda exc, delay: log.warning(
                "%s: %r; trying again in %.2fs", self.name, exc, delay
            ),
        )

    def _last_delivery(self, msg: Msg) -> bool:
        max_deliver = self.config.max_deliver or -1
        return max_deliver > 0 and (msg.metadata.num_delivered or 1) >= max_deliver

    async def _failed(self, msg: Msg, exc: Exception) -> str:
        delivered = msg.metadata.num_delivered or 1
        log.exception("%s: handler failed (delivery %d)", self.name, delivered)
        if self._last_delivery(msg):
            await self._dead(msg, f"failed {delivered} times; last error: {exc!r}")
            return "dead_letter"
        await msg.nak(delay=min(0.5 * 2**delivered, 30.0))
        return "nak"

    async def _dead(self, msg: Msg, reason: str) -> None:
        await dead_letter(self.bus, self.stream, msg, reason)
        await msg.term()
