"""The object store's clock as this process knows it, and expiry judged by it.

A response whose ``Date`` is ``D`` was made when the server's clock read between ``D`` and
``D`` + 1 s, at a local time between sending and receiving; on GCS the ``updated`` time of
our own write is the server's time at a local instant between the two. Intersecting those
windows bounds the offset between the server's clock and a local one (monotonic by
default), which only measures time elapsed since a response: its own offset from true time
cancels out, so a client whose clock is an hour off judges expiry like any other.

Judging a lease (``verdict``): a taker needs proof that it expired (``expires_at`` at or
before the earliest server time possible, and before the deciding read's ``Date`` + 1 s,
which also bounds a local clock that stepped mid-request); a holder treats a lease that may
have expired as expired (``maybe_expired``). Leases are written to expire ``ttl`` after the
latest server time possible, so a lease lives at least ``ttl``.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Literal, NamedTuple

from celery_dlock.backends.base import MonotonicClock
from celery_dlock.backends.objectstore.store import Stamp
from celery_dlock.records import Lease

__all__ = [
    "CALIBRATED",
    "ServerClock",
    "ServerNow",
    "Verdict",
    "maybe_expired",
    "shared",
    "verdict",
]

#: ``reap`` narrows the server clock's window below this before judging close calls.
CALIBRATED = 0.1

#: The resolution of an HTTP ``Date`` header.
DATE_RESOLUTION = 1.0
#: How far a local clock may drift from the server's, per second elapsed (100 ppm).
_DRIFT = 1e-4
#: A response slower than this says too little about the server's clock to use.
_SLOW_RESPONSE = 10.0

Verdict = Literal["expired", "alive", "unsure"]


class ServerNow(NamedTuple):
    """The server's clock now lies in ``[low, high]``."""

    low: float
    high: float


class ServerClock:
    """An interval that surely holds the server's clock, narrowed by every response.

    The window widens by 100 ppm of the time elapsed since the last response, and starts
    over from the newest response if the local clock steps (the windows stop overlapping).
    """

    def __init__(self, clock: MonotonicClock) -> None:
        self.clock = clock
        self._mutex = threading.Lock()
        self._low = -math.inf  # bounds of server time - local time, as of local time _at
        self._high = math.inf
        self._at = 0.0

    def observe(self, stamp: Stamp, sent: float, received: float) -> None:
        """Learn from a response received at local time ``received`` to a request sent at
        ``sent``."""
        if stamp.exact is not None:
            low, high = stamp.exact - received, stamp.exact - sent
        elif stamp.date is not None:
            low, high = stamp.date - received, stamp.date + DATE_RESOLUTION - sent
        else:
            return
        if not 0 <= received - sent <= _SLOW_RESPONSE:
            return
        with self._mutex:
            old_low, old_high = self._bounds(received)
            new_low, new_high = max(low, old_low), min(high, old_high)
            if new_low > new_high:
                new_low, new_high = low, high
            self._low, self._high, self._at = new_low, new_high, received

    def _bounds(self, local: float) -> tuple[float, float]:
        slack = _DRIFT * abs(local - self._at)
        return self._low - slack, self._high + slack

    def now(self) -> ServerNow | None:
        """Bounds of the server's clock now, or None before any response told us."""
        local = self.clock()
        with self._mutex:
            low, high = self._bounds(local)
        if math.isinf(low) or math.isinf(high):
            return None
        return ServerNow(local + low, local + high)

    @property
    def uncertainty(self) -> float:
        """The width of the interval now, in seconds (inf before any response)."""
        now = self.now()
        return math.inf if now is None else now.high - now.low


_CLOCKS: dict[tuple[int, str, MonotonicClock], ServerClock] = {}
_CLOCKS_MUTEX = threading.Lock()


def shared(endpoint: str, clock: MonotonicClock) -> ServerClock:
    """The :class:`ServerClock` of ``endpoint`` measured with ``clock``, one per process."""
    index = (os.getpid(), endpoint, clock)
    found = _CLOCKS.get(index)
    if found is None:
        with _CLOCKS_MUTEX:
            found = _CLOCKS.setdefault(index, ServerClock(clock))
    return found


def verdict(lease: Lease, now: ServerNow, date: float | None) -> Verdict:
    """How a taker judges ``lease``, read in a response dated ``date``: ``expired`` needs
    proof by the server's clock."""
    if lease.expires_at is None:
        return "alive"
    fresh = date is None or lease.expires_at < date + DATE_RESOLUTION
    if lease.expires_at <= now.low and fresh:
        return "expired"
    if lease.expires_at > now.high:
        return "alive"
    return "unsure"


def maybe_expired(lease: Lease, now: ServerNow) -> bool:
    """How a holder judges its own lease: expired unless provably alive."""
    return lease.expires_at is not None and lease.expires_at <= now.high
