"""In-process lock store, for tests and eager mode.

URL
    ``memory://`` or ``memory://NAME``: every URL with the same NAME gives the same store in
    this process; ``MemoryBackend()`` gives a fresh, private one.

Options
    none. ``MemoryBackend(clock=...)`` takes the clock that judges expiry (tests).

Guarantees
    crash: the store dies with the process, and so do its locks and history.
    clock skew: one process, one clock.
    partition: not shared with other processes at all; a forked child gets a copy.

Install
    nothing: no driver.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

from celery_dlock.backends import mask_url
from celery_dlock.backends.base import (
    Capabilities,
    LockBackend,
    Place,
    WallClock,
    hand_over_ttl,
    handed_expiry,
    remembered,
    success_task,
    validate_ttl,
)
from celery_dlock.backends.common import (
    expired,
    expiry,
    retried,
    taken_over,
    url_options,
    wall_clock,
)
from celery_dlock.errors import ConfigurationError
from celery_dlock.records import Holder, Lease, Outcome, Record, new_token

__all__ = ["MemoryBackend"]


class MemoryBackend(LockBackend):
    """A thread-safe, in-process lock store with the full contract."""

    name = "memory"
    capabilities: ClassVar[Capabilities] = Capabilities(
        liveness="lease",
        push_wait=True,
        cross_process=False,
        cross_host=False,
        durable_history=False,
        server_clock=False,
    )
    _named: ClassVar[dict[str, MemoryBackend]] = {}
    _named_mutex: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, clock: WallClock | None = None) -> None:
        self.url = "memory://"
        self._clock: WallClock = clock or wall_clock
        self._changed = threading.Condition()
        self._leases: dict[str, Lease] = {}
        self._fences: dict[str, int] = {}
        self._history: list[Record] = []
        self._successes: dict[tuple[str, str], Record] = {}

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBackend:
        clock = options.pop("clock", None)
        parts = urlsplit(url)
        url_options("memory", parts.query, {}, options)
        if parts.path not in ("", "/") or parts.fragment:
            # It was ignored: memory://tests/a and memory://tests/b were one store.
            raise ConfigurationError(
                f"a memory store URL is memory:// or memory://NAME, with no path or '#': "
                f"{mask_url(url)!r} would be the store memory://{parts.netloc}"
            )
        name = parts.netloc
        with cls._named_mutex:
            backend = cls._named.get(name)
            if backend is None:
                backend = cls._named[name] = cls(clock=clock)
                backend.url = url
            return backend

    def try_acquire(
        self,
        key: str,
        holder: Holder,
        ttl: float | None,
        replace: str | None = None,
        place: Place | None = None,
    ) -> Lease | None:
        ttl = validate_ttl(ttl)
        with self._changed:
            now = self._clock()
            current = self._leases.get(key)
            if current is not None:
                if replace is not None and current.token == replace:
                    self._append(retried(current, holder, now))
                elif expired(current, now):
                    self._append(Record(current, now, Outcome.EXPIRED, "expired"))
                    taken_over(Outcome.EXPIRED)
                else:
                    return None
            fence = self._fences.get(key, 0) + 1
            self._fences[key] = fence
            lease = Lease(key, new_token(), fence, holder, now, expiry(now, ttl))
            self._leases[key] = lease
            return lease

    def release(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> Record | None:
        with self._changed:
            current = self._current(lease)
            if current is None:
                return None
            record = Record(current, self._clock(), Outcome(outcome), problem, details, result)
            self._append(record)
            del self._leases[lease.key]
            self._changed.notify_all()
            return record

    def add_record(self, record: Record) -> None:
        with self._changed:
            self._append(record)

    def renew(self, lease: Lease, ttl: float | None) -> Lease | None:
        return self._prolong(lease, validate_ttl(ttl), longer=False)

    def hand_over(self, lease: Lease, ttl: float, if_unchanged: bool = False) -> Lease | None:
        """:meth:`renew` that never shortens: leases here live by their ttl alone."""
        return self._prolong(lease, hand_over_ttl(ttl), True, if_unchanged)

    def _prolong(
        self, lease: Lease, ttl: float | None, longer: bool, if_unchanged: bool = False
    ) -> Lease | None:
        with self._changed:
            current = self._current(lease)
            if current is None:
                return None
            expires_at = expiry(self._clock(), ttl)
            if longer and expires_at is not None:
                expires_at = handed_expiry(
                    current.expires_at, expires_at, lease.expires_at, if_unchanged
                )
            renewed = Lease(
                current.key,
                current.token,
                current.fence,
                current.holder,
                current.acquired_at,
                expires_at,
            )
            self._leases[lease.key] = renewed
            return renewed

    def _current(self, lease: Lease) -> Lease | None:
        """The stored lease if it is ``lease`` and still alive; an expired one is cleared
        and recorded as ``expired``."""
        current = self._leases.get(lease.key)
        if current is None or current.token != lease.token:
            return None
        now = self._clock()
        if expired(current, now):
            self._append(Record(current, now, Outcome.EXPIRED, "expired"))
            del self._leases[lease.key]
            self._changed.notify_all()
            return None
        return current

    def get(self, key: str) -> Lease | None:
        with self._changed:
            return self._leases.get(key)

    def leases(self, prefix: str = "") -> list[Lease]:
        with self._changed:
            return sorted(
                (lease for key, lease in self._leases.items() if key.startswith(prefix)),
                key=lambda lease: lease.key,
            )

    def history(
        self,
        key: str | None = None,
        outcome: Outcome | None = None,
        since: float | None = None,
        limit: int | None = 100,
    ) -> list[Record]:
        with self._changed:
            records = list(self._history)
        found: list[Record] = []
        for record in reversed(records):
            if since is not None and record.released_at < since:
                break
            if key is not None and record.key != key:
                continue
            if outcome is not None and record.outcome != outcome:
                continue
            found.append(record)
            if limit is not None and len(found) >= limit:
                break
        return found

    def last_success(self, key: str, task_name: str) -> Record | None:
        with self._changed:
            return self._successes.get((key, task_name))

    def remember(self, record: Record) -> bool:
        task_name = success_task(record)
        with self._changed:
            return self._keep(record, task_name)

    def forget_success(self, key: str, task_name: str, token: str) -> bool:
        with self._changed:
            kept = self._successes.get((key, task_name))
            if kept is None or kept.lease.token != token:
                return False
            del self._successes[key, task_name]
            return True

    def reap(self, limit: int = 100) -> list[Record]:
        reaped: list[Record] = []
        with self._changed:
            now = self._clock()
            for key, lease in list(self._leases.items()):
                if len(reaped) >= limit:
                    break
                if expired(lease, now):
                    record = Record(lease, now, Outcome.EXPIRED, "expired")
                    self._append(record)
                    del self._leases[key]
                    reaped.append(record)
            if reaped:
                self._changed.notify_all()
        return reaped

    def prune_history(self, before: float) -> int:
        with self._changed:
            times = [record.released_at for record in self._history]
            cut = bisect.bisect_left(times, before)
            del self._history[:cut]
            return cut

    def wait(self, key: str, timeout: float, place: Place | None = None) -> Place | None:
        self.wait_any((key,), timeout)
        return None  # no queue: nothing to keep

    def wait_any(self, keys: Sequence[str], timeout: float) -> None:
        """Sleep until a change of any lease (a release, an expiry seen by a reap), at
        most ``timeout`` seconds; at once if one of ``keys`` is free."""
        with self._changed:
            now = self._clock()
            for key in keys:
                lease = self._leases.get(key)
                if lease is None or expired(lease, now):
                    return
            self._changed.wait(timeout)

    def _append(self, record: Record) -> None:
        """Append ``record`` keeping history ordered by release time (the clock may be
        injected and stepped back by tests); a success is kept for ``once`` unless another
        lease's is kept already (the first wins)."""
        if self._history and record.released_at < self._history[-1].released_at:
            times = [r.released_at for r in self._history]
            self._history.insert(bisect.bisect_right(times, record.released_at), record)
        else:
            self._history.append(record)
        task_name = remembered(record.outcome, record.result, record.lease.holder.task_name)
        if task_name is not None:
            self._keep(record, task_name)

    def _keep(self, record: Record, task_name: str) -> bool:
        """Keep ``record`` as the success of its key and ``task_name`` unless another lease's
        is kept (the first wins; the lease's own is updated); under ``_changed``."""
        kept = self._successes.get((record.key, task_name))
        if kept is not None and kept.lease.token != record.lease.token:
            return False
        self._successes[record.key, task_name] = record
        return True
