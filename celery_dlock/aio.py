"""asyncio: :class:`AsyncLock`, the contract of :class:`Lock` from a coroutine (``alock``
and several keys, :class:`~celery_dlock.alocks.AsyncLocks`: ``alocks.py``)::

    async with celery_dlock.alock("job:123", backend=url, ttl=30, wait=5) as lease:
        await work(fence=lease.fence)

Where the store has an asyncio client of its own (``LockBackend.async_store``: Redis on
redis-py's asyncio connections, Postgres on psycopg's ``AsyncConnection``), a lock's calls
run on the event loop through it. Elsewhere (file, object stores, memory) every store call
runs in a bounded pool of threads (``OFFLOAD_THREADS`` for tries, releases and renewals,
``WAIT_THREADS`` for waits: ``aiotasks.py``), never on the event loop. Either way waiting
goes in short steps: one try at the key, then a wait of at most ``SLICE`` seconds on the
store's own push (Postgres's queue of waiters, Redis's wake-up list, inotify), then the
next try. A cancelled waiter therefore lets go within one step, and nothing it was granted
meanwhile stays held: a try under way when its caller is cancelled runs to its end, and a
lease it got is released (``revoked``) before the cancel is raised; a place in a store's
queue is left. A release, once started, likewise ends before a cancel (or several) is
raised; a cancelled read or renewal lets its call to the store end in the background (on
Postgres that call runs on the loop's shared lock session). Renewal is an asyncio task. The
lease and its record are those of a :class:`Lock`, on the same stores; a success that
``once`` keeps is released as :class:`Lock` does, with its retries, in the pool. One
AsyncLock is for one task at a time: another task's acquire meanwhile is refused. Renewal
holds the AsyncLock weakly: one dropped while held lets go of its lease, as a ``Lock``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Literal, TypeVar

from celery_dlock import metrics, releasing
from celery_dlock.aiotasks import (
    OFFLOAD_THREADS,
    WAIT_THREADS,
    cancellable,
    keep,
    offload,
    pool,
    shielded,
    to_its_end,
)
from celery_dlock.backends.base import AsyncStore, LockBackend, Place, remembered, validate_ttl
from celery_dlock.errors import BackendError, ConfigurationError, DLockError, LockLostError
from celery_dlock.events import fields
from celery_dlock.lock import DEFAULT, Lock, _Default, validate_wait
from celery_dlock.records import Holder, Lease, Outcome, Record, describe_exception
from celery_dlock.renewal import report_lost

__all__ = ["OFFLOAD_THREADS", "SLICE", "WAIT_THREADS", "AsyncLock"]

logger = logging.getLogger("celery_dlock.aio")

#: Longest wait on the store in one step: how long a cancelled waiter's thread may linger.
SLICE = 0.5

T = TypeVar("T")


class AsyncLock:
    """A lock on one key of one backend, for coroutines: the arguments, leases, records
    and errors of :class:`Lock`; ``on_lost`` may be a coroutine function (it then runs as
    a task on the lock's loop)."""

    def __init__(
        self,
        backend: LockBackend | str,
        key: str,
        ttl: float | None = None,
        wait: float | None = 0,
        *,
        holder: Holder | None = None,
        renew: bool | None = None,
        on_lost: Callable[[Lease], Any] | None = None,
        limit: int = 1,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self._lock = Lock(
            backend, key, ttl, wait,
            holder=holder, renew=False, on_lost=self._lost_elsewhere, limit=limit,
            metadata=metadata,
        )  # fmt: skip
        #: The store's own asyncio client, or None: its calls then run in the pool.
        self._store = self._lock.backend.async_store()
        self.on_lost = on_lost
        self.renew_in_background = self._lock.ttl is not None if renew is None else renew
        self._renewal: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lost = False
        self._acquiring = False  # an acquire or attempt is under way, in some task

    @property
    def backend(self) -> LockBackend:
        return self._lock.backend

    @property
    def key(self) -> str:
        return self._lock.key

    @property
    def ttl(self) -> float | None:
        return self._lock.ttl

    @property
    def lease(self) -> Lease | None:
        """The lease held now (the newest after renewals), or None."""
        return self._lock.lease

    @property
    def lost(self) -> bool:
        """True once renewal found the lease gone, or its holder's session ended."""
        return self._lost or self._lock.lost

    async def acquire(self, wait: float | Literal[_Default.DEFAULT] | None = DEFAULT) -> Lease:
        """Take the key, waiting up to ``wait`` seconds (default: the lock's ``wait``).

        Raises:
            LockNotAcquiredError: the key is held and ``wait`` is 0.
            LockTimeoutError: the key was still held after ``wait`` seconds.
            BackendError: the store failed.
            ConfigurationError: this AsyncLock is held, or another task is acquiring it.
        """
        limit = self._lock.wait if wait is DEFAULT else validate_wait(wait)
        self._claim()  # after the check: a bad wait leaves the lock free to acquire
        deadline = None if limit is None else time.monotonic() + limit
        self._loop = asyncio.get_running_loop()
        place: Place | None = None  # in the store's queue of the key's waiters, if it has one
        try:
            while True:
                lease = await self._attempt(place)
                if lease is not None:
                    place = None  # used up
                    self._hold()
                    return lease
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._lock.busy_error(limit, await self.current())
                pause = SLICE if remaining is None else min(SLICE, remaining)
                place = await self.wait_once(pause, place)
        except BaseException:  # a timeout, an error, a cancel: left before it is raised
            place, left = None, place
            await self.leave_now(left)
            raise
        finally:
            self._acquiring = False
            self.leave(place)

    async def wait_once(self, timeout: float, place: Place | None = None) -> Place | None:
        """One wait on the store, of at most ``timeout`` seconds, for the key (``place``, the
        caller's in its queue, kept: the place returned), or for any of its slots."""
        if self._store is None:  # Lock.wait_once, in the pool
            return await offload(self._lock.wait_once, timeout, place, orphan=_leave, kind="waits")
        if self._lock.limit == 1:
            return await cancellable(self._store.wait(self.key, timeout, place))
        # Woken by the release of any slot.
        return await cancellable(self._store.wait_any(self._lock.slots, timeout))

    def leave(self, place: Place | None) -> None:
        """Leave ``place``, from :meth:`wait_once`, without waiting."""
        if place is not None and self._store is not None:
            place.leave()  # the asyncio client's: left by a task of the loop
        elif place is not None:
            pool().submit(place.leave)

    async def leave_now(self, place: Place | None) -> None:
        """Leave ``place`` before returning, as an acquire that gives up does: the loop may
        end right after it (``asyncio.run`` returning), before a task of it would run."""
        if place is not None and self._store is not None:
            await place.leave_now()
        else:
            self.leave(place)  # in the pool, whose thread runs whatever the loop does

    def _claim(self) -> None:
        """Mark this AsyncLock as being acquired, checked and marked in one step of the
        loop: another task's acquire meanwhile is refused before it tries the store."""
        if self._lock.lease is not None:
            raise ConfigurationError(f"lock {self.key!r} is already held by this AsyncLock")
        if self._acquiring:
            raise ConfigurationError(
                f"lock {self.key!r}: another task is acquiring this AsyncLock (one task at a time)"
            )
        self._acquiring = True
        self._lost = False  # of the lease before, if any: not of the one to come

    async def _attempt(self, place: Place | None) -> Lease | None:
        """One try at the key (each slot, with a ``limit``), through the store's asyncio
        client or the pool. A try under way when the caller is cancelled runs to its end,
        and a lease it got is released (``revoked``) before the cancel is raised."""
        if self._store is None:
            submitted = pool().submit(self._lock.attempt, place)
            trying = self._through(asyncio.wrap_future(submitted), stop=submitted.cancel)
        else:
            trying = self._through(self._try(self._store, place))
        try:
            return await trying
        except asyncio.CancelledError:
            lease = self.lease
            if lease is not None:  # got by the try, which no other task shares (_claim)
                await self._revoke(lease)
            raise

    async def _through(self, work: Awaitable[T], stop: Callable[[], object] | None = None) -> T:
        """``work`` to its end, whatever cancels its caller meanwhile (``to_its_end``); an
        error of ``work`` after a cancel is logged."""
        return await to_its_end(work, stop, self._failed_after_cancel)

    def _failed_after_cancel(self, error: BaseException) -> None:
        extra = fields("cancelled_call_failed", self.lease, key=self.key)
        logger.error(
            "%s: a call whose caller was cancelled failed: %s", self.key, error, extra=extra
        )

    async def _try(self, store: AsyncStore, place: Place | None) -> Lease | None:
        lock = self._lock
        holder = lock.next_holder()
        slots = lock.slots if lock.limit == 1 else random.sample(lock.slots, lock.limit)
        started = time.perf_counter()
        try:
            for slot in slots:
                mine = place if place is not None and place.key == slot else None
                lease = await store.try_acquire(slot, holder, lock.ttl, None, mine)
                if lease is not None:
                    lock.took(lease, place)
                    break
        except BackendError:
            metrics.store_error(self.backend.name, "acquire")
            raise
        metrics.store_call(self.backend.name, "acquire", started)
        return lease

    async def attempt(self, place: Place | None = None) -> Lease | None:
        """One try, without waiting: the lease, now held, or None. ``place``: the caller's
        in the store's queue of the key's waiters (from :meth:`wait_once`), used up or left."""
        self._claim()
        self._loop = asyncio.get_running_loop()
        try:
            lease = await self._attempt(place)
        finally:
            self._acquiring = False
        if lease is not None:
            self._hold()
        return lease

    async def renew(self, ttl: float | Literal[_Default.DEFAULT] | None = DEFAULT) -> Lease:
        """Extend the lease to ``ttl`` seconds from now (default: the lock's ``ttl``).

        Raises:
            LockLostError: the lease is no longer ours.
        """
        if self._store is None:
            return await offload(self._lock.renew, ttl)
        lease = self.lease
        if lease is None:
            raise ConfigurationError(f"lock {self.key!r} is not held by this AsyncLock")
        new_ttl = self._lock.ttl if ttl is DEFAULT else validate_ttl(ttl)
        return self._lock.renewed(await shielded(self._store.renew(lease, new_ttl)))

    async def release(
        self,
        outcome: Outcome = Outcome.SUCCEEDED,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> Record | None:
        """Release the lease and record how it ended (see :meth:`Lock.release`). Once
        started, the release finishes even if this coroutine is cancelled (once or more):
        the cancel is raised after it."""
        return await self._through(self._release(outcome, problem, details, result))

    async def _release(
        self, outcome: Outcome, problem: str | None, details: str | None, result: Any
    ) -> Record | None:
        """Stop renewing, then release: through the store's asyncio client, or the pool."""
        await self._stop_renewal()
        lease, store, reported = self.lease, self._store, self.lost
        if (
            store is None
            or lease is None
            or remembered(outcome, result, lease.holder.task_name) is not None
        ):
            # A success that ``once`` keeps is stored with retries: Lock's, in the pool.
            release = functools.partial(self._lock.release, reported=reported)
            return await offload(release, outcome, problem, details, result)
        ending = self._lock.ending(outcome, problem, details, result)._replace(reported=reported)
        lease = ending.lease
        started = time.perf_counter()
        try:
            record = await store.release(
                lease, ending.outcome, ending.problem, ending.details, ending.result
            )
        except BackendError:
            metrics.store_error(self.backend.name, "release")
            releasing.unsettled.add(self.backend, ending)  # tried again at a later release
            raise
        except asyncio.CancelledError:  # by the loop's end only (see _through): as above
            releasing.unsettled.add(self.backend, ending)
            raise
        metrics.store_call(self.backend.name, "release", started)
        if releasing.unsettled.items:
            await offload(releasing.unsettled.settle, self.backend)
        if record is not None:
            return releasing.settle(self.backend, ending, record)
        return await offload(releasing.settle, self.backend, ending, None)  # lost: recorded so

    async def _revoke(self, lease: Lease) -> None:
        """Release ``lease``, got by an acquire whose coroutine was cancelled."""
        why = "the acquiring coroutine was cancelled"
        try:
            await self.release(Outcome.REVOKED, "CancelledError", why)
        except DLockError as exc:
            extra = fields("release_failed", lease, outcome=Outcome.REVOKED)
            logger.error(
                "could not release %s after a cancelled acquire: %s", lease.key, exc, extra=extra
            )

    async def current(self) -> Lease | None:
        """The lease on this key now, whoever holds it, or None."""
        if self._store is None or self._lock.limit > 1:
            return await offload(self._lock.current)
        return await shielded(self._store.get(self.key))

    async def holders(self) -> list[Lease]:
        """Every lease on this key now (on each slot, with a ``limit``)."""
        return await offload(self._lock.holders)

    # -- renewal and loss ------------------------------------------------------------------

    def _hold(self) -> None:
        """A lease was got: renewed by a task that holds this AsyncLock only weakly, so that
        one dropped while it holds is collected and its lease released (``abandoned``, by
        its :class:`Lock`), not renewed for as long as the loop runs."""
        if self.renew_in_background and self._lock.ttl is not None:
            name = f"dlock-renew:{self.key}"
            renewing = _renewing(weakref.ref(self), self._lock.ttl)
            self._renewal = asyncio.get_running_loop().create_task(renewing, name=name)

    async def _renew_once(self, renewed_at: float) -> float | None:
        """One background renewal: when the lease was last renewed (now, or still
        ``renewed_at`` after a failure within the ttl), or None once it is lost."""
        ttl = self._lock.ttl
        assert ttl is not None
        try:
            await self._through(self.renew())  # a cancel waits for it: see _stop_renewal
        except LockLostError:
            self._lose()
            return None
        except DLockError as exc:
            extra = fields("renew_failed", self.lease, backend=self.backend.url)
            if time.monotonic() - renewed_at < ttl:
                logger.warning("renewal of %s failed, will retry: %s", self.key, exc, extra=extra)
                return renewed_at
            logger.error(
                "lease on %s expired while its store failed: %s", self.key, exc, extra=extra
            )
            self._lose()
            return None
        return time.monotonic()

    async def _stop_renewal(self) -> None:
        """Stop renewing, and let a renewal under way finish (it ends with the renewal
        task), so that none races the release. A renewal task of another loop (the lease
        was taken on a loop since closed) cannot be awaited here: it is over, or told to stop."""
        task, self._renewal = self._renewal, None
        if task is None:
            return
        loop = task.get_loop()
        if loop is not asyncio.get_running_loop():
            if not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)
            return
        task.cancel()
        await asyncio.wait([task])

    def _lose(self) -> None:
        """Renewal found the lease gone: reported, unless its session's end was already;
        then its session's watcher, a task of this loop, stops: one report per lost lease."""
        lease = self.lease
        if lease is None or self.lost:
            return
        self._lost = True
        self._lock.stop_watching()  # Lock's own watch (it has no renewer)
        report_lost(lease, self._call_on_lost, backend=self.backend.url)

    def _lost_elsewhere(self, lease: Lease) -> None:
        """From the store's watcher: the session that kept ``lease`` alive ended (ignored
        when renewal reported it already, or for a lease this lock no longer holds)."""
        current = self.lease
        if self._lost or current is None or current.token != lease.token:
            return
        self._lost = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._call_on_lost, lease)

    def _call_on_lost(self, lease: Lease) -> None:
        """``on_lost(lease)``: an error it raises, or its coroutine raises, is logged."""
        if self.on_lost is None:
            return
        try:
            outcome = self.on_lost(lease)
        except Exception:
            extra = fields("on_lost_failed", lease, backend=self.backend.url)
            logger.exception("on_lost callback for %s failed", lease.key, extra=extra)
            return
        if inspect.isawaitable(outcome):
            task = asyncio.ensure_future(outcome)
            keep(task)
            task.add_done_callback(lambda done: _report_failure(done, lease, self.backend.url))

    # -- async with -----------------------------------------------------------------------

    async def __aenter__(self) -> Lease:
        return await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        first = self.lease
        if first is None:
            raise ConfigurationError(f"lock {self.key!r} is not held by this AsyncLock")
        if isinstance(exc, asyncio.CancelledError):
            await self.release(
                Outcome.REVOKED, "CancelledError", "the coroutine holding the lock was cancelled"
            )
        elif exc is not None:
            await self.release(Outcome.FAILED, *describe_exception(exc))
        elif await self.release() is None:
            raise LockLostError(first.key, first.fence, "release")

    def __repr__(self) -> str:
        state = "held" if self.lease is not None else "free"
        return f"<AsyncLock {self.key!r} {state} on {self.backend!r}>"


def _leave(place: Place) -> None:
    place.leave()


async def _renewing(ref: weakref.ref[AsyncLock], ttl: float) -> None:
    """Renew the lease of the AsyncLock ``ref`` names every ``ttl / 3``, until it is lost,
    the renewal is stopped, or the AsyncLock is collected. Cancelled by another than the
    release (the event loop ending with the lease held), it says that the lease will expire."""
    renewed_at: float | None = time.monotonic()
    try:
        while renewed_at is not None:
            await asyncio.sleep(ttl / 3)
            lock = ref()
            if lock is None or lock.lease is None:
                return
            renewed_at = await lock._renew_once(renewed_at)
            del lock  # held only while it renews
    except asyncio.CancelledError:
        lock = ref()
        if lock is not None and lock._renewal is asyncio.current_task() and lock.lease:
            extra = fields("renewal_cancelled", lock.lease, backend=lock.backend.url)
            logger.warning(
                "renewal of %s was cancelled with the lease held (its event loop ending?): "
                "the lease expires within %.1f s unless released",
                lock.key, ttl, extra=extra,
            )  # fmt: skip
        raise


def _report_failure(done: asyncio.Future[Any], lease: Lease, backend: str) -> None:
    """Log the error an ``on_lost`` coroutine ended with."""
    if not done.cancelled() and (error := done.exception()) is not None:
        extra = fields("on_lost_failed", lease, backend=backend)
        logger.error("on_lost callback for %s failed: %r", lease.key, error, extra=extra)
