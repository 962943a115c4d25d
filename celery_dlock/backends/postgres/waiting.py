"""Waiting for a key held by another session: woken by the server, first come first served.

The waiters of a key queue on a per-key advisory lock; the first of them waits on the
holder's advisory lock (under a transaction-local ``lock_timeout``), and a release wakes that
one only. A waiter's connection stays in the queue as its :class:`Queued` place until it
acquires or gives up (see ``LockBackend.wait``).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence

import psycopg

from celery_dlock.backends.base import Place
from celery_dlock.backends.postgres.config import translate
from celery_dlock.backends.postgres.session import Client, Queued
from celery_dlock.backends.postgres.statements import Statements
from celery_dlock.errors import BackendError

__all__ = ["ANY_SLICE", "await_any", "wait", "wait_any"]

#: Longest wait on one key of several (``wait_any``): a statement waits on one lock only,
#: so the keys take turns, and a release of another key is seen within this many seconds.
ANY_SLICE = 0.1


def wait(
    client: Client, sql: Statements, url: str, *, key: str, timeout: float, place: Place | None
) -> Place | None:
    """Block until ``key``'s holder lets go (or is gone, or its lease expires), at most
    ``timeout`` seconds.

    Returns:
        the waiter's place in the key's queue when woken (see ``LockBackend.wait``); None
        when the timeout ran out first (the place is left), and when every waiter connection
        is busy (``max_waiters``: a short poll instead).
    """
    queued = Queued.of(place, key)
    if timeout <= 0:
        return queued
    params = {"key": key, "ms": max(1, math.ceil(timeout * 1000))}
    try:
        conn = client.check_out() if queued is None else queued.conn
    except BackendError:  # the server refuses another connection (its limit, the role's)
        conn = None
    if conn is None:  # max_waiters are busy, or no connection could be opened: poll
        time.sleep(min(timeout, random.uniform(0.025, 0.05)))
        return None
    waiting = queued or client.place(key, conn)
    try:
        cursor = psycopg.ClientCursor(conn)
        cursor.execute(sql.wait if queued is None else sql.wait_again, params)
    except psycopg.Error as exc:
        # Leaving also lets go of a queue lock granted just before a reported timeout (the
        # race DistributedLock#147 found); the caller tries the key again anyway.
        waiting.leave()
        if conn.closed:  # only a wake-up: a waiter whose connection ended looks again, and
            # that look raises if the server is down (a terminated backend, a restart)
            time.sleep(min(timeout, random.uniform(0.05, 0.1)))
            return None
        if exc.sqlstate not in ("55P03", "57014"):
            raise translate(exc, "wait", url) from exc
        return None
    except BaseException:
        # Cut while the server waits (a Celery soft time limit comes as an exception): the
        # answer is never read, and until the place was collected the server kept waiting
        # in the key's queue, so the next waiters fell back to polling. Leaving closes the
        # connection (its statement is still under way), which ends that wait at once.
        waiting.leave()
        raise
    return waiting


def wait_any(
    wait: Callable[[str, float], Place | None], keys: Sequence[str], timeout: float
) -> None:
    """Block until one of ``keys`` may have become free, at most ``timeout`` seconds: a
    ``wait`` (the store's) on each in turn, from one picked at random, for up to
    :data:`ANY_SLICE`: woken by the server for the key waited on, its place left at once."""
    deadline = time.monotonic() + timeout
    turn = random.randrange(len(keys))
    while (left := deadline - time.monotonic()) > 0:
        place = wait(keys[turn % len(keys)], min(left, ANY_SLICE))
        if place is not None:  # the key is free, let go, its holder gone or expired
            place.leave()
            return
        turn += 1


async def await_any(
    wait: Callable[[str, float], Awaitable[Place | None]], keys: Sequence[str], timeout: float
) -> None:
    """:func:`wait_any` with the asyncio client's ``wait``."""
    deadline = time.monotonic() + timeout
    turn = random.randrange(len(keys))
    while (left := deadline - time.monotonic()) > 0:
        place = await wait(keys[turn % len(keys)], min(left, ANY_SLICE))
        if place is not None:
            place.leave()
            return
        turn += 1
