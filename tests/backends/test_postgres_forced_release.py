"""Postgres with session liveness: a lease held without a ttl that is ended elsewhere by its
token (``celery-dlock release KEY --force``: ``release(lease, Outcome.FORCED, ...)`` from
another process) is reported lost to its idle holder, by the watcher's sweep of the lock
session, as every other store's renewal reports it; a lease released by its holder is not.

Every test works in a schema of its own on the server of ``DLOCK_POSTGRES_URL``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from celery_dlock import AsyncLock, Holder, Lease, Lock, Outcome
from tests.support import force_release
from tests.support.services import lease_session_pids

pytest.importorskip("psycopg")

from celery_dlock.backends.postgres import PostgresBackend

#: Seconds to wait for a report due within about a second: generous, never slept through.
_REPORTED_WITHIN = 10.0


class Reports:
    """An ``on_lost`` that keeps the leases reported and sets an event."""

    def __init__(self) -> None:
        self.leases: list[Lease] = []
        self.event = threading.Event()

    def __call__(self, lease: Lease) -> None:
        self.leases.append(lease)
        self.event.set()


def test_a_force_released_lease_without_ttl_is_reported_lost_to_its_idle_holder(
    backends: Callable[[], PostgresBackend], admin: Any, schema: str
) -> None:
    holding, operator = backends(), backends()
    reports = Reports()
    lock = Lock(holding, "job:forced", None, on_lost=reports)
    lease = lock.acquire()
    assert lease.expires_at is None
    record = force_release(operator, "job:forced", "stuck, says the operator")
    assert record is not None and record.outcome == Outcome.FORCED
    assert record.lease.token == lease.token
    assert reports.event.wait(_REPORTED_WITHIN), "on_lost of the force-released lease"
    assert reports.leases == [lease]
    assert lock.lost
    assert lease_session_pids(admin, schema, lease.fence) == []  # the sweep let go of it
    assert lock.release() is None  # lost: nothing of ours to release
    outcomes = [r.outcome for r in operator.history(key="job:forced")]
    assert outcomes == [Outcome.LOST, Outcome.FORCED]  # the holder's release, recorded lost


def test_a_lease_ended_by_its_token_and_taken_by_another_holder_is_reported_lost(
    backends: Callable[[], PostgresBackend],
) -> None:
    holding, other = backends(), backends()
    reports = Reports()
    lock = Lock(holding, "job:ended", None, on_lost=reports)
    lease = lock.acquire()
    assert other.release(lease, Outcome.FAILED, "ended elsewhere") is not None
    taken = other.try_acquire("job:ended", Holder.current(), None)
    assert taken is not None and taken.fence > lease.fence
    assert reports.event.wait(_REPORTED_WITHIN), "on_lost of the lease ended elsewhere"
    assert reports.leases == [lease] and lock.lost
    assert other.get("job:ended") == taken  # the new holder keeps the key
    lock.release()
    assert other.get("job:ended") == taken


def test_leases_released_by_their_holder_are_not_reported_lost(
    backends: Callable[[], PostgresBackend],
) -> None:
    holding, operator = backends(), backends()
    reports = Reports()
    released = Lock(holding, "job:mine", None, on_lost=reports)
    released.acquire()
    assert released.release() is not None
    # Released by the store while still watched: the sweeps must tell it from one ended
    # elsewhere (this process let go of its advisory lock with the release).
    raw = holding.try_acquire("job:raw", Holder.current(), None)
    assert raw is not None
    unwatch = holding.watch(raw, reports)
    assert unwatch is not None
    assert holding.release(raw, Outcome.SUCCEEDED) is not None
    # A marker: once its force release is reported, the watcher has swept after both.
    marker = Lock(holding, "job:marker", None, on_lost=reports)
    marked = marker.acquire()
    assert force_release(operator, "job:marker", "marker") is not None
    assert reports.event.wait(_REPORTED_WITHIN), "on_lost of the marker"
    assert reports.leases == [marked]
    assert not released.lost and marker.lost
    assert marker.release() is None  # lost: nothing of ours to release
    unwatch()


def test_a_force_released_async_lease_is_reported_lost_to_its_idle_holder(
    backends: Callable[[], PostgresBackend],
) -> None:
    holding, operator = backends(), backends()
    reports = Reports()

    async def scenario() -> None:
        lock = AsyncLock(holding, "job:aio-forced", on_lost=reports)
        lease = await lock.acquire()
        assert lease.expires_at is None
        record = await asyncio.to_thread(force_release, operator, "job:aio-forced", "stuck")
        assert record is not None and record.lease.token == lease.token
        for _ in range(int(_REPORTED_WITHIN / 0.05)):
            if reports.event.is_set():
                break
            await asyncio.sleep(0.05)
        assert reports.leases == [lease] and lock.lost
        assert await lock.release() is None

    asyncio.run(scenario())
