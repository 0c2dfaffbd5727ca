"""Session -> worker placement by rendezvous (highest-random-weight) hashing (pure).

Every (session, worker) pair gets a pseudo-random score; a session goes to the healthy
worker with the highest score. Removing a worker moves only the sessions it held (each
to its own next-best worker); adding it back returns exactly those. No table to keep,
and every proxy replica computes the same answer, so a session's KV prefix cache stays
on one engine however many proxies front it.
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b


def score(session_id: str, worker: str) -> int:
    digest = blake2b(f"{worker}\x00{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(session_id: str, workers: Iterable[str]) -> list[str]:
    """Workers in the session's preference order (best first)."""
    return sorted(workers, key=lambda w: score(session_id, w), reverse=True)


def place(session_id: str, workers: Iterable[str]) -> str | None:
    best, best_score = None, -1
    for worker in workers:
        s = score(session_id, worker)
        if s > best_score:
            best, best_score = worker, s
    return best
