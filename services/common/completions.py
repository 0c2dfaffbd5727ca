"""Read every CompletionRecord of one session from ``polar.completions.<session_id>``."""

from __future__ import annotations

import contextlib

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas import CompletionRecord, ContractError, decode
from schemas import subjects as S
from services.common.bus import Bus

# Records read one request each before a consumer is made for the rest: most sessions
# make a few calls, and a consumer costs the server a create, an info and a delete.
DIRECT_READS = 8


async def last_seq(bus: Bus, subject: str) -> int | None:
    """The stream sequence of the subject's last message, None when it has none."""
    try:
        return (await bus.js.get_last_msg(S.STREAM_COMPLETIONS, subject)).seq
    except NotFoundError:
        return None


async def read_completions(
    bus: Bus, session_id: str, *, batch: int = 256, timeout: float = 5.0
) -> tuple[list[CompletionRecord], list[str]]:
    """(records, problems): every record up to the subject's last one when asked.

    The first ``DIRECT_READS`` records are read one request each (the stream's next
    message on the session's subject); the rest, if any, through an ephemeral,
    unacknowledged consumer filtered on that subject, from where the reads stopped to
    that sequence. Claim-checked payloads are fetched from the object store. A message
    that does not decode is reported as a problem, not raised.
    """
    subject = S.completions(session_id)
    end = await last_seq(bus, subject)
    if end is None:
        return [], []
    records: list[CompletionRecord] = []
    problems: list[str] = []
    seq = 0
    for _ in range(DIRECT_READS):
        msg = await bus.js.get_msg(S.STREAM_COMPLETIONS, seq + 1, subject, next=True)
        seq = msg.seq
        await _decode_into(bus, msg, seq, records, problems)
        if seq >= end:
            return records, problems
    await _read_by_consumer(bus, subject, seq, end, records, problems, batch, timeout)
    return records, problems


async def _read_by_consumer(
    bus: Bus, subject: str, after: int, end: int, records, problems, batch: int, timeout: float
) -> None:
    """The subject's records after stream sequence ``after`` up to ``end``, by a consumer."""
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=after + 1,
        filter_subject=subject,
        inactive_threshold=60.0,
        mem_storage=True,
    )
    sub = await bus.js.pull_subscribe(subject, stream=S.STREAM_COMPLETIONS, config=config)
    try:
        seq = after
        while seq < end:
            try:
                msgs = await sub.fetch(batch, timeout=timeout)
            except (TimeoutError, NatsTimeout):
                msg = f"reading {subject}: stalled at stream seq {seq} of {end}"
                raise TimeoutError(msg) from None
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                if seq > end:
                    break
                await _decode_into(bus, msg, seq, records, problems)
    finally:
        await _close(bus, sub)


async def _close(bus: Bus, sub) -> None:
    # Delete the ephemeral consumer now rather than leave it to inactive_threshold.
    with contextlib.suppress(Exception):
        name = (await sub.consumer_info()).name
        await bus.js.delete_consumer(S.STREAM_COMPLETIONS, name)
    with contextlib.suppress(Exception):
        await sub.unsubscribe()


async def _decode_into(bus: Bus, msg, seq: int, records: list, problems: list) -> None:
    try:
        records.append(decode(await bus.payload(msg), CompletionRecord))
    except (ContractError, LookupError) as exc:
        problems.append(f"completion at stream seq {seq} unreadable: {exc}")
