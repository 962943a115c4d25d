"""Postgres: a lease handed over while another session is taking its key is never taken as
``disconnected``.

Found by the dedupe soak (``python -m bench.torture.dedupesoak --mode until_finished
--store postgres``): about one dedupe mark in 200 ended ``disconnected`` 3 ms after its
producer took it ("the lock session of the holder ... ended", that session alive), and a
second message was sent while the first was queued. The producer hands the mark over after
its send (``hand_over``: the row's ``backend_pid`` set to 0 and the session's advisory lock let
go, in one statement); a duplicate's ``take_over`` read the row as of its statement's start
(the producer's pid) and ``pg_locks`` after the hand-over (no advisory lock): a dead holder,
by its rule. Its UPDATE then found the row changed by a committed hand-over and, its token
the same, took it.

The race is placed, not waited for: the duplicate's ``take_over`` (the store's own
statement, on a connection of its own) starts and then waits for the key's grant lock,
which the test holds, while the holder hands the lease over through the backend.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from celery_dlock import Holder, Outcome
from tests.support import eventually
from tests.support.services import postgres_admin

psycopg = pytest.importorskip("psycopg")

from celery_dlock.backends.postgres import PostgresBackend  # noqa: E402

Backends = Callable[..., PostgresBackend]


def waiting_for_a_lock(admin: Any, pid: int) -> bool:
    row = admin.execute(
        "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (pid,)
    ).fetchone()
    return bool(row[0])


def test_a_take_over_begun_before_a_hand_over_leaves_the_lease_handed_over(
    backends: Backends, admin: Any
) -> None:
    holder_store = backends()
    key = "job:mark#queued:sync"
    lease = holder_store.try_acquire(key, Holder.current(task_id="first"), 60.0)
    assert lease is not None
    sql = holder_store._sql  # the store's statements, as its own sessions run them
    grant = sql.names.key_space("grant")
    admin.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (grant, key))
    other = postgres_admin()  # a session of its own, as a second process's
    duplicate = Holder.current(task_id="second")
    params: dict[str, Any] = {
        "key": key, "token": uuid.uuid4().hex, "ttl": 60.0, "holder": duplicate.to_json(),
        "replace": None, "retried": None, "held": [],
    }  # fmt: skip
    taken: list[Any] = []
    try:
        pid = other.execute("SELECT pg_backend_pid()").fetchone()[0]
        thread = threading.Thread(
            target=lambda: taken.append(other.execute(sql.take_over, params).fetchall())
        )
        thread.start()  # its snapshot taken, it waits for the grant lock
        eventually(lambda: waiting_for_a_lock(admin, pid), "the take-over waiting")

        handed = holder_store.hand_over(lease, 3600.0, if_unchanged=True)
        assert handed is not None and handed.token == lease.token
        admin.execute("SELECT pg_advisory_unlock(%s, hashtext(%s))", (grant, key))
        thread.join(30)
        assert not thread.is_alive()
    finally:
        admin.execute("SELECT pg_advisory_unlock_all()")
        other.close()

    assert taken == [[]]  # no row: the key is held
    current = holder_store.get(key)
    assert current is not None and current.token == lease.token  # still the first's
    assert current.expires_at is not None and current.expires_at > lease.acquired_at + 3000
    assert holder_store.history(key=key, limit=None) == []  # nothing recorded disconnected
    holder_store.release(lease, Outcome.SUCCEEDED)
    assert [r.outcome for r in holder_store.history(key=key, limit=None)] == [Outcome.SUCCEEDED]
