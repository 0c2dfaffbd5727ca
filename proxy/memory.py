"""Memory given back to the system after a large request.

glibc's allocator keeps what the process freed for its next allocations, in every
arena a thread used (the worker threads that plan long prompts, the tokenizer's own): a
10 MB prompt tokenized peaked at 1 GB and left 1.1 GB resident once all of it was
freed, and five of them left the proxy at 1.8 GB for good (issue 33). ``malloc_trim(0)``
returns the free pages of every arena to the system: 1.1 GB in ~70 ms, in a worker
thread (ctypes lets go of the GIL), once a request of ``TRIM_AFTER_BYTES`` or more is done.
A full collection comes first (~1 ms: start-up's objects are frozen), for what reference
cycles hold (an error's traceback holds its frames, and so the request). Requests
shorter than that never pay for either. Elsewhere than glibc: the collection only.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
from collections.abc import Callable

log = logging.getLogger("polar.proxy")

TRIM_AFTER_BYTES = 1024 * 1024  # a request body this large: its memory is given back
# after this long (its reply sent, its objects gone); requests done meanwhile share it
TRIM_DELAY_S = 0.25

Trim = Callable[[int], int]


def malloc_trim() -> Trim | None:
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def _no_trim(_pad: int) -> int:
    return 0


class MemoryGiveBack:
    """One trim at a time, after large requests: one done while a trim is under way
    gets another after it."""

    def __init__(self, trim: Trim | None = None, delay_s: float = TRIM_DELAY_S) -> None:
        self.trim = trim if trim is not None else malloc_trim()
        self.delay_s = delay_s
        self.trims = 0  # done so far (tests, logs)
        self._scheduled = self._running = self._again = False

    def after(self, request_bytes: int) -> None:
        """A request of ``request_bytes`` is done (called on the event loop)."""
        if request_bytes < TRIM_AFTER_BYTES:
            return
        if self._running:
            self._again = True
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_later(self.delay_s, self._start)

    def _start(self) -> None:
        self._scheduled, self._running = False, True
        # first what only the collector frees: a refused call's error holds its request
        # through its traceback's frames, which hold the error (a cycle per call)
        gc.collect()
        trim = self.trim if self.trim is not None else _no_trim
        done = asyncio.get_running_loop().run_in_executor(None, trim, 0)
        done.add_done_callback(self._done)

    def _done(self, done: asyncio.Future) -> None:
        self._running = False
        if done.cancelled():
            return
        if (exc := done.exception()) is not None:
            log.warning("malloc_trim failed: %r", exc)
        self.trims += 1
        if self._again:
            self._again = False
            self.after(TRIM_AFTER_BYTES)
