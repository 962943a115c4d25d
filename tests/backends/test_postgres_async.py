"""The Postgres store's asyncio client (``AsyncLock`` on psycopg's ``AsyncConnection``):
each event loop has a lock session of its own whose advisory locks keep its leases alive,
a lease of it is reported lost when that session ends, a cancelled waiter's connection
leaves the queue, and the loop's connections close with the loop.

Every test works in a schema of its own on the server of ``DLOCK_POSTGRES_URL``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from celery_dlock import AsyncLock, Lease, Lock, LockLostError, Outcome
from tests.backends.stores.postgres import SERVER_URL, with_options
from tests.support import eventually
from tests.support.services import lease_session_pids, promote_a_standby_without, wait_ended

pytest.importorskip("psycopg")

from celery_dlock.backends.postgres import PostgresBackend


@pytest.fixture
def backend(schema: str) -> Iterator[PostgresBackend]:
    made = PostgresBackend.from_url(with_options(SERVER_URL, schema=schema))
    made.migrate()
    yield made
    made.close()


def row_pid(admin: Any, backend: PostgresBackend, key: str) -> int:
    row = admin.execute(
        f'SELECT backend_pid FROM "{backend.schema}".locks WHERE key = %s', (key,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_loop_holds_its_leases_on_a_lock_session_of_its_own(
    backend: PostgresBackend, admin: Any, schema: str
) -> None:
    sync_lock = Lock(backend, "job:pg-aio:sync")
    sync_lease = sync_lock.acquire()
    sync_pid = row_pid(admin, backend, "job:pg-aio:sync")

    async def scenario() -> int:
        async with AsyncLock(backend, "job:pg-aio:own") as lease:
            pid = row_pid(admin, backend, "job:pg-aio:own")
            assert lease_session_pids(admin, schema, lease.fence) == [pid]
            assert lease_session_pids(admin, schema, sync_lease.fence) == [sync_pid]
        assert lease_session_pids(admin, schema, lease.fence) == []
        return pid

    pid = asyncio.run(scenario())
    assert pid != sync_pid
    sync_lock.release()
    # The loop's session closed with the loop: no session is left with that pid.
    eventually(
        lambda: (
            admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            is None
            or None
        ),
        "the loop's lock session closes with the loop",
        timeout=10,
    )
    [record] = backend.history(key="job:pg-aio:own")
    assert record.outcome is Outcome.SUCCEEDED


def test_an_idle_loop_session_the_server_ended_is_replaced_before_the_next_acquire(
    backend: PostgresBackend, admin: Any
) -> None:
    async def scenario() -> None:
        async with AsyncLock(backend, "job:pg-aio:idle-ended"):
            pid = row_pid(admin, backend, "job:pg-aio:idle-ended")
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_ended(admin, pid)  # blocks the loop: nothing else runs on it
        async with AsyncLock(backend, "job:pg-aio:idle-ended"):  # no BackendError
            assert row_pid(admin, backend, "job:pg-aio:idle-ended") not in (pid, 0)

    asyncio.run(scenario())
    outcomes = [r.outcome for r in backend.history(key="job:pg-aio:idle-ended")]
    assert outcomes == [Outcome.SUCCEEDED, Outcome.SUCCEEDED]


def test_an_async_lease_is_reported_lost_soon_after_its_loop_session_ends(
    backend: PostgresBackend, admin: Any
) -> None:
    lost: list[Lease] = []

    async def scenario() -> None:
        lock = AsyncLock(backend, "job:pg-aio:watched", on_lost=lost.append)
        lease = await lock.acquire()
        pid = row_pid(admin, backend, "job:pg-aio:watched")
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        for _ in range(100):
            if lost:
                break
            await asyncio.sleep(0.05)
        assert lost == [lease] and lock.lost
        # Another holder takes the key over from the dead session, recorded disconnected.
        taker = AsyncLock(backend, "job:pg-aio:watched")
        taken = await taker.attempt()
        assert taken is not None and taken.fence > lease.fence
        await taker.release()
        with pytest.raises(LockLostError):
            await lock.__aexit__(None, None, None)

    asyncio.run(scenario())
    outcomes = {r.outcome for r in backend.history(key="job:pg-aio:watched")}
    assert Outcome.DISCONNECTED in outcomes and Outcome.LOST in outcomes


def test_a_cancelled_waiter_closes_its_connection_and_the_next_waiter_gets_the_key(
    backend: PostgresBackend, admin: Any
) -> None:
    key = "job:pg-aio:queue"
    holder = Lock(backend, key)
    holder.acquire()

    async def scenario() -> None:
        first = asyncio.ensure_future(AsyncLock(backend, key, wait=30).acquire())
        await asyncio.sleep(0.3)  # first in the queue, waiting on the holder
        second_lock = AsyncLock(backend, key, wait=30)
        second = asyncio.ensure_future(second_lock.acquire())
        await asyncio.sleep(0.3)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.1)
        await asyncio.to_thread(holder.release)
        lease = await asyncio.wait_for(second, 10)  # woken, not left behind the cancelled one
        assert lease.key == key
        await second_lock.release()

    asyncio.run(scenario())
    assert backend.get(key) is None
    assert [r.outcome for r in backend.history(key=key)] == [Outcome.SUCCEEDED] * 2


def test_no_fence_is_given_twice_when_the_server_fails_over_under_a_loops_session(
    backend: PostgresBackend, admin: Any, schema: str
) -> None:
    """As the blocking store's test: a loop's lock session that outlived a failover to a
    standby (its sequence behind the lost grants, its guard empty) still grants above them."""

    async def scenario() -> tuple[list[int], int]:
        async with AsyncLock(backend, "job:pg-aio:kept"):
            pass  # a grant the standby has
        locks = [AsyncLock(backend, f"job:pg-aio:lost:{n}") for n in range(2)]
        fences = [(await lock.acquire()).fence for lock in locks]
        promote_a_standby_without(admin, schema, fences)
        async with AsyncLock(backend, "job:pg-aio:fresh") as lease:
            fresh = lease.fence
        for lock in locks:  # their grants went with the old primary
            assert await lock.release() is None
        return fences, fresh

    fences, fence = asyncio.run(scenario())
    assert fence > max(fences), (fences, fence)
    assert admin.execute(f'SELECT count(*) FROM "{schema}".fence_guard').fetchone() == (1,)
