"""asyncio, several keys at once, all or none: :class:`AsyncLocks`, and :func:`alock`::

    async with celery_dlock.alock(["account:1", "account:2"], backend=url, wait=10) as leases:
        await transfer(fences=[lease.fence for lease in leases])

The rules of :class:`~celery_dlock.locks.Locks`, from a coroutine: keys are taken in sorted
order with one try each (an :class:`AsyncLock` per key: its store calls, renewal and
records); when one is busy, the keys taken so far are released (recorded ``skipped``) and
the set waits on the busy key, in steps of at most ``SLICE``, and tries that key first when
woken; a try that took a key out of order and then met a busy one goes back to the sorted
order. No holder waits while it holds part of a set, so sets taken in opposite orders
cannot deadlock.

A cancel never leaves a key held: while the set is tried, what the try holds is released
(``revoked``) before the cancel is raised; while it waits it holds nothing; releases of the
set, once started, end (every key) before a cancel, or several, is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Literal, overload

from celery_dlock.aio import SLICE, AsyncLock
from celery_dlock.backends.base import LockBackend, Place
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.keyset import KeySet, lost_lease
from celery_dlock.lock import DEFAULT, _Default
from celery_dlock.records import Holder, Lease, Outcome, Record, describe_exception

__all__ = ["AsyncLocks", "alock", "lost_lease"]

CANCELLED = ("CancelledError", "the acquiring coroutine was cancelled")


class AsyncLocks(KeySet[AsyncLock]):
    """A lock on several keys of one backend, all of them or none, for coroutines: the
    arguments, leases, records and errors of :class:`~celery_dlock.locks.Locks`.

    Raises:
        LockKeyError: a key is empty, too long or has control characters.
        ConfigurationError: no key, or a bad ``ttl`` or ``wait``.
    """

    _kind = "AsyncLocks"
    _per_key = AsyncLock

    def __init__(
        self,
        backend: LockBackend | str,
        keys: Iterable[str],
        ttl: float | None = None,
        wait: float | None = 0,
        *,
        holder: Holder | None = None,
        renew: bool | None = None,
        on_lost: Callable[[Lease], Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            backend, keys, ttl, wait, holder=holder, renew=renew, on_lost=on_lost, metadata=metadata
        )
        self._acquiring = False  # an acquire is under way, in some task

    async def acquire(
        self, wait: float | Literal[_Default.DEFAULT] | None = DEFAULT
    ) -> list[Lease]:
        """Take every key or none; wait up to ``wait`` seconds (default: the set's own).

        Raises:
            LockNotAcquiredError: a key is held and ``wait`` is 0.
            LockTimeoutError: a key was still held after ``wait`` seconds.
            BackendError: the store failed (keys taken before the failure are released).
            ConfigurationError: this AsyncLocks is held, or another task is acquiring it.
        """
        self._claim()
        # The place in the busy key's queue of waiters is kept until that key is tried
        # again, as Locks does (left before the try, a release would wake the next waiter).
        place: Place | None = None
        try:
            limit, deadline = self._begin(wait)  # a bad wait leaves the set free to acquire
            while True:
                busy, place = await self._try_all(place)
                if busy is None:
                    return self.leases
                pause = self._pause(deadline, SLICE)
                if pause is None:
                    raise busy._lock.busy_error(limit, await busy.current())
                place = await busy.wait_once(pause, place)  # another key's is left
        except BaseException:  # a timeout, an error, a cancel: left before it is raised
            place, left = None, place
            await self.locks[0].leave_now(left)
            raise
        finally:
            self._acquiring = False
            self.locks[0].leave(place)

    def _claim(self) -> None:
        """Mark the set as being acquired, in one step of the loop (see AsyncLock)."""
        if self.lease is not None:
            raise ConfigurationError(f"locks {self.key!r} are already held by this AsyncLocks")
        if self._acquiring:
            raise ConfigurationError(
                f"locks {self.key!r}: another task is acquiring this AsyncLocks (one at a time)"
            )
        self._acquiring = True

    async def _try_all(self, place: Place | None) -> tuple[AsyncLock | None, Place | None]:
        """One try at every key, as ``Locks._try_all``: the busy key's lock (nothing held
        then), or None; and the place if it is still the caller's. Cancelled, it lets go
        what it took before raising."""
        taken: list[AsyncLock] = []
        try:
            for lock in self._order():
                mine = place if place is not None and place.key == lock.key else None
                if await lock.attempt(mine) is None:
                    await self._let_go(taken, *self._busy(lock, taken))
                    return lock, place
                if mine is not None:
                    place = None  # used up by the key it queued for
                taken.append(lock)
        except asyncio.CancelledError:
            await self._let_go(taken, Outcome.REVOKED, *CANCELLED)
            raise
        except BaseException as exc:
            await self._let_go(taken, Outcome.FAILED, *describe_exception(exc))
            raise
        return None, place

    async def _let_go(
        self, taken: list[AsyncLock], outcome: Outcome, problem: str, details: str | None
    ) -> None:
        """Release ``taken``, every one even if the caller is cancelled meanwhile (the cancel
        is raised after); on a store error a lease ends by the store's liveness rule."""
        if taken:
            with contextlib.suppress(BackendError):
                await self.locks[0]._through(self._release_each(outcome, problem, details, None))

    async def release(
        self,
        outcome: Outcome = Outcome.SUCCEEDED,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> list[Record] | None:
        """Release every key, each recorded as ``outcome``: finished, every key, even if
        this coroutine is cancelled meanwhile (the cancel is raised after).

        Returns:
            the records in key order, or None if a lease had been lost (recorded ``lost``).

        Raises:
            BackendError: the store failed for a key (the others are released all the same).
        """
        return self._records(await self._released(outcome, problem, details, result))

    async def _released(
        self, outcome: Outcome, problem: str | None, details: str | None, result: Any
    ) -> list[tuple[Lease, Record | None]]:
        if self.lease is None:
            raise ConfigurationError(f"locks {self.key!r} are not held by this AsyncLocks")
        return await self.locks[0]._through(self._release_each(outcome, problem, details, result))

    async def _release_each(
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
                ended.append((lease, await lock._release(outcome, problem, details, result)))
            except BackendError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return ended

    async def holders(self) -> list[Lease]:
        """Every lease on the keys now, in key order."""
        found = [await lock.current() for lock in self.locks]
        return [lease for lease in found if lease is not None]

    async def __aenter__(self) -> list[Lease]:
        return await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(exc, asyncio.CancelledError):
            why = "the coroutine holding the lock was cancelled"
            await self._released(Outcome.REVOKED, "CancelledError", why, None)
            return
        if exc is not None:
            await self._released(Outcome.FAILED, *describe_exception(exc), None)
            return
        self._raise_if_lost(await self._released(Outcome.SUCCEEDED, None, None, None))


@overload
def alock(
    key: str,
    backend: LockBackend | str,
    ttl: float | None = ...,
    wait: float | None = ...,
    **options: Any,
) -> AsyncLock: ...
@overload
def alock(
    key: Iterable[str],
    backend: LockBackend | str,
    ttl: float | None = ...,
    wait: float | None = ...,
    **options: Any,
) -> AsyncLocks: ...
def alock(
    key: str | Iterable[str],
    backend: LockBackend | str,
    ttl: float | None = None,
    wait: float | None = 0,
    **options: Any,
) -> AsyncLock | AsyncLocks:
    """An :class:`AsyncLock` to use in an ``async with`` block, which gives the lease::

        async with celery_dlock.alock("job:123", backend=url, ttl=30, wait=5) as lease:
            await work(fence=lease.fence)

    The block's end is recorded as ``succeeded``; ``failed`` with the exception's type,
    message and traceback; ``revoked`` when the coroutine was cancelled. If the lease was
    lost meanwhile, leaving the block raises :class:`LockLostError` (unless it raised).

    Several keys (``alock(["account:1", "account:2"], ...)``) give an :class:`AsyncLocks`:
    all of them or none, and the block gets their leases; a ``limit`` goes with one key only.
    """
    if isinstance(key, str):
        return AsyncLock(backend, key, ttl, wait, **options)
    if options.pop("limit", 1) != 1:
        raise ConfigurationError(
            "several keys are taken all or none: a limit (slots) goes with one key only"
        )
    return AsyncLocks(backend, key, ttl, wait, **options)
