"""The tasks and threads an :class:`~celery_dlock.aio.AsyncLock` runs its store calls in,
apart from the awaiting coroutine's: tasks kept until done (the loop holds tasks only
weakly), and never cut short, nor their cancel lost, by a cancel of that coroutine; and,
for a store without an asyncio client, a bounded pool of threads per process (``offload``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from celery_dlock.backends.base import Place

__all__ = [
    "OFFLOAD_THREADS", "WAIT_THREADS", "cancellable", "keep", "offload", "pool", "shielded",
    "to_its_end",
]  # fmt: skip

#: Threads per process that run the short store calls of every AsyncLock (a try, a
#: release, a renewal)...
OFFLOAD_THREADS = 16
#: ...and those that wait on the store for a busy key, apart: waits that block for up to
#: ``aio.SLICE`` never hold up a try or a release (more waiters than this queue for a thread).
WAIT_THREADS = 64

T = TypeVar("T")
_kept: set[asyncio.Future[Any]] = set()
_pools: dict[tuple[int, str], concurrent.futures.ThreadPoolExecutor] = {}
_pools_mutex = threading.Lock()


def pool(kind: str = "calls") -> concurrent.futures.ThreadPoolExecutor:
    """This process's offload pool of ``kind`` (``calls`` or ``waits``; a forked child
    makes its own)."""
    which = (os.getpid(), kind)
    found = _pools.get(which)
    if found is None:
        size = WAIT_THREADS if kind == "waits" else OFFLOAD_THREADS
        with _pools_mutex:
            found = _pools.setdefault(
                which,
                concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix=f"dlock-{kind}"),
            )
    return found


async def offload(
    call: Callable[..., T],
    *args: Any,
    orphan: Callable[[Any], object] | None = None,
    kind: str = "calls",
) -> T:
    """``call(*args)`` in the offload pool of ``kind``. If the awaiting coroutine is
    cancelled while it runs, what it returns (when not None) is handed to ``orphan``, in
    the pool."""
    future = pool(kind).submit(call, *args)
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
        pool().submit(orphan, result)  # never on the event loop's thread


def keep(task: asyncio.Future[Any]) -> None:
    """Keep ``task`` referenced until it is done: the loop holds tasks only weakly."""
    _kept.add(task)
    task.add_done_callback(_kept.discard)


async def shielded(call: Awaitable[T]) -> T:
    """``call`` in a task of its own, which goes on when the awaiting coroutine is cancelled
    (the cancel is raised at once): a statement on Postgres's lock session, which the loop's
    leases share, is never cancelled halfway (cancelled twice, psycopg closes the session)."""
    task = asyncio.ensure_future(call)
    keep(task)
    return await asyncio.shield(task)


async def cancellable(wait: Awaitable[Place | None]) -> Place | None:
    """``wait`` (one wait on the store) in a task of its own. A cancel of the awaiting
    coroutine, once or more, cancels the task, lets it end (a wait is short), leaves a
    place it returned all the same, and is raised then. Awaited directly, a wait may lose
    the cancel: a driver's step that ends as the cancel lands can swallow it (Python 3.11's
    ``asyncio.wait_for``, which redis-py uses under a ``socket_timeout``), and a waiter
    with ``wait=None`` then waits for ever."""
    task = asyncio.ensure_future(wait)
    keep(task)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError as exc:
            if cancelled is None:
                task.cancel()
            cancelled = exc
    if cancelled is None:
        return task.result()
    if not task.cancelled() and task.exception() is None:
        place = task.result()
        if place is not None:
            await place.leave_now()  # before the cancel is raised: the loop may end then
    raise cancelled


async def to_its_end(
    work: Awaitable[T],
    stop: Callable[[], object] | None = None,
    failed: Callable[[BaseException], object] | None = None,
) -> T:
    """``work``, in a task of its own, to its end even if the awaiting coroutine is
    cancelled meanwhile, once or more: the cancel is raised after it (an error of ``work``
    then goes to ``failed``: a cancel always propagates). ``stop``, called at the first
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
    if not task.cancelled() and (error := task.exception()) is not None and failed is not None:
        failed(error)
    raise cancelled
