"""Quarantine: a message whose handling kills its process is not run again for ever.

JetStream redelivers a message its consumer did not settle (ack, nak, term) within
``ack_wait``: after a handler that returned or raised, the shared consumer always
settles; so a delivery that ended unsettled ended with its process (``os.abort``, a
segfault, the OOM killer, ``kill -9``) or stalled past ``ack_wait``. Such a message would
kill every restart of its service, and every other message in flight with it each time.

The consumer keeps a small record per message in the ``polar-deliveries`` bucket, written
only off the common path: when a delivery ends in a nak (``naks``) and when one begins
running alone (``alone``). A delivery ``d`` then knows its ``d - 1 - naks`` *deaths*:

- ``after - 1`` deaths (3 by default): it runs alone, beside no other such suspect of its
  consumer (fresh messages go on), so a death now is its own, not a neighbour's;
- a death while it ran alone: it is quarantined, not run again: the service's
  ``on_quarantine`` ends its session with the reason, and it is dead-lettered;
- on its last delivery (``max_deliver``) with any death: quarantined too, since JetStream
  would drop it silently if it died once more;
- when ending its session killed the process as well: only dead-lettered;
- with any death, when the service's ``give_up`` says why not to run it again (its
  session was cancelled: ``services/common/cancels.py``): quarantined at once.

``after`` is 4 by default: three ``kill -9`` of a service (the chaos tests' rounds) never
quarantine good work, while a plugin that kills its process is stopped at its fourth.
Records expire after ``RECORD_TTL_S``; a delivery whose record cannot be read is judged as
if it had none (it runs: a broken bucket never quarantines good work).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Literal

import msgspec
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from schemas import subjects as S
from services.common.bus import Bus

log = logging.getLogger(__name__)

QUARANTINE_AFTER = 4  # deaths
RECORD_TTL_S = 24 * 3600.0


class Record(msgspec.Struct, omit_defaults=True):
    naks: int = 0  # deliveries that ended here in a nak: not deaths
    alone: int = 0  # the delivery that began running alone (0: none, or it ended)
    died_alone: bool = False
    hook: int = 0  # the delivery that began ending its session (``on_quarantine``)


@dataclass(frozen=True)
class Verdict:
    # dead: quarantined, but its session is not ended here: ending it died too;
    # given_up: quarantined before its time, for a reason of its service's (``reason``)
    action: Literal["run", "alone", "quarantine", "dead", "given_up"]
    deaths: int = 0
    reason: str = ""

    @property
    def times(self) -> str:
        return _times(self.deaths)


RUN = Verdict("run")


def judge(delivered: int, record: Record, *, after: int, last: bool) -> Verdict:
    """What delivery ``delivered`` of a message with ``record`` does (pure)."""
    deaths = max(0, delivered - 1 - record.naks)
    if record.hook:
        why = "and so did ending its session"
        return Verdict("dead", deaths, _reason(deaths, why))
    if record.died_alone or record.alone:
        why = "the last time running alone"
        return Verdict("quarantine", deaths, _reason(deaths, why))
    if deaths and last:
        why = "and this is its last delivery"
        return Verdict("quarantine", deaths, _reason(deaths, why))
    if deaths >= after - 1:
        return Verdict("alone", deaths)
    return Verdict("run", deaths)


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _reason(deaths: int, why: str) -> str:
    return f"quarantined: its process died {_times(deaths)} while handling it, {why}"


@dataclass
class Trial:
    """One delivery of a message: its record as read, and what it was judged to do."""

    key: str
    delivered: int
    record: Record | None  # None: no record (a first delivery, or none kept)
    verdict: Verdict


class Trials:
    """One consumer's delivery records."""

    def __init__(self, bus: Bus, consumer: str, *, after: int = QUARANTINE_AFTER) -> None:
        self.bus, self.consumer, self.after = bus, consumer, after
        self._kv: KeyValue | None = None

    async def open(self, msg: Msg, stream: str, max_deliver: int, *, running: bool) -> Trial:
        """Judge a delivery; a first one reads nothing, nor one whose earlier delivery
        still ``running`` here (it stalled past ``ack_wait``: no death)."""
        meta = msg.metadata
        delivered = meta.num_delivered or 1
        key = S.delivery_key(self.consumer, stream, meta.sequence.stream)
        if delivered <= 1 or running:
            return Trial(key, delivered, None, RUN)
        try:
            record = await self._get(key)
        except Exception:  # noqa: BLE001 - no record to judge by: run it
            log.warning("%s: cannot read the delivery record %s", self.consumer, key, exc_info=True)
            return Trial(key, delivered, None, RUN)
        last = 0 < max_deliver <= delivered
        verdict = judge(delivered, record or Record(), after=self.after, last=last)
        return Trial(key, delivered, record, verdict)

    async def begin_alone(self, trial: Trial) -> None:
        record = msgspec.structs.replace(trial.record or Record(), alone=trial.delivered)
        await self._put(trial.key, record)
        trial.record = record

    async def begin_hook(self, trial: Trial) -> None:
        record = msgspec.structs.replace(trial.record or Record(), hook=trial.delivered)
        await self._put(trial.key, record)
        trial.record = record

    async def nakked(self, trial: Trial) -> None:
        """The delivery ended in a nak: not a death (a quarantine whose end of the
        session failed, and was nakked, stays quarantined)."""
        record = trial.record or Record()
        died_alone = trial.verdict.action == "quarantine" or record.died_alone
        await self._put(trial.key, Record(naks=record.naks + 1, died_alone=died_alone))

    async def settled(self, trial: Trial) -> None:
        """Acked or terminated: the record is not needed any more."""
        if trial.record is not None:
            with contextlib.suppress(Exception):
                await (await self._bucket()).purge(trial.key)

    async def _get(self, key: str) -> Record | None:
        try:
            entry = await (await self._bucket()).get(key)
        except KeyNotFoundError:
            return None
        return msgspec.json.decode(entry.value, type=Record) if entry.value else None

    async def _put(self, key: str, record: Record) -> None:
        try:
            await (await self._bucket()).put(key, msgspec.json.encode(record))
        except Exception:  # noqa: BLE001 - a lost record only makes a death look likelier
            log.warning("%s: cannot keep the delivery record %s", self.consumer, key, exc_info=True)

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await deliveries_bucket(self.bus)
        return self._kv


async def deliveries_bucket(bus: Bus) -> KeyValue:
    """The bucket, made on first use, with as many copies as the work queues' stream."""
    try:
        return await bus.js.key_value(S.DELIVERIES_BUCKET)
    except (BucketNotFoundError, NotFoundError):
        replicas = 1
        with contextlib.suppress(Exception):
            replicas = (await bus.js.stream_info(S.STREAM_SESSIONS)).config.num_replicas or 1
        config = KeyValueConfig(
            bucket=S.DELIVERIES_BUCKET,
            ttl=RECORD_TTL_S,
            storage=StorageType.FILE,
            history=1,
            replicas=replicas,
        )
        return await bus.js.create_key_value(config)
