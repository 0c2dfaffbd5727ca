"""Reading back what a JetStream stream stored, for tests."""

from __future__ import annotations


async def stored_messages(bus, subject: str, count: int | None = None, timeout: float = 30.0):
    """The stored messages of ``subject``: ``count`` of them, or (None) as many as the
    stream holds there now, each given up to ``timeout`` to arrive. Counted, not read
    until a silence: a loaded machine can be slow to deliver the first one."""
    if count is None:
        stream = await bus.js.find_stream_name_by_subject(subject)
        info = await bus.js.stream_info(stream, subjects_filter=subject)
        count = sum((info.state.subjects or {}).values())
    sub = await bus.js.subscribe(subject, ordered_consumer=True)
    try:
        return [await sub.next_msg(timeout=timeout) for _ in range(count)]
    finally:
        await sub.unsubscribe()
