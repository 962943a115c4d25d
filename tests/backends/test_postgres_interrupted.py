"""Postgres: a statement on the lock session cut by an exception raised while it waits for
its answer (a Celery soft time limit comes as one: billiard's SIGUSR1 handler raises
``SoftTimeLimitExceeded`` wherever the main thread is). Its answer is never read, and the
session answered every later statement with "another command is already in progress" for
the rest of the process's life: a worker child that could take no lock again. The session
is now dropped as if it had ended, and a new one opens for the next call.

Each test holds a statement up with a row lock taken by another connection, and cuts it
with a signal whose handler raises, in a schema of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from celery_dlock import Holder, Lease, Outcome
from tests.backends.stores.postgres import SERVER_URL, admin_connection, schema_store
from tests.support import eventually
from tests.support.cuts import cut_after
from tests.support.services import row_locked

pytest.importorskip("psycopg")

from celery_dlock.backends.postgres import PostgresBackend
from celery_dlock.backends.postgres.sql import Names


@pytest.fixture(params=[{}, {"liveness": "ttl", "ttl": 30}], ids=["session", "ttl"])
def backend(request: pytest.FixtureRequest) -> Iterator[PostgresBackend]:
    with schema_store(SERVER_URL, **request.param) as case:
        assert isinstance(case.backend, PostgresBackend)
        yield case.backend


def _cycle(backend: PostgresBackend, key: str) -> None:
    lease = backend.try_acquire(key, Holder.current(), None)
    assert lease is not None, f"{key} was not granted"
    record = backend.release(lease, Outcome.SUCCEEDED)
    assert record is not None and record.outcome is Outcome.SUCCEEDED


@pytest.mark.parametrize("operation", ["release", "renew"])
def test_a_statement_cut_while_it_waits_leaves_the_store_usable(
    backend: PostgresBackend, operation: str
) -> None:
    key = "job:cut"
    lease = backend.try_acquire(key, Holder.current(), 30)
    assert lease is not None
    schema = backend.schema
    with row_locked(schema, key):
        if operation == "release":
            cut_after(0.3, lambda: backend.release(lease, Outcome.SUCCEEDED))
        else:
            cut_after(0.3, lambda: backend.renew(lease, 60))
    for n in range(3):  # each on the lock session; before, each raised BackendError
        _cycle(backend, f"job:after-{n}")
    other = PostgresBackend.from_url(backend.url)
    try:
        _the_cut_lease_ended_or_goes(backend, other, lease, operation)
    finally:
        other.close()


def _the_cut_lease_ended_or_goes(
    backend: PostgresBackend, other: PostgresBackend, lease: Lease, operation: str
) -> None:
    """A cut release landed once the row was free (the server went on with it); a cut
    renewal's lease was held by the dropped session: another process takes it over at
    once with session liveness, recorded ``disconnected``, and by its ttl with ``ttl``."""
    if operation == "release":
        [record] = other.history(key=lease.key)
        assert (record.outcome, record.lease.token) == (Outcome.SUCCEEDED, lease.token)
        assert other.get(lease.key) is None
        return
    held = other.get(lease.key)
    assert held is not None and held.token == lease.token
    if backend.capabilities.liveness == "lease":  # liveness=ttl: it lives its ttl out
        assert held.expires_at is not None and held.expires_at < time.time() + 61
        return
    deadline = time.monotonic() + 10
    taken = other.try_acquire(lease.key, Holder.current(), None)
    while taken is None and time.monotonic() < deadline:  # the server ends the old backend
        time.sleep(0.05)
        taken = other.try_acquire(lease.key, Holder.current(), None)
    assert taken is not None, "the dropped session's lease was never freed"
    [record] = other.history(key=lease.key)
    assert (record.outcome, record.lease.token) == (Outcome.DISCONNECTED, lease.token)


def test_a_cut_acquire_is_not_left_held_by_a_live_session(backend: PostgresBackend) -> None:
    """An acquire that waits on a row (the key's expired lease, locked by another
    connection) and is cut: whatever it did on the server is not held for this process."""
    key = "job:cut-acquire"
    old = backend.try_acquire(key, Holder.current(), 0.2)
    assert old is not None
    time.sleep(0.4)  # expired: the next acquire takes it over, and must update its row
    with row_locked(backend.schema, key):
        cut_after(0.3, lambda: backend.try_acquire(key, Holder.current(), None))
    _cycle(backend, "job:after-acquire")
    other = PostgresBackend.from_url(backend.url)
    try:
        if backend.capabilities.liveness == "lease":  # liveness=ttl: it lives its ttl out
            held = other.get(key)
            assert held is None or (held.expires_at or 0) < time.time() + 31
            return
        deadline = time.monotonic() + 10
        taken = other.try_acquire(key, Holder.current(), None)
        while taken is None and time.monotonic() < deadline:
            time.sleep(0.05)
            taken = other.try_acquire(key, Holder.current(), None)
        assert taken is not None, "the cut acquire left the key held"
    finally:
        other.close()


def test_threads_of_the_session_keep_working_while_the_main_thread_is_cut(
    backend: PostgresBackend,
) -> None:
    """The cut is the main thread's (a signal's); a renewal thread's statements after it
    go through the new session."""
    key = "job:cut-threads"
    lease = backend.try_acquire(key, Holder.current(), 30)
    assert lease is not None
    with row_locked(backend.schema, key):
        cut_after(0.3, lambda: backend.release(lease, Outcome.SUCCEEDED))
    errors: list[BaseException] = []

    def cycles() -> None:
        try:
            for n in range(3):
                _cycle(backend, f"job:thread-{n}")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=cycles)
    thread.start()
    thread.join(30)
    assert errors == []


def test_a_wait_cut_while_the_server_waits_leaves_the_keys_queue(
    backend: PostgresBackend,
) -> None:
    """The waiter connection of a cut wait still waited on the server, first in the key's
    queue, while its place was alive (until the exception and its traceback were dropped):
    the next waiters of the key, queued behind it, fell back to polling after a release
    (measured with a probe: 70-370 ms from the release to the next grant, against 4-8 ms).
    The cut connection is now closed: its place in the queue ends with the release."""
    key = "job:cut-wait"
    lease = backend.try_acquire(key, Holder.current(), None)
    assert lease is not None
    cut = cut_after(0.3, lambda: backend.wait(key, 10))
    assert backend.release(lease, Outcome.SUCCEEDED) is not None
    admin = admin_connection()
    try:
        queue = Names(backend.schema, "").key_space("queue") & 0xFFFFFFFF

        def queue_free() -> bool:
            [row] = admin.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 "
                "AND classid = %s::oid AND objid = (hashtext(%s)::int8 & 4294967295)::oid",
                (queue, key),
            ).fetchall()
            return int(row[0]) == 0

        eventually(queue_free, "the cut waiter's place in the key's queue ended", timeout=10)
    finally:
        admin.close()
    assert cut.__traceback__ is not None  # kept alive until here, as Celery keeps it
