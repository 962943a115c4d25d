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
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Literal

from celery_dlock.backends.base import LockBackend, Place
from celery_dlock.errors import BackendError, ConfigurationError, LockLostError
from celery_dlock.keys import validate_key
from celery_dlock.lock import DEFAULT, POLL, Lock, _Default, validate_wait
from celery_dlock.process import shared_backend
from celery_dlock.records import Holder, Lease, Outcome, Record, describe_exception

__all__ = ["Locks", "lock", "lost_lease"]


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
        #: The keys the last try took and let go (each recorded then) for a busy one.
        self._let_go_keys: frozenset[str] = frozenset()

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
        first: Lock | None = None
        try:
            while True:
                busy, place, first = self._try_all(place, first)
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

    def _try_all(
        self, place: Place | None, first: Lock | None = None
    ) -> tuple[Lock | None, Place | None, Lock | None]:
        """One try at every key in order (``first`` first), ``place`` given to its key's
        try: the busy Lock (with nothing held), or None; the place if it is still the
        caller's; and the key to try first next time."""
        taken: list[Lock] = []
        # Trying the key found busy first takes nothing while it stays busy: the keys
        # before it were taken and let go (a record, a fence) at every wake-up otherwise.
        order = self.locks if first is None else (first, *(k for k in self.locks if k is not first))
        try:
            for lock in order:
                mine = place if place is not None and place.key == lock.key else None
                if lock.attempt(mine) is None:
                    why = f"{lock.key} of the same set was busy: released, to try the set again"
                    self._let_go(taken, Outcome.SKIPPED, "locked", why)
                    self._let_go_keys = frozenset(one.key for one in taken)
                    # Out of order and then busy: sorted next time (see the module's doc).
                    return lock, place, None if first is not None and taken else lock
                if mine is not None:
                    place = None  # used up by the key it queued for
                taken.append(lock)
        except BaseException as exc:
            problem, details = describe_exception(exc)
            self._let_go(taken, Outcome.FAILED, problem, details)
            raise
        return None, place, None

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
        ended = self._release_each(outcome, problem, details, result)
        kept = [record for _, record in ended if record is not None]
        return kept if len(kept) == len(ended) else None

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
        # The error names the key whose lease was lost, not the set's first key.
        ended = self._release_each(Outcome.SUCCEEDED, None, None, None)
        lost = [lease for lease, record in ended if record is None]
        if lost:
            raise LockLostError(lost[0].key, lost[0].fence, "release")

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
    if options.pop("limit", 1) != 1:
        raise ConfigurationError(
            "several keys are taken all or none: a limit (slots) goes with one key only"
        )
    return Locks(backend, key, ttl, wait, **options)


def lost_lease(lock: Lock | Locks) -> Lease:
    """The lease ``lock`` lost: of a set, the first key's (in key order) that was lost, else
    its first lease; of a :class:`Lock`, its lease. For the error that names the loss.

    Raises:
        ConfigurationError: ``lock`` holds nothing.
    """
    held = lock.locks if isinstance(lock, Locks) else (lock,)
    found = [one.lease for one in held if one.lease is not None]
    lost = [one.lease for one in held if one.lost and one.lease is not None]
    if not found:
        raise ConfigurationError(f"lock {lock.key!r} is not held by this object")
    return (lost or found)[0]
