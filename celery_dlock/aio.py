"""asyncio: :class:`AsyncLock` and :func:`alock`, the contract of :class:`Lock` from a
coroutine::

    async with celery_dlock.alock("job:123", backend=url, ttl=30, wait=5) as lease:
        await work(fence=lease.fence)

Where the store has an asyncio client of its own (``LockBackend.async_store``: Redis on
redis-py's asyncio connections, Postgres on psycopg's ``AsyncConnection``), a lock's calls
run on the event loop through it. Elsewhere (file, object stores, memory) every store call
runs in a bounded pool of threads (``OFFLOAD_THREADS`` for tries, releases and renewals,
``WAIT_THREADS`` for waits), never on the event loop. Either way waiting goes in short
steps: one try at the key, then a wait of at most ``SLICE`` seconds on the store's own push
(Postgres's queue of waiters, Redis's wake-up list, inotify), then the next try. A
cancelled waiter therefore lets go within one step, and nothing it was granted meanwhile
stays held: a try under way when its caller is cancelled runs to its end, and a lease it
got is released (``revoked``) before the cancel is raised; a place in a store's queue is
left. A release, once started, likewise ends before a cancel (or several) is raised; a
cancelled read or renewal lets its call to the store end in the background (on Postgres
that call runs on the loop's shared lock session). Renewal is an asyncio task. The lease
and its record are those of a :class:`Lock`, on the same stores; a success that ``once``
keeps is released as :class:`Lock` does, with its retries, in the pool. One AsyncLock is
for one task at a time: another task's acquire meanwhile is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Literal, TypeVar

from celery_dlock import metrics, releasing
from celery_dlock.backends.base import AsyncStore, LockBackend, Place, remembered, validate_ttl
from celery_dlock.errors import BackendError, ConfigurationError, DLockError, LockLostError
from celery_dlock.events import fields
from celery_dlock.lock import DEFAULT, Lock, _Default, validate_wait
from celery_dlock.records import Holder, Lease, Outcome, Record, describe_exception
from celery_dlock.renewal import report_lost

__all__ = ["OFFLOAD_THREADS", "SLICE", "WAIT_THREADS", "AsyncLock", "alock"]

logger = logging.getLogger("celery_dlock.aio")

#: Threads per process that run the short store calls of every AsyncLock (a try, a
#: release, a renewal)...
OFFLOAD_THREADS = 16
#: ...and those that wait on the store for a busy key, apart: waits that block for up to
#: ``SLICE`` never hold up a try or a release (more waiters than this queue for a thread).
WAIT_THREADS = 64
#: Longest wait on the store in one step: how long a cancelled waiter's thread may linger.
SLICE = 0.5

T = TypeVar("T")
_pools: dict[tuple[int, str], concurrent.futures.ThreadPoolExecutor] = {}
_pools_mutex = threading.Lock()
_callbacks: set[asyncio.Future[Any]] = set()


def _pool(kind: str = "calls") -> concurrent.futures.ThreadPoolExecutor:
    """This process's offload pool of ``kind`` (``calls`` or ``waits``; a forked child
    makes its own)."""
    which = (os.getpid(), kind)
    pool = _pools.get(which)
    if pool is None:
        size = WAIT_THREADS if kind == "waits" else OFFLOAD_THREADS
        with _pools_mutex:
            pool = _pools.setdefault(
                which,
                concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix=f"dlock-{kind}"),
            )
    return pool


async def _off(
    call: Callable[..., T],
    *args: Any,
    orphan: Callable[[Any], object] | None = None,
    pool: str = "calls",
) -> T:
    """``call(*args)`` in the offload pool ``pool``. If the awaiting coroutine is cancelled
    while it runs, what it returns (when not None) is handed to ``orphan``, in the pool."""
    future = _pool(pool).submit(call, *args)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        if orphan is not None:
            future.add_done_callback(lambda done: _adopt(done, orphan))
        raise


def _adopt(done: concurrent.futures.Future[Any], orphan: Callable[[Any], object]) -> None:
    if done.cancelled() or done.exception() is not None:
        return
    result = done.result()
    if result is not None:
        _pool().submit(orphan, result)  # never on the event loop's thread


async def _shielded(call: Awaitable[T]) -> T:
    """``call`` in a task of its own, which goes on when the awaiting coroutine is cancelled
    (the cancel is raised at once): a statement on Postgres's lock session, which the loop's
    leases share, is never cancelled halfway (cancelled twice, psycopg closes the session)."""
    task = asyncio.ensure_future(call)
    _callbacks.add(task)  # kept until done: the loop holds tasks only weakly
    task.add_done_callback(_callbacks.discard)
    return await asyncio.shield(task)


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
        self._claim()
        limit = self._lock.wait if wait is DEFAULT else validate_wait(wait)
        deadline = None if limit is None else time.monotonic() + limit
        self._loop = asyncio.get_running_loop()
        place: Place | None = None  # in the store's queue of the key's waiters, if it has one
        try:
            while True:
                lease = await self._attempt(place)
                if lease is not None:
                    place = None  # used up
                    self._start_renewal()
                    return lease
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._lock.busy_error(limit, await self.current())
                pause = SLICE if remaining is None else min(SLICE, remaining)
                if self._store is None:  # Lock.wait_once, in the pool
                    place = await _off(
                        self._lock.wait_once, pause, place, orphan=_leave, pool="waits"
                    )
                elif self._lock.limit == 1:
                    place = await self._store.wait(self.key, pause, place)
                else:  # woken by the release of any slot
                    await self._store.wait_any(self._lock.slots, pause)
        finally:
            self._acquiring = False
            if place is not None and self._store is not None:
                place.leave()  # the asyncio client's: left by a task of the loop
            elif place is not None:
                _pool().submit(place.leave)

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

    async def _attempt(self, place: Place | None) -> Lease | None:
        """One try at the key (each slot, with a ``limit``), through the store's asyncio
        client or the pool. A try under way when the caller is cancelled runs to its end,
        and a lease it got is released (``revoked``) before the cancel is raised."""
        if self._store is None:
            submitted = _pool().submit(self._lock.attempt, place)
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
        """``work``, in a task of its own, to its end even if the awaiting coroutine is
        cancelled meanwhile, once or more: the cancel is raised after it (an error of
        ``work`` is logged: a cancel always propagates). ``stop``, called at the first
        cancel, may end it sooner (a call still in a pool's queue)."""
        task = asyncio.ensure_future(work)
        cancelled: asyncio.CancelledError | None = None
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError as exc:
                if cancelled is None and stop is not None:
                    stop()
                cancelled = exc
        if cancelled is None:
            return task.result()
        if not task.cancelled() and (error := task.exception()) is not None:
            extra = fields("cancelled_call_failed", self.lease, key=self.key)
            logger.error(
                "%s: a call whose caller was cancelled failed: %s", self.key, error, extra=extra
            )
        raise cancelled

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

    async def attempt(self) -> Lease | None:
        """One try, without waiting: the lease, now held, or None."""
        self._claim()
        self._loop = asyncio.get_running_loop()
        try:
            lease = await self._attempt(None)
        finally:
            self._acquiring = False
        if lease is not None:
            self._start_renewal()
        return lease

    async def renew(self, ttl: float | Literal[_Default.DEFAULT] | None = DEFAULT) -> Lease:
        """Extend the lease to ``ttl`` seconds from now (default: the lock's ``ttl``).

        Raises:
            LockLostError: the lease is no longer ours.
        """
        if self._store is None:
            return await _off(self._lock.renew, ttl)
        lease = self.lease
        if lease is None:
            raise ConfigurationError(f"lock {self.key!r} is not held by this AsyncLock")
        new_ttl = self._lock.ttl if ttl is DEFAULT else validate_ttl(ttl)
        return self._lock.renewed(await _shielded(self._store.renew(lease, new_ttl)))

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
        lease, store = self.lease, self._store
        if (
            store is None
            or lease is None
            or remembered(outcome, result, lease.holder.task_name) is not None
        ):
            # A success that ``once`` keeps is stored with retries: Lock's, in the pool.
            return await _off(self._lock.release, outcome, problem, details, result)
        ending = self._lock.ending(outcome, problem, details, result)
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
        metrics.store_call(self.backend.name, "release", started)
        if releasing.unsettled.items:
            await _off(releasing.unsettled.settle, self.backend)
        if record is not None:
            return releasing.settle(self.backend, ending, record)
        return await _off(releasing.settle, self.backend, ending, None)  # lost: recorded so

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
            return await _off(self._lock.current)
        return await _shielded(self._store.get(self.key))

    async def holders(self) -> list[Lease]:
        """Every lease on this key now (on each slot, with a ``limit``)."""
        return await _off(self._lock.holders)

    # -- renewal and loss ------------------------------------------------------------------

    def _start_renewal(self) -> None:
        if self.renew_in_background and self._lock.ttl is not None:
            name = f"dlock-renew:{self.key}"
            self._renewal = asyncio.get_running_loop().create_task(self._renew(), name=name)

    async def _renew(self) -> None:
        ttl = self._lock.ttl
        assert ttl is not None
        renewed_at = time.monotonic()
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                await self._through(self.renew())  # a cancel waits for it: see _stop_renewal
            except LockLostError:
                self._lose()
                return
            except DLockError as exc:
                lease = self.lease
                extra = fields("renew_failed", lease, backend=self.backend.url)
                if time.monotonic() - renewed_at < ttl:
                    logger.warning(
                        "renewal of %s failed, will retry: %s", self.key, exc, extra=extra
                    )
                    continue
                logger.error(
                    "lease on %s expired while its store failed: %s", self.key, exc, extra=extra
                )
                self._lose()
                return
            renewed_at = time.monotonic()

    async def _stop_renewal(self) -> None:
        """Stop renewing, and let a renewal under way finish (it ends with the renewal
        task), so that none races the release."""
        task, self._renewal = self._renewal, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    def _lose(self) -> None:
        self._lost = True
        lease = self.lease
        if lease is not None:
            report_lost(lease, self._call_on_lost)

    def _lost_elsewhere(self, lease: Lease) -> None:
        """From the store's watcher thread: the session that kept the lease alive ended."""
        self._lost = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._call_on_lost, lease)

    def _call_on_lost(self, lease: Lease) -> None:
        if self.on_lost is None:
            return
        outcome = self.on_lost(lease)
        if inspect.isawaitable(outcome):
            task = asyncio.ensure_future(outcome)
            _callbacks.add(task)  # kept until done: the loop holds tasks only weakly
            task.add_done_callback(_callbacks.discard)

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


def alock(
    key: str,
    backend: LockBackend | str,
    ttl: float | None = None,
    wait: float | None = 0,
    **options: Any,
) -> AsyncLock:
    """An :class:`AsyncLock` to use in an ``async with`` block, which gives the lease::

        async with celery_dlock.alock("job:123", backend=url, ttl=30, wait=5) as lease:
            await work(fence=lease.fence)

    The block's end is recorded as ``succeeded``; ``failed`` with the exception's type,
    message and traceback; ``revoked`` when the coroutine was cancelled. If the lease was
    lost meanwhile, leaving the block raises :class:`LockLostError` (unless it raised).
    """
    return AsyncLock(backend, key, ttl, wait, **options)
