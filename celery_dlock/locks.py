"""Several keys at once, all or none: :class:`Locks` (a transfer between two accounts).

Keys are taken in sorted order with one try each; when one is busy, the keys taken so far
are released at once (recorded ``skipped``, naming the busy key) and the whole set is tried
again after waiting on the busy key. No holder ever waits while holding part of a set, so
two sets taken in opposite orders (1 then 2, 2 then 1) cannot deadlock.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Literal

from celery_dlock.backends.base import LockBackend, Place
from celery_dlock.errors import (
    BackendError,
    ConfigurationError,
)
from celery_dlock.keys import validate_key
from celery_dlock.lock import DEFAULT, POLL, Lock, _Default, end_block, validate_wait
from celery_dlock.process import shared_backend
from celery_dlock.records import Holder, Lease, Outcome, Record, describe_exception

__all__ = ["Locks", "lock"]


class Locks:
    """A lock on several keys of one backend, all of them or none.

    Args:
        backend: a :class:`LockBackend`, or a URL.
        keys: the full keys (duplicates count once).
        ttl, wait, holder, renew, on_lost, metadata: as for :class:`Lock`, for every key.

    Raises:
        LockKeyError: a key is empty, too long or has control characters.
        ConfigurationError: no key, or a bad ``ttl`` or ``wait``.
    """

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
        self.backend = shared_backend(backend) if isinstance(backend, str) else backend
        self.keys = tuple(sorted({validate_key(key) for key in keys}))
        if not self.keys:
            raise ConfigurationError("Locks needs at least one key")
        #: The keys joined, for messages and logs.
        self.key = "+".join(self.keys)
        self.wait = validate_wait(wait)
        self.holder = holder
        self.locks = tuple(
            Lock(
                self.backend,
                key,
                ttl,
                0,
                holder=holder,
                renew=renew,
                on_lost=on_lost,
                metadata=metadata,
            )
            for key in self.keys
        )

    @property
    def leases(self) -> list[Lease]:
        """The leases held now, one per key in key order (empty when not held)."""
        leases = [lock.lease for lock in self.locks]
        return [lease for lease in leases if lease is not None]

    @property
    def lease(self) -> Lease | None:
        """The first key's lease, or None."""
        return self.locks[0].lease

    @property
    def lost(self) -> bool:
        """True once the lease of any key was lost."""
        return any(lock.lost for lock in self.locks)

    def acquire(self, wait: float | Literal[_Default.DEFAULT] | None = DEFAULT) -> list[Lease]:
        """Take every key or none; wait up to ``wait`` seconds (default: the Locks' own).

        Raises:
            LockNotAcquiredError: a key is held and ``wait`` is 0.
            LockTimeoutError: a key was still held after ``wait`` seconds.
            BackendError: the store failed (keys taken before the failure are released).
        """
        if self.lease is not None:
            raise ConfigurationError(f"locks {self.key!r} are already held by this object")
        limit = self.wait if wait is DEFAULT else validate_wait(wait)
        deadline = None if limit is None else time.monotonic() + limit
        # The place in the store's queue of the busy key's waiters, kept until that key is
        # tried again: left before the try, a waiter that had just released the key would
        # let the next waiter have it, and that one the next (Postgres: a second's stall).
        place: Place | None = None
        try:
            while True:
                busy, place = self._try_all(place)
                if busy is None:
                    return self.leases
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise busy.busy_error(limit)
                pause = POLL * random.uniform(0.5, 1.0)
                pause = pause if remaining is None else min(pause, remaining)
                place = self.backend.wait(busy.key, pause, place)  # another key's is left
        finally:
            if place is not None:
                place.leave()

    def _try_all(self, place: Place | None) -> tuple[Lock | None, Place | None]:
        """One try at every key in order, ``place`` given to its key's try: the busy Lock
        (with nothing held), or None, and the place if it is still the caller's."""
        taken: list[Lock] = []
        try:
            for lock in self.locks:
                mine = place if place is not None and place.key == lock.key else None
                if lock.attempt(mine) is None:
                    why = f"{lock.key} of the same set was busy: released, to try the set again"
                    self._let_go(taken, Outcome.SKIPPED, "locked", why)
                    return lock, place
                if mine is not None:
                    place = None  # used up by the key it queued for
                taken.append(lock)
        except BaseException as exc:
            problem, details = describe_exception(exc)
            self._let_go(taken, Outcome.FAILED, problem, details)
            raise
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
        records: list[Record | None] = []
        failure: BackendError | None = None
        for lock in self.locks:
            if lock.lease is None:
                continue
            try:
                records.append(lock.release(outcome, problem, details, result))
            except BackendError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        kept = [record for record in records if record is not None]
        return kept if len(kept) == len(records) else None

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
        """Record a skipped attempt on every key; the first key's record."""
        records = [lock.record_skip(problem, details, holder) for lock in self.locks]
        return records[0]

    def __enter__(self) -> list[Lease]:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        first = self.lease
        if first is None:
            raise ConfigurationError(f"locks {self.key!r} are not held by this object")
        end_block(self.release, first, exc)

    def __repr__(self) -> str:
        state = "held" if self.lease is not None else "free"
        return f"<Locks {self.key!r} {state} on {self.backend!r}>"


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
    return Locks(backend, key, ttl, wait, **options)
