"""Node queues nobody takes from: another evaluator takes them over.

A TrajectoryBuilt whose evaluation needs a runtime left on node X (live, or prewarmed)
waits on X's queue (``polar.sessions.built.node.X``) for an evaluator that reaches X's
runtimes. If X is gone for good (its host lost), nobody would take that work and its
sessions would stay EVALUATING, their groups never whole. So every evaluator looks at the
other nodes' queues, and one that has held work nobody took for ``orphan_after_seconds``
is drained here: X's runtimes are out of reach, so each session is evaluated as if its
runtime had not been kept (a fresh runtime with the session's diff, noted in the result).

Whether a queue is taken from is read from JetStream's own counts (no heartbeat of our
own): work waiting, nothing being handled, no pull request open, and the delivered
sequence unchanged since the last look.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from nats.js.api import ConsumerInfo

from schemas import subjects as S

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueLook:
    """One look at a node queue's consumer."""

    node: str
    pending: int  # not yet delivered to anyone
    ack_pending: int  # delivered and being handled
    waiting: int  # pull requests open: someone is asking for work
    delivered: int  # the consumer's delivered sequence


def look_of(info: ConsumerInfo) -> QueueLook | None:
    """The look at a node queue's consumer; None for any other consumer."""
    node = S.built_node(info.config.filter_subject or "")
    if node is None:
        return None
    return QueueLook(
        node=node,
        pending=info.num_pending or 0,
        ack_pending=info.num_ack_pending or 0,
        waiting=info.num_waiting or 0,
        delivered=info.delivered.consumer_seq if info.delivered else 0,
    )


def untaken(before: QueueLook, now: QueueLook) -> bool:
    """Work waited through both looks and nobody took any or asked for any."""
    return (
        now.pending > 0
        and now.ack_pending == 0
        and now.waiting == 0
        and now.delivered == before.delivered
    )


@dataclass
class Orphans:
    """Which other nodes' queues have held untaken work for ``after`` seconds (plain
    state, fed the looks and the clock)."""

    after: float
    _last: dict[str, tuple[QueueLook, float]] = field(default_factory=dict)
    _since: dict[str, float] = field(default_factory=dict)

    def look(self, looks: list[QueueLook], now: float, own: tuple[str, ...]) -> list[str]:
        orphaned = []
        seen = set()
        for q in looks:
            if q.node in own:
                continue
            seen.add(q.node)
            prev = self._last.get(q.node)
            self._last[q.node] = (q, now)
            if prev is None or not untaken(prev[0], q):
                self._since.pop(q.node, None)
                continue
            since = self._since.setdefault(q.node, prev[1])  # untaken since the earlier look
            if now - since >= self.after:
                orphaned.append(q.node)
        for gone in set(self._last) - seen:  # the consumer was deleted
            self._last.pop(gone)
            self._since.pop(gone, None)
        return orphaned

    def taken(self, node: str) -> None:
        """Drained: count afresh from the next look."""
        self._last.pop(node, None)
        self._since.pop(node, None)


class OrphanWatch:
    """The I/O shell: reads the consumers' counts, drains an orphaned queue here."""

    def __init__(self, bus, own: tuple[str, ...], after: float, drain) -> None:
        self.bus, self.own, self.drain = bus, own, drain
        self.orphans = Orphans(after)

    async def poll(self) -> None:
        infos = await self.bus.js.consumers_info(S.STREAM_SESSIONS)
        looks = [q for q in map(look_of, infos) if q is not None]
        for node in self.orphans.look(looks, time.monotonic(), self.own):
            log.warning(
                "node %s's evaluation queue has held work nobody took for %.0f s: "
                "evaluating it here, in fresh runtimes",
                node,
                self.orphans.after,
            )
            await self.drain(node)
            self.orphans.taken(node)
