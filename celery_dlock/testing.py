"""Helpers for tests, ours and our users'.

:class:`FakeClock` is the clock to hand to the memory and file backends where a test needs
leases to expire without sleeping::

    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    lease = backend.try_acquire("job:x", Holder.current(), ttl=30)
    clock.advance(31)          # the lease is now expired
"""

from __future__ import annotations

import threading
import time

__all__ = ["FakeClock"]


class FakeClock:
    """A wall clock that moves only when told to.

    Args:
        start: the time it shows first, in seconds since the epoch (default: now).
    """

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else float(start)
        self._mutex = threading.Lock()

    def __call__(self) -> float:
        with self._mutex:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock by ``seconds`` (may be negative) and return the new time."""
        with self._mutex:
            self._now += seconds
            return self._now
