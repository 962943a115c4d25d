"""The SQL functions tried as a client in another language would use them, with psycopg
sessions standing for that client: a transaction rolled back after ``acquire``, a lease
released from another session (a connection pool), a session that ends holding a lease,
wrong tokens and double releases, bad arguments, and a Python ``Lock`` on the same key."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from celery_dlock import Lock, LockNotAcquiredError, Outcome
from celery_dlock.backends.postgres import PostgresBackend
from celery_dlock.backends.postgres.sql import Names
from tests.backends.stores.postgres import SERVER_URL
from tests.support import eventually


@pytest.fixture
def store(postgres_backend: PostgresBackend, schema: str) -> tuple[PostgresBackend, str]:
    """A migrated backend and its schema (``tests/backends/conftest.py``)."""
    return postgres_backend, schema


def session() -> psycopg.Connection[Any]:
    return psycopg.connect(SERVER_URL, autocommit=True)


def lease_locks(conn: psycopg.Connection[Any], schema: str) -> set[int]:
    """The low 32 bits of the fences whose lease advisory lock ``conn``'s session holds."""
    space = Names(schema, "").key_space("lease") & 0xFFFFFFFF
    rows = conn.execute(
        "SELECT objid::int8 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 "
        "AND granted AND classid = %s::oid AND pid = pg_backend_pid()",
        (space,),
    ).fetchall()
    return {int(row[0]) for row in rows}


def test_acquire_lets_go_of_the_advisory_locks_of_leases_its_session_no_longer_holds(
    store: tuple[PostgresBackend, str],
) -> None:
    """Found by trying: an acquire rolled back, or a lease released from another pooled
    connection, left its advisory lock on the acquiring session for as long as that session
    lived: one more lock per such lease in a pool's long-lived connections."""
    backend, schema = store
    with session() as a, session() as b:
        with a.transaction():
            [(_, rolled_back)] = a.execute(
                f"SELECT * FROM {schema}.acquire('job:a', 'report', NULL)"
            ).fetchall()
            raise psycopg.Rollback()  # the client's transaction fails after the acquire
        assert lease_locks(a, schema) == {rolled_back}  # no lease, yet its lock
        [(token, elsewhere)] = a.execute(
            f"SELECT * FROM {schema}.acquire('job:b', 'report', NULL)"
        ).fetchall()
        assert lease_locks(a, schema) == {elsewhere}
        assert b.execute(f"SELECT {schema}.release('job:b', %s)", (token,)).fetchone() == (
            "succeeded",
        )
        assert lease_locks(a, schema) == {elsewhere}  # b cannot unlock a's session
        [(token, fence)] = a.execute(
            f"SELECT * FROM {schema}.acquire('job:c', 'report', NULL)"
        ).fetchall()
        assert lease_locks(a, schema) == {fence}
        held = backend.get("job:c")
        assert held is not None and held.token == token  # and its own lease is alive
        with pytest.raises(LockNotAcquiredError):
            Lock(backend, "job:c").acquire()


def test_acquire_names_the_argument_that_is_missing_or_too_long(
    store: tuple[PostgresBackend, str],
) -> None:
    """Found by trying: NULL or empty key and holder all said "acquire needs a key and a
    holder", and a holder of any length went into every lease and record."""
    backend, schema = store
    cases = {
        "NULL, 'me'": "the key is NULL",
        "'', 'me'": "the key is empty",
        "'job:k', NULL": "the holder is NULL",
        "'job:k', ''": "the holder is empty",
    }
    with session() as conn:
        for arguments, message in cases.items():
            with pytest.raises(psycopg.errors.NullValueNotAllowed, match=message):
                conn.execute(f"SELECT * FROM {schema}.acquire({arguments})")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="holder is at most"):
            conn.execute(f"SELECT * FROM {schema}.acquire('job:k', repeat('h', 1025))")
        conn.execute(f"SELECT * FROM {schema}.acquire('job:k', repeat('h', 1024))")
        held = backend.get("job:k")
        assert held is not None and held.holder.worker == "h" * 1024


def test_wrong_tokens_sessions_that_end_and_python_holders_as_documented(
    store: tuple[PostgresBackend, str],
) -> None:
    """Pins behaviour that held: a wrong token or a second release changes nothing and
    returns NULL; a session that ends holding a lease is taken over and recorded
    ``disconnected``; Python and SQL holders exclude each other both ways and share one
    rising fence."""
    backend, schema = store
    fences = []
    with session() as a, session() as b:
        [(token, fence)] = a.execute(f"SELECT * FROM {schema}.acquire('job:k', 'a')").fetchall()
        fences.append(fence)
        assert b.execute(f"SELECT {schema}.release('job:k', 'not-it')").fetchone() == (None,)
        assert b.execute(f"SELECT * FROM {schema}.acquire('job:k', 'b')").fetchall() == []
        with pytest.raises(LockNotAcquiredError):
            Lock(backend, "job:k").acquire()
        a.close()  # ends holding the lease (its server process exits a moment later)
        acquire = f"SELECT * FROM {schema}.acquire('job:k', 'b')"
        [(taken, fence)] = eventually(lambda: b.execute(acquire).fetchall(), "a's session ended")
        fences.append(fence)
        [ended] = backend.history(key="job:k", outcome=Outcome.DISCONNECTED)
        assert ended.lease.token == token
        assert b.execute(f"SELECT {schema}.release('job:k', %s)", (taken,)).fetchone() == (
            "succeeded",
        )
        assert b.execute(f"SELECT {schema}.release('job:k', %s)", (taken,)).fetchone() == (None,)
        with Lock(backend, "job:k") as lease:
            fences.append(lease.fence)
            assert b.execute(f"SELECT * FROM {schema}.acquire('job:k', 'b')").fetchall() == []
        [(_, fence)] = b.execute(f"SELECT * FROM {schema}.acquire('job:k', 'b')").fetchall()
        fences.append(fence)
    assert fences == sorted(set(fences))
