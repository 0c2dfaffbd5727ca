"""Read every CompletionRecord of one session from ``polar.completions.<session_id>``."""

from __future__ import annotations

import contextlib

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas import CompletionRecord, ContractError, decode
from schemas import subjects as S
from services.common.bus import Bus


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

    An ephemeral, unacknowledged consumer filtered on the session's subject reads from
    the start to that sequence; claim-checked payloads are fetched from the object store.
    A message that does not decode is reported as a problem, not raised.
    """
    subject = S.completions(session_id)
    end = await last_seq(bus, subject)
    if end is None:
        return [], []
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL,
        filter_subject=subject,
        inactive_threshold=60.0,
        mem_storage=True,
    )
    sub = await bus.js.pull_subscribe(subject, stream=S.STREAM_COMPLETIONS, config=config)
    records: list[CompletionRecord] = []
    problems: list[str] = []
    try:
        seq = 0
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
                await _decode_into(bus, msg, records, problems)
    finally:
        await _close(bus, sub)
    return records, problems


async def _close(bus: Bus, sub) -> None:
    # Delete the ephemeral consumer now rather than leave it to inactive_threshold.
    with contextlib.suppress(Exception):
        name = (await sub.consumer_info()).name
        await bus.js.delete_consumer(S.STREAM_COMPLETIONS, name)
    with contextlib.suppress(Exception):
        await sub.unsubscribe()


async def _decode_into(bus: Bus, msg, records: list, problems: list) -> None:
    seq = msg.metadata.sequence.stream
    try:
        records.append(decode(await bus.payload(msg), CompletionRecord))
    except (ContractError, LookupError) as exc:
        problems.append(f"completion at stream seq {seq} unreadable: {exc}")
