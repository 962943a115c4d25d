"""An AsyncLock's life around its lease, on the real stores (file, memory, Postgres, Redis):
a lease taken on a loop that has closed since, released from another loop; a lost lease
reported once, and not taken for the next lease's loss; an AsyncLock dropped while its
lease is renewed lets go of it, as a ``Lock`` does; an ``on_lost`` that fails is logged.
Every check reads the store."""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
import weakref
from collections.abc import Callable

import pytest

from celery_dlock import AsyncLock, AsyncLocks, Lease, LockLostError, Outcome
from celery_dlock.alocks import lost_lease
from celery_dlock.backends.base import LockBackend
from tests.backends import conftest
from tests.backends.stores.postgres import admin_connection, schema_store
from tests.support import force_release
from tests.support.services import POSTGRES_URL, lease_session_pids

backend = conftest.lock_store  # file, memory, Postgres, Redis


def fresh_key() -> str:
    return f"job:aio-life:{uuid.uuid4().hex[:8]}"


async def until(check: Callable[[], bool]) -> None:
    """Let the loop run until ``check()`` is true (a state the store or the loop decides)."""
    async with asyncio.timeout(30):  # a guard against a hang, not a measure
        while not check():
            await asyncio.sleep(0.01)


def renewing(key: str) -> bool:
    """Whether a renewal task of ``key`` still runs on this loop."""
    return any(task.get_name() == f"dlock-renew:{key}" for task in asyncio.all_tasks())


def test_a_lease_taken_on_a_loop_closed_since_is_released_from_another_loop(
    backend: LockBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: the release awaited the renewal task of the closed loop and raised
    ``RuntimeError: Event loop is closed``, the lease left in the store; and the loop's
    end stopped the renewal without a word."""
    key = fresh_key()
    lock = AsyncLock(backend, key, ttl=30)
    with caplog.at_level(logging.WARNING, logger="celery_dlock.aio"):
        lease = asyncio.run(lock.acquire())  # the loop closes with the lease held
    [said] = [r for r in caplog.records if r.name == "celery_dlock.aio"]
    assert key in said.getMessage() and "expires within 30.0 s" in said.getMessage()

    asyncio.run(lock.release())
    assert lock.lease is None
    found = backend.get(key)
    assert found is None or found.token != lease.token
    [record] = [r for r in backend.history(key=key) if r.lease.token == lease.token]
    assert record.outcome in (Outcome.SUCCEEDED, Outcome.LOST)

    async def again() -> Lease:
        async with lock as taken:
            assert backend.get(key) == taken
            return taken

    assert asyncio.run(again()).token != lease.token
    assert backend.get(key) is None


def test_a_lost_lease_does_not_make_the_next_lease_lost(backend: LockBackend) -> None:
    """Found by probing: ``lost`` stayed True for every later lease of the AsyncLock."""
    key = fresh_key()

    async def scenario() -> None:
        lock = AsyncLock(backend, key, ttl=0.6)
        await lock.acquire()
        assert force_release(backend, key, "operator") is not None
        await until(lambda: lock.lost)
        assert await lock.release() is None  # recorded lost
        lease = await lock.acquire()
        assert backend.get(key) == lease
        assert not lock.lost
        assert await lock.release() is not None

    asyncio.run(scenario())
    ended = sorted(record.outcome.value for record in backend.history(key=key))
    assert ended == ["forced", "lost", "succeeded"]


def test_a_set_that_lost_a_key_is_not_lost_once_taken_again(backend: LockBackend) -> None:
    """The same for ``alock([...])``: ``lost`` and ``lost_lease`` spoke of the old lease."""
    first, second = sorted([fresh_key(), fresh_key()])
    both = AsyncLocks(backend, [first, second], ttl=0.6)

    async def scenario() -> None:
        with pytest.raises(LockLostError):
            async with both:
                assert force_release(backend, second, "operator") is not None
                await until(lambda: both.lost)
        leases = await both.acquire()
        assert [backend.get(lease.key) for lease in leases] == leases
        assert not both.lost
        assert lost_lease(both) == leases[0]  # none lost: the first key's
        assert await both.release() is not None

    asyncio.run(scenario())
    assert backend.get(first) is None and backend.get(second) is None


def test_an_async_lock_dropped_while_renewed_lets_go_of_its_lease(backend: LockBackend) -> None:
    """Found by probing: the renewal task held the AsyncLock, so a dropped one was never
    collected and its lease was renewed for as long as the loop ran."""
    key = fresh_key()

    async def scenario() -> Lease:
        # Renewed every 4 s: the drop's release must come within the ttl, or it finds the
        # lease expired (a loaded CI run recorded `expired` at ttl 1.5 s, and another at 4.5,
        # its collection and release 5 s after the lease's last renewal).
        lock = AsyncLock(backend, key, ttl=12.0)
        lease = await lock.acquire()
        assert renewing(key)
        dropped = weakref.ref(lock)
        del lock
        with pytest.warns(ResourceWarning, match="garbage-collected while held"):
            # A pool's thread may hold the lock a moment longer (its call's work item).
            await until(lambda: gc.collect() >= 0 and dropped() is None)
        assert backend.get(key) is None
        await until(lambda: not renewing(key))  # woke, found the lock gone, ended
        return lease

    lease = asyncio.run(scenario())
    [record] = backend.history(key=key)
    assert record.lease.token == lease.token and record.outcome is Outcome.ABANDONED


def test_on_lost_is_called_once_when_the_session_of_a_renewed_lease_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Postgres: the loop's lock session ends under a lease with a ttl. Found by probing:
    both the session's watcher and the renewal reported the loss, calling ``on_lost``
    twice (whichever notices first now reports alone: test_lost_lease_reported_once)."""

    with schema_store(POSTGRES_URL) as case:
        store = case.backend
        admin = admin_connection()
        lost: list[Lease] = []

        async def scenario() -> None:
            lock = AsyncLock(store, "job:aio-life:session", ttl=0.9, on_lost=lost.append)
            lease = await lock.acquire()
            [pid] = lease_session_pids(admin, store.schema, lease.fence)
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
            await until(lambda: lock.lost)  # the session's watcher or the renewal found it
            await until(lambda: not renewing(lease.key))  # ...and the renewal stopped
            await asyncio.sleep(0)  # a report the watcher scheduled runs
            assert await lock.release() is None

        try:
            with caplog.at_level(logging.ERROR):
                asyncio.run(scenario())
        finally:
            admin.close()
        assert len(lost) == 1


@pytest.mark.parametrize("kind", ["function", "coroutine"])
def test_an_on_lost_that_fails_is_logged(
    backend: LockBackend, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    key = fresh_key()

    def failing(lease: Lease) -> None:
        raise RuntimeError(f"cannot stop the work on {lease.key}")

    async def failing_later(lease: Lease) -> None:
        failing(lease)

    async def scenario() -> None:
        on_lost = failing if kind == "function" else failing_later
        lock = AsyncLock(backend, key, ttl=0.6, on_lost=on_lost)
        await lock.acquire()
        assert force_release(backend, key, "operator") is not None
        await until(lambda: lock.lost)
        await until(lambda: any("on_lost callback" in r.message for r in caplog.records))
        assert await lock.release() is None

    with caplog.at_level(logging.ERROR):
        asyncio.run(scenario())
    [failed] = [r for r in caplog.records if "on_lost callback" in r.message]
    assert key in failed.getMessage()
