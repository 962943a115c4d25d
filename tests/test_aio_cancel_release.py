"""AsyncLock under cancellation and sharing, on every store: a cancel (or two) that lands
while a lease is being released lets the release finish before it is raised; a cancelled
read or renewal never cancels a statement halfway on Postgres's shared lock session; a
second task using an AsyncLock that another task is acquiring is refused, and takes no slot.

Each cancel lands at a point that an event, a hook or the server's lock table marks, not
after a timed sleep.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import celery_dlock
from celery_dlock import AsyncLock, ConfigurationError, Lease, Outcome
from celery_dlock.backends.base import LockBackend
from tests.backends import conftest as contract
from tests.backends.storecase import StoreCase
from tests.backends.stores.postgres import SERVER_URL, admin_connection, schema_store

store = contract.store  # the contract suite's fixture: every store


def test_a_cancel_while_async_with_releases_lets_the_release_finish(store: StoreCase) -> None:
    backend, key = store.backend, "job:aio:cancel-exit"
    leases: list[Lease] = []

    async def holding(ended: asyncio.Event) -> None:
        async with celery_dlock.alock(key, backend, ttl=30) as lease:
            leases.append(lease)
            ended.set()  # the block ends: __aexit__ starts the release in this same step

    async def scenario() -> None:
        ended = asyncio.Event()
        task = asyncio.ensure_future(holding(ended))
        await ended.wait()
        task.cancel()  # one cancel (a timeout, a shutdown), the release under way
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.get(key) is None  # released before the cancel was raised

    asyncio.run(scenario())
    # The block ran to its end: its release records that, the cancel came after it.
    [record] = backend.history(key=key)
    assert record.lease.token == leases[0].token and record.outcome is Outcome.SUCCEEDED


def test_a_second_cancel_while_a_cancelled_holder_releases_lets_the_release_finish(
    store: StoreCase,
) -> None:
    backend, key = store.backend, "job:aio:cancel-twice"
    leases: list[Lease] = []

    async def holding(entered: asyncio.Event, cancelled: asyncio.Event) -> None:
        async with celery_dlock.alock(key, backend, ttl=30) as lease:
            leases.append(lease)
            entered.set()
            try:
                await asyncio.sleep(60)
            finally:
                cancelled.set()  # the first cancel: __aexit__ starts releasing in this step

    async def scenario() -> None:
        entered, cancelled = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(holding(entered, cancelled))
        await entered.wait()
        task.cancel()
        await cancelled.wait()
        task.cancel()  # the second, the release (revoked) under way
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.get(key) is None

    asyncio.run(scenario())
    [record] = backend.history(key=key)
    assert record.lease.token == leases[0].token
    assert record.outcome is Outcome.REVOKED and record.problem == "CancelledError"


@pytest.mark.parametrize("call", ["current", "renew"])
def test_a_call_cancelled_twice_mid_statement_loses_no_lease_of_the_loop_s_session(
    call: str,
) -> None:
    # Cancelled twice while its statement runs, psycopg closes the connection: on the
    # loop's shared lock session that would lose every lease of the loop.
    with schema_store(SERVER_URL) as case:
        backend = case.backend
        admin = admin_connection()
        waiting = (
            "SELECT count(*) FROM pg_locks"
            f" WHERE relation = '\"{backend.schema}\".locks'::regclass AND NOT granted"
        )

        async def statement_waits() -> None:
            while admin.execute(waiting).fetchone() == (0,):
                await asyncio.sleep(0.01)

        async def scenario() -> None:
            victim = AsyncLock(backend, "job:aio:victim")
            await victim.acquire()
            other = AsyncLock(backend, "job:aio:other", ttl=30, renew=False)
            await other.acquire()
            with admin.transaction():
                admin.execute(f'LOCK TABLE "{backend.schema}".locks IN ACCESS EXCLUSIVE MODE')
                task = asyncio.ensure_future(getattr(other, call)())
                await asyncio.wait_for(statement_waits(), 10)  # on the table's lock
                task.cancel()
                await asyncio.sleep(0)  # one step: psycopg cancels it on the server...
                task.cancel()  # ...and is interrupted
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert not victim.lost
            records = [await victim.release(), await other.release()]
            assert [r and r.outcome for r in records] == [Outcome.SUCCEEDED] * 2

        try:
            asyncio.run(scenario())
        finally:
            admin.close()
        assert backend.get("job:aio:victim") is None
        assert [r.outcome for r in backend.history(key="job:aio:victim")] == [Outcome.SUCCEEDED]


class Gate:
    """Holds the first try at ``backend`` (through its asyncio client, or in the pool's
    thread) until opened: an acquire under way that has not got its lease yet."""

    def __init__(self, backend: LockBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._go, self._go_async = threading.Event(), asyncio.Event()
        self._tries = 0
        self._mutex = threading.Lock()
        native = backend.async_store()
        if native is None:
            self._patch_blocking(backend, monkeypatch)
        else:
            real = native.try_acquire

            async def held(*args: Any) -> Lease | None:
                if self._first():
                    self.entered.set()
                    await self._go_async.wait()
                return await real(*args)

            monkeypatch.setattr(native, "try_acquire", held)

    def _patch_blocking(self, backend: LockBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        real = backend.try_acquire

        def held(*args: Any) -> Lease | None:
            if self._first():
                assert self.loop is not None
                self.loop.call_soon_threadsafe(self.entered.set)
                self._go.wait(30)
            return real(*args)

        monkeypatch.setattr(backend, "try_acquire", held)

    def _first(self) -> bool:
        with self._mutex:
            self._tries += 1
            return self._tries == 1

    def open(self) -> None:
        self._go.set()
        self._go_async.set()


@pytest.mark.parametrize("limit", [1, 2])
def test_a_second_task_on_an_async_lock_being_acquired_is_refused_and_takes_no_slot(
    store: StoreCase, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    backend, key = store.backend, "job:aio:shared"
    gate = Gate(backend, monkeypatch)
    lock = AsyncLock(backend, key, ttl=30, wait=5, limit=limit)

    async def scenario() -> Lease:
        gate.loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(lock.acquire())
        await gate.entered.wait()  # the first task's try is at the store
        try:
            with pytest.raises(ConfigurationError, match="another task"):
                await lock.acquire()
        finally:
            gate.open()
        lease = await first
        assert lock.lease == lease
        assert await lock.release() is not None
        return lease

    lease = asyncio.run(scenario())
    slots = [key] if limit == 1 else [f"{key}#{n}" for n in range(limit)]
    assert [backend.get(slot) for slot in slots] == [None] * limit
    [record] = [r for slot in slots for r in backend.history(key=slot)]
    assert record.lease.token == lease.token and record.outcome is Outcome.SUCCEEDED
