"""``record_success``: a ``once`` success written in the app's own transaction on the lock
store's Postgres, so that the effect and its memory commit or roll back together.

The app's "charges" table lives in the test schema beside the store's tables; every write
goes through a connection of the app's own (psycopg, or SQLAlchemy on psycopg)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from celery_dlock import AlreadySucceededError, ConfigurationError, Holder, Lock, Outcome
from celery_dlock.backends.memory import MemoryBackend
from tests.backends.stores.postgres import SERVER_URL, admin_connection, drop_schema, with_options
from tests.support import eventually
from tests.support.services import lease_session_pids

psycopg = pytest.importorskip("psycopg")

from celery_dlock.backends.postgres import PostgresBackend  # noqa: E402

TASK = "payments.charge"


@pytest.fixture
def schema() -> Iterator[str]:
    admin = admin_connection()
    name = f"dlock_t_{os.urandom(6).hex()}"
    try:
        yield name
    finally:
        drop_schema(admin, name)
        admin.close()


@pytest.fixture
def backend(schema: str) -> Iterator[PostgresBackend]:
    made = PostgresBackend.from_url(with_options(SERVER_URL, schema=schema))
    made.migrate()
    with psycopg.connect(SERVER_URL, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{schema}".charges (key text, token text)')
    yield made
    made.close()


def charges(schema: str) -> list[str]:
    with psycopg.connect(SERVER_URL) as conn:
        rows = conn.execute(f'SELECT token FROM "{schema}".charges').fetchall()
    return [str(row[0]) for row in rows]


def charge(conn: Any, schema: str, lock: Lock, result: Any) -> None:
    """The app's transaction: the charge and its success, on its own connection."""
    lease = lock.lease
    assert lease is not None
    conn.execute(f'INSERT INTO "{schema}".charges VALUES (%s, %s)', (lease.key, lease.token))
    lock.record_success(conn, result)


def test_the_success_commits_with_the_charge(backend: PostgresBackend, schema: str) -> None:
    lock = Lock(backend, "job:order:1", holder=Holder.current(task_name=TASK))
    lease = lock.acquire()
    with psycopg.connect(SERVER_URL) as conn:
        charge(conn, schema, lock, {"value": "ch_1"})
        assert backend.last_success("job:order:1", TASK) is None  # not committed yet
    kept = backend.last_success("job:order:1", TASK)
    assert kept is not None and kept.lease.token == lease.token
    assert kept.result == {"value": "ch_1"} and kept.outcome is Outcome.SUCCEEDED
    assert charges(schema) == [lease.token]
    assert lock.release(Outcome.SUCCEEDED, result={"value": "ch_1"}) is not None


def test_a_rolled_back_charge_leaves_no_success(backend: PostgresBackend, schema: str) -> None:
    lock = Lock(backend, "job:order:2", holder=Holder.current(task_name=TASK))
    lock.acquire()
    with psycopg.connect(SERVER_URL) as conn:
        charge(conn, schema, lock, {"value": "ch_2"})
        conn.rollback()  # the app's own failure after the write: nothing of it stays
    assert backend.last_success("job:order:2", TASK) is None
    assert charges(schema) == []
    lock.release(Outcome.FAILED, "GatewayError", "timeout")


def test_a_second_charge_after_a_lost_lease_is_refused_in_its_own_transaction(
    backend: PostgresBackend, schema: str
) -> None:
    """The double charge of a lost lease, both bodies running: A's session ends mid-body and B
    takes the key; A commits its charge with its success first; B's transaction, which saw
    no success when it began, is refused at its commit-time insert, and rolls back."""
    admin = admin_connection()
    first = Lock(backend, "job:order:3", holder=Holder.current(task_name=TASK))
    a = first.acquire()
    [pid] = lease_session_pids(admin, schema, a.fence)
    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    eventually(lambda: not lease_session_pids(admin, schema, a.fence), "A's session ended")
    admin.close()
    other = PostgresBackend.from_url(with_options(SERVER_URL, schema=schema))
    second = Lock(other, "job:order:3", holder=Holder.current(task_name=TASK))
    b = second.acquire()
    assert b.fence > a.fence
    try:
        assert other.last_success("job:order:3", TASK) is None  # B's once check: nothing yet
        with psycopg.connect(SERVER_URL) as conn_a, psycopg.connect(SERVER_URL) as conn_b:
            conn_b.execute(f'INSERT INTO "{schema}".charges VALUES (%s, %s)', ("k", b.token))
            charge(conn_a, schema, first, {"value": "ch_a"})
            conn_a.commit()
            with pytest.raises(AlreadySucceededError) as refused:
                second.record_success(conn_b, {"value": "ch_b"})
            conn_b.rollback()
        assert refused.value.key == "job:order:3" and refused.value.fence == a.fence
        assert charges(schema) == [a.token]
        kept = other.last_success("job:order:3", TASK)
        assert kept is not None and kept.lease.token == a.token
        assert first.release(Outcome.SUCCEEDED, result={"value": "ch_a"}) is None  # lost
        second.release(Outcome.SKIPPED, "once")
    finally:
        other.close()


def test_a_sqlalchemy_session_commits_the_success_with_its_work(
    backend: PostgresBackend, schema: str
) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    engine = sqlalchemy.create_engine(SERVER_URL.replace("postgresql://", "postgresql+psycopg://"))
    lock = Lock(backend, "job:order:4", holder=Holder.current(task_name=TASK))
    lease = lock.acquire()
    try:
        with Session(engine) as session:
            session.execute(
                sqlalchemy.text(f'INSERT INTO "{schema}".charges VALUES (:key, :token)'),
                {"key": lease.key, "token": lease.token},
            )
            lock.record_success(session, {"value": "ch_4"})
            session.rollback()
        assert backend.last_success("job:order:4", TASK) is None
        with Session(engine) as session, session.begin():
            session.execute(
                sqlalchemy.text(f'INSERT INTO "{schema}".charges VALUES (:key, :token)'),
                {"key": lease.key, "token": lease.token},
            )
            lock.record_success(session, {"value": "ch_4"})
    finally:
        engine.dispose()
    kept = backend.last_success("job:order:4", TASK)
    assert kept is not None and kept.result == {"value": "ch_4"}
    assert charges(schema) == [lease.token]
    lock.release()


def test_a_connection_to_another_database_is_named_as_the_problem(
    backend: PostgresBackend,
) -> None:
    lock = Lock(backend, "job:order:5", holder=Holder.current(task_name=TASK))
    lock.acquire()
    with psycopg.connect(SERVER_URL.rsplit("/", 1)[0] + "/postgres") as conn:
        with pytest.raises(ConfigurationError, match="does not reach the tables of schema"):
            lock.record_success(conn, {"value": 1})
        conn.rollback()
    lock.release(Outcome.FAILED)


def test_a_store_outside_the_apps_database_refuses_record_success() -> None:
    lock = Lock(MemoryBackend(), "job:order:6", holder=Holder.current(task_name=TASK))
    lock.acquire()
    with pytest.raises(ConfigurationError, match="record_success needs the postgres store"):
        lock.record_success(object(), {"value": 1})
    lock.release(Outcome.FAILED)
