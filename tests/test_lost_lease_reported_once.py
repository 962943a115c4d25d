"""A lease lost because its Postgres lock session ended is reported once: one ``was lost``
error, one ``dlock_leases_lost_total``, one ``on_lost``, whichever of the renewal and the
session's watcher notices first (an AsyncLock has both), and its release then says it at a
warning only. The session is ended with ``pg_terminate_backend`` just after a renewal
succeeded; every wait is on state (the lease renewed, the session gone from the server, a
log record, a task ended)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_dlock import AsyncLock, Holder, Lease, Lock, metrics
from celery_dlock.backends.postgres import PostgresBackend
from celery_dlock.backends.postgres import aio as postgres_aio
from tests.backends.stores.postgres import admin_connection, schema_store
from tests.support.services import POSTGRES_URL, lease_session_pids

prometheus_client = pytest.importorskip("prometheus_client")

#: A guard against a hang, not a measure.
HANG = 30.0


@pytest.fixture
def registry() -> Iterator[Any]:
    """The metrics, in a registry of this test's own; those made before (by another test)
    are set aside for the test and put back after (as tests/backends/test_take_over_metric.py)."""
    saved, children, was_on = dict(metrics._metrics), dict(metrics._children), metrics.enabled()
    metrics.disable()
    metrics._metrics.clear()
    metrics._children.clear()
    own = prometheus_client.CollectorRegistry()
    metrics.enable(own)
    try:
        yield own
    finally:
        metrics.disable()
        metrics._metrics.clear()
        metrics._metrics.update(saved)
        metrics._children.clear()
        metrics._children.update(children)
        if was_on:
            metrics.enable()


@pytest.fixture
def store() -> Iterator[PostgresBackend]:
    with schema_store(POSTGRES_URL) as case:
        assert isinstance(case.backend, PostgresBackend)
        yield case.backend


@pytest.fixture
def admin() -> Iterator[Any]:
    conn = admin_connection()
    try:
        yield conn
    finally:
        conn.close()


def lost_count(registry: Any, task: str) -> float:
    return registry.get_sample_value("dlock_leases_lost_total", {"task": task}) or 0.0


def lost_errors(caplog: pytest.LogCaptureFixture, lease: Lease) -> list[logging.LogRecord]:
    """The ERROR records that say ``lease`` was lost (by either path, or by its release)."""
    return [
        record
        for record in caplog.records
        if record.levelno >= logging.ERROR
        and "was lost" in record.getMessage()
        and f"(fence {lease.fence})" in record.getMessage()
    ]


def by_watcher(record: logging.LogRecord) -> bool:
    return "its session ended" in record.getMessage()


def end_session(admin: Any, store: PostgresBackend, lease: Lease) -> None:
    """End the lock session that keeps ``lease`` alive, and see it gone from the server (so
    that what it had to say, its FATAL message and the end of its socket, has been sent)."""
    [pid] = lease_session_pids(admin, store.schema, lease.fence)
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    deadline = time.monotonic() + HANG
    while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
        assert time.monotonic() < deadline, f"backend {pid} still there"
        time.sleep(0.005)


async def until(check: Callable[[], bool]) -> None:
    """Let the loop run until ``check()`` is true."""
    async with asyncio.timeout(HANG):
        while not check():
            await asyncio.sleep(0.005)


def renewing(key: str) -> bool:
    return any(task.get_name() == f"dlock-renew:{key}" for task in asyncio.all_tasks())


def watching() -> bool:
    """Whether a Postgres session watcher task still runs on this loop (it ends once it
    has nothing left to watch: the lost lease popped, reported or not)."""
    coros = [task.get_coro() for task in asyncio.all_tasks()]
    return any(getattr(coro, "__qualname__", "") == "_Loop.watch" for coro in coros)


async def renewed(lock: AsyncLock, lease: Lease) -> Lease:
    """The lease once a background renewal succeeded (its expiry moved)."""
    await until(lambda: lock.lease is not None and lock.lease.expires_at != lease.expires_at)
    assert lock.lease is not None
    return lock.lease


@pytest.mark.parametrize("first", ["renewal", "watcher"])
def test_an_async_lease_whose_session_ends_is_reported_lost_once(
    store: PostgresBackend,
    admin: Any,
    registry: Any,
    *,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    first: str,
) -> None:
    """Renewal first: the watcher's look at the session is held back (``has_ended`` answers
    "not yet") until the renewal has reported, then let go. Watcher first: renewals come
    every 2 s, the watcher looks every second (``WATCH_EVERY``), so it finds the session
    gone before the next renewal finds the lease gone."""
    task = f"t.lost.{first}.{uuid.uuid4().hex[:6]}"
    key = f"job:lost-once:{uuid.uuid4().hex[:8]}"
    held_back = threading.Event()
    if first == "renewal":
        real = postgres_aio.has_ended
        held_back.set()
        monkeypatch.setattr(
            postgres_aio,
            "has_ended",
            lambda conn, notice: False if held_back.is_set() else real(conn, notice),
        )
    ttl = 0.3 if first == "renewal" else 6.0
    called: list[Lease] = []

    async def scenario() -> Lease:
        lock = AsyncLock(
            store, key, ttl=ttl, holder=Holder.current(task_name=task), on_lost=called.append
        )
        lease = await renewed(lock, await lock.acquire())
        end_session(admin, store, lease)
        await until(lambda: bool(lost_errors(caplog, lease)))
        held_back.clear()
        await until(lambda: not renewing(key))  # the renewal found it gone too...
        await until(lambda: not watching())  # ...and the watcher had its look
        [report] = lost_errors(caplog, lease)
        assert by_watcher(report) is (first == "watcher")
        assert lock.lost and [c.token for c in called] == [lease.token]
        assert await lock.release() is None
        return lease

    with caplog.at_level(logging.WARNING):
        lease = asyncio.run(scenario())
    assert len(lost_errors(caplog, lease)) == 1  # the release says it at a warning
    assert lost_count(registry, task) == 1
    assert len(called) == 1
    [said] = [r for r in caplog.records if "was lost before release" in r.getMessage()]
    assert said.levelno == logging.WARNING


@pytest.mark.parametrize("ttl", [0.6, None], ids=["renewed", "session-only"])
def test_a_lease_whose_session_ends_is_reported_lost_once(
    store: PostgresBackend,
    admin: Any,
    registry: Any,
    caplog: pytest.LogCaptureFixture,
    ttl: float | None,
) -> None:
    """The blocking Lock: renewed (a thread renews it; no watcher) or not (the session's
    watcher alone)."""
    task = f"t.lost.sync.{uuid.uuid4().hex[:6]}"
    key = f"job:lost-once:{uuid.uuid4().hex[:8]}"
    called: list[Lease] = []
    reported = threading.Event()

    def on_lost(lease: Lease) -> None:
        called.append(lease)
        reported.set()

    with caplog.at_level(logging.WARNING):
        lock = Lock(store, key, ttl=ttl, holder=Holder.current(task_name=task), on_lost=on_lost)
        lease = lock.acquire()
        if ttl is not None:
            deadline = time.monotonic() + HANG
            while lock.lease is not None and lock.lease.expires_at == lease.expires_at:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        end_session(admin, store, lease)
        assert reported.wait(HANG)
        assert lock.lost
        assert lock.release() is None
    assert len(lost_errors(caplog, lease)) == 1
    assert lost_count(registry, task) == 1
    assert [c.token for c in called] == [lease.token]
    [said] = [r for r in caplog.records if "was lost before release" in r.getMessage()]
    assert said.levelno == logging.WARNING
