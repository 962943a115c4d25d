"""``dlock_reaped_total{reason}`` counts a dead lease that an acquire takes over, as it counts
those the janitor reaps, on every store: a redelivered task (acks_late) takes its killed
predecessor's key before any janitor runs, and the store records the old lease
``disconnected`` or ``expired`` as it does so. A lease continued by its own task's retry
is no death and is not counted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from celery_dlock import AsyncLock, Lease, Outcome, metrics
from celery_dlock.backends.base import LockBackend
from tests.backends.storecase import StoreCase
from tests.backends.test_contract import expire, holder, needs_processes, short_ttl
from tests.support import eventually
from tests.support.holders import kill, spawn_holder

prometheus_client = pytest.importorskip("prometheus_client")

Counted = Callable[[str], float]


@pytest.fixture
def reaped() -> Iterator[Counted]:
    """``dlock_reaped_total{reason=...}`` in a registry of this test's own. The metrics of
    this process are made once (``enable`` refuses another registry): those made before,
    in tests/test_metrics.py's registry, are set aside for the test and put back after."""
    saved, children, was_on = dict(metrics._metrics), dict(metrics._children), metrics.enabled()
    saved_registry = metrics._registry
    metrics.disable()
    metrics._metrics.clear()
    metrics._children.clear()
    registry = prometheus_client.CollectorRegistry()
    metrics.enable(registry)
    try:
        yield lambda reason: registry.get_sample_value("dlock_reaped_total", {"reason": reason})
    finally:
        metrics.disable()
        metrics._metrics.clear()
        metrics._metrics.update(saved)
        metrics._children.clear()
        metrics._children.update(children)
        metrics._registry = saved_registry
        if was_on:
            metrics.enable()


def expired_lease(store: StoreCase, key: str) -> Lease:
    lease = store.backend.try_acquire(key, holder("t.dead"), short_ttl(store))
    assert lease is not None
    expire(store, lease)
    return lease


def taken(client: LockBackend, key: str) -> Lease:
    # A new client of an object store knows the server's clock only to the second at first.
    return eventually(lambda: client.try_acquire(key, holder(), None), f"{key} taken over", 10)


def test_an_expired_lease_taken_over_is_counted(store: StoreCase, reaped: Counted) -> None:
    backend = store.backend
    dead = expired_lease(store, "job:taken:expired")
    other = store.second()
    try:
        lease = taken(other, "job:taken:expired")
        assert lease.fence > dead.fence
        [record] = backend.history(key="job:taken:expired")
        assert record.outcome is Outcome.EXPIRED and record.lease.token == dead.token
        assert reaped("expired") == 1
        assert other.release(lease, Outcome.SUCCEEDED) is not None
        assert reaped("expired") == 1 and not reaped("disconnected")
    finally:
        if other is not backend:
            other.close()


def test_a_lease_whose_holder_died_taken_over_is_counted(store: StoreCase, reaped: Counted) -> None:
    url = needs_processes(store)
    backend = store.backend
    if backend.capabilities.liveness == "lease":
        pytest.skip("not applicable: a dead holder's lease here ends by its ttl (test above)")
    process, dead = spawn_holder(url, "job:taken:dead")
    kill(process)

    lease = taken(backend, "job:taken:dead")

    assert lease.fence > dead.fence
    [record] = backend.history(key="job:taken:dead")
    assert record.outcome is Outcome.DISCONNECTED and record.lease.token == dead.token
    assert reaped("disconnected") == 1 and not reaped("expired")


def test_a_take_over_through_the_asyncio_api_is_counted(store: StoreCase, reaped: Counted) -> None:
    """The store's own asyncio client where it has one (Postgres, Redis)."""
    backend = store.backend
    dead = expired_lease(store, "job:taken:aio")

    async def take() -> Lease | None:
        lock = AsyncLock(backend, "job:taken:aio")
        lease = await lock.attempt()
        if lease is not None:
            await lock.release()
        return lease

    lease = eventually(lambda: asyncio.run(take()), "job:taken:aio taken over", 10)

    assert lease.fence > dead.fence
    outcomes = [record.outcome for record in backend.history(key="job:taken:aio")]
    assert outcomes == [Outcome.SUCCEEDED, Outcome.EXPIRED]
    assert reaped("expired") == 1


def test_a_retry_continuing_its_own_lease_is_not_counted(
    backend: LockBackend, reaped: Counted
) -> None:
    first = backend.try_acquire("job:taken:retried", holder("t.retry"), None)
    assert first is not None

    again = backend.try_acquire("job:taken:retried", holder("t.retry"), None, replace=first.token)

    assert again is not None
    [record] = backend.history(key="job:taken:retried")
    assert record.outcome is Outcome.RETRIED
    assert not reaped("retried") and not reaped("expired") and not reaped("disconnected")
    backend.release(again, Outcome.SUCCEEDED)
