"""Several keys at once, all or none: :class:`Locks` (a transfer between two accounts).

Keys are taken in sorted order with one try each; when one is busy, the keys taken so far
are released at once (recorded ``skipped``, naming the busy key) and the whole set is tried
again after waiting on the busy key, that key first: while it stays busy, nothing is taken
(and recorded) again. No holder ever waits while holding part of a set, so two sets taken
in opposite orders (1 then 2, 2 then 1) cannot deadlock; and a try that took a key out of
order and then met a busy one goes back to the sorted order, so two sets that each took the
other's key first do not meet that way again and again.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Literal

from celery_dlock.backends.base import LockBackend, Place
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.keyset import KeySet, lost_lease
from celery_dlock.lock import DEFAULT, POLL, Lock, _Default
from celery_dlock.records import Holder, Lease, Outcome, Record, describe_exception

__all__ = ["Locks", "lock", "lost_lease"]


class Locks(KeySet[Lock]):
    """A lock on several keys of one backend, all of them or none.

    Args:
        backend: a :class:`LockBackend`, or a URL.
        keys: the full keys (duplicates count once).
        ttl, wait, holder, renew, on_lost, metadata: as for :class:`Lock`, for every key.

    Raises:
        LockKeyError: a key is empty, too long or has control characters.
        ConfigurationError: no key, or a bad ``ttl`` or ``wait``.
    """

    _kind = "Locks"
    _per_key = Lock

    def __init__(
        self,
        backend: LockBackend | str,
        keys: Iterable[str],
        ttl: float | None = None,
        wait: float | None = 0,
        *,
        holder: Holder | None = None,
        renew: bool | None = None,
        on_lost: Callable[[Lease], None] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            backend, keys, ttl, wait, holder=holder, renew=renew, on_lost=on_lost, metadata=metadata
        )
        self.holder = holder

    def acquire(self, wait: float | Literal[_Default.DEFAULT] | None = DEFAULT) -> list[Lease]:
        """Take every key or none; wait up to ``wait`` seconds (default: the Locks' own).

        Raises:
            LockNotAcquiredError: a key is held and ``wait`` is 0.
            LockTimeoutError: a key was still held after ``wait`` seconds.
            BackendError: the store failed (keys taken before the failure are released).
        """
        if self.lease is not None:
            raise ConfigurationError(f"locks {self.key!r} are already held by this object")
        limit, deadline = self._begin(wait)
        # The place in the store's queue of the busy key's waiters, kept until that key is
        # tried again: left before the try, a waiter that had just released the key would
        # let the next waiter have it, and that one the next (Postgres: a second's stall).
        place: Place | None = None
        try:
            while True:
                busy, place = self._try_all(place)
                if busy is None:
                    return self.leases
                pause = self._pause(deadline, POLL * random.uniform(0.5, 1.0))
                if pause is None:
                    raise busy.busy_error(limit)
                place = self.backend.wait(busy.key, pause, place)  # another key's is left
        except BaseException as exc:  # a key held before it came (a soft limit): let go
            held = [lock for lock in self.locks if lock.lease is not None]
            self._let_go(held, Outcome.FAILED, *describe_exception(exc))
            raise
        finally:
            if place is not None:
                place.leave()

    def _try_all(self, place: Place | None) -> tuple[Lock | None, Place | None]:
        """One try at every key, in the order of the next try, ``place`` given to its key's
        try: the busy Lock (with nothing held), or None; and the place if it is still the
        caller's."""
        taken: list[Lock] = []  # an exception meanwhile: what is held is let go (acquire)
        for lock in self._order():
            mine = place if place is not None and place.key == lock.key else None
            if lock.attempt(mine) is None:
                self._let_go(taken, *self._busy(lock, taken))
                return lock, place
            if mine is not None:
                place = None  # used up by the key it queued for
            taken.append(lock)
        return None, place

    @staticmethod
    def _let_go(taken: list[Lock], outcome: Outcome, problem: str, details: str | None) -> None:
        for lock in reversed(taken):
            # On a store error its lease ends by the store's liveness rule (the janitor).
            with contextlib.suppress(BackendError):
                lock.release(outcome, problem, details)

    def release(
        self,
        outcome: Outcome = Outcome.SUCCEEDED,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> list[Record] | None:
        """Release every key, each recorded as ``outcome``.

        Returns:
            the records in key order, or None if a lease had been lost (recorded ``lost``).

        Raises:
            BackendError: the store failed for a key (the others are released all the same).
        """
        return self._records(self._release_each(outcome, problem, details, result))

    def _release_each(
        self, outcome: Outcome, problem: str | None, details: str | None, result: Any
    ) -> list[tuple[Lease, Record | None]]:
        """Release every lease held, in key order: each lease with its record (None: lost)."""
        ended: list[tuple[Lease, Record | None]] = []
        failure: BackendError | None = None
        for lock in self.locks:
            lease = lock.lease
            if lease is None:
                continue
            try:
                ended.append((lease, lock.release(outcome, problem, details, result)))
            except BackendError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return ended

    def detach(self) -> Lease:
        """Stop renewing and forget every lease without releasing them; the first one."""
        leases = [lock.detach() for lock in self.locks if lock.lease is not None]
        if not leases:
            raise ConfigurationError(f"locks {self.key!r} are not held by this object")
        return leases[0]

    def current(self) -> Lease | None:
        """A lease on one of the keys now (the first found), or None."""
        return next(iter(self.holders()), None)

    def holders(self) -> list[Lease]:
        """Every lease on the keys now, in key order."""
        found = [lock.current() for lock in self.locks]
        return [lease for lease in found if lease is not None]

    def record_skip(self, problem: str, details: str, holder: Holder | None = None) -> Record:
        """Record a skipped attempt on every key but those its last try took and let go
        (recorded ``skipped`` then: one record per key for the attempt); the first one."""
        skipped = [lock for lock in self.locks if lock.key not in self._let_go_keys]
        records = [lock.record_skip(problem, details, holder) for lock in skipped]
        return records[0]

    def __enter__(self) -> list[Lease]:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.lease is None:
            raise ConfigurationError(f"locks {self.key!r} are not held by this object")
        if exc is not None:
            self.release(Outcome.FAILED, *describe_exception(exc))
            return
        self._raise_if_lost(self._release_each(Outcome.SUCCEEDED, None, None, None))


def lock(
    key: str | Iterable[str],
    backend: LockBackend | str,
    ttl: float | None = None,
    wait: float | None = 0,
    **options: Any,
) -> Lock | Locks:
    """A :class:`Lock` to use in a ``with`` block, which gives the lease::

        with celery_dlock.lock("job:report:daily", backend=url, ttl=60, wait=5) as lease:
            write_report(fence=lease.fence)

    The block's end is recorded as ``succeeded``, or ``failed`` with the exception's type,
    message and traceback. If the lease was lost meanwhile, leaving the block raises
    :class:`LockLostError` (unless it already raised).

    Several keys (``lock(["account:1", "account:2"], ...)``) give a :class:`Locks`: all of
    them or none, and the block gets their leases; ``limit=N`` gives a semaphore of N slots.
    """
    if isinstance(key, str):
        return Lock(backend, key, ttl, wait, **options)
    if options.pop("limit", 1) != 1:
        raise ConfigurationError(
            "several keys are taken all or none: a limit (slots) goes with one key only"
        )
    return Locks(backend, key, ttl, wait, **options)
