"""The test servers, once for every test directory: PostgreSQL (``DLOCK_POSTGRES_URL``,
default 127.0.0.1:5432, database ``test``) and Redis. A server that is not there is a visible
skip (a failure under ``DLOCK_REQUIRE_ALL=1``)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.support import eventually, unavailable

POSTGRES_URL = os.environ.get("DLOCK_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def with_options(url: str, **options: Any) -> str:
    """``url`` with query options added."""
    query = "&".join(f"{name}={value}" for name, value in options.items())
    return f"{url}{'&' if '?' in url else '?'}{query}"


def postgres_admin() -> Any:
    """An autocommit connection to the test server."""
    try:
        import psycopg
    except ImportError:
        unavailable("psycopg is not installed: pip install 'celery-dlock[postgres]'")
    try:
        return psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        unavailable(f"PostgreSQL is not reachable at {POSTGRES_URL}: {exc}".strip())


@contextmanager
def row_locked(schema: str, key: str) -> Iterator[None]:
    """``key``'s lease row in ``schema`` locked by another connection until the block ends:
    the store's statements on that row (a release, a renewal, a take-over) wait."""
    admin = postgres_admin()
    try:
        with admin.transaction():
            admin.execute(f'SELECT FROM "{schema}".locks WHERE key = %s FOR UPDATE', (key,))
            yield
    finally:
        admin.close()


@contextmanager
def migrated_schema(prefix: str) -> Iterator[tuple[str, Any]]:
    """A Postgres store's schema of its own, ``<prefix>_<random>``, migrated: its name and
    an autocommit admin connection (for a test's own objects in it); dropped at the end."""
    from celery_dlock.backends import backend_from_url

    admin = postgres_admin()
    name = f"{prefix}_{os.urandom(4).hex()}"
    store = backend_from_url(with_options(POSTGRES_URL, schema=name))
    try:
        store.migrate()  # type: ignore[attr-defined]
    finally:
        store.close()
    try:
        yield name, admin
    finally:
        drop_schema(admin, name)
        admin.close()


def drop_schema(admin: Any, schema: str) -> None:
    """Drop ``schema`` through ``admin``, or through a new connection when ``admin`` was
    cut: a module's fixture may outlive the exclusive test that restarts the server (seen
    in CI: a teardown error after every test had passed)."""
    import psycopg

    try:
        admin.execute("SET lock_timeout = '20s'")
    except psycopg.OperationalError:
        if not (admin.closed or admin.broken):
            raise
        with postgres_admin() as fresh:
            drop_schema(fresh, schema)
        return
    admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def wait_ended(admin: Any, pid: int, what: str = "the server ended the session") -> None:
    """Wait until the server's session ``pid`` has left ``pg_stat_activity`` (a terminated
    or closed client's session ends in the server's own time, not at once)."""
    eventually(
        lambda: admin.execute(
            "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s)", (pid,)
        ).fetchone()[0],
        what,
    )


def lease_lock(schema: str, fence: int) -> tuple[int, int]:
    """``(classid, objid)`` of a lease's advisory lock in ``pg_locks``: the schema's lease
    space and the fence's low 32 bits."""
    from celery_dlock.backends.postgres.sql import Names

    return Names(schema, "").key_space("lease") & 0xFFFFFFFF, fence & 0xFFFFFFFF


def lease_session_pids(admin: Any, schema: str, fence: int) -> list[int]:
    """Backend pids whose session holds the advisory lock of lease ``fence`` of ``schema``."""
    rows = admin.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted "
        "AND mode = 'ExclusiveLock' AND classid = %s::oid AND objid = %s::oid "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        lease_lock(schema, fence),
    ).fetchall()
    return [int(row[0]) for row in rows]


def promote_a_standby_without(admin: Any, schema: str, fences: list[int]) -> None:
    """Make ``schema`` what a standby promoted by a failover (asynchronous replication) has
    when it never received the grants of ``fences``: none of their rows, the fence sequence
    before them, and an empty guard (unlogged tables start empty on a promoted standby)."""
    admin.execute(f'DELETE FROM "{schema}".locks WHERE fence = ANY(%s)', (fences,))
    admin.execute(f"SELECT setval('\"{schema}\".fence', %s)", (min(fences) - 1,))
    admin.execute(f'TRUNCATE "{schema}".fence_guard')


def redis_client(url: str) -> Any:
    """A client of the Redis at ``url`` that answered a PING."""
    try:
        import redis
    except ImportError:
        unavailable("redis-py is not installed: pip install 'celery-dlock[redis]'")
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        unavailable(f"Redis is not reachable at {url}: {exc}")
    return client


def peak_sessions(admin: Any, application_name: str, processes: list[subprocess.Popen[Any]]) -> int:
    """The most server sessions named ``application_name`` seen at once while any of
    ``processes`` runs (sampled every 50 ms): what a pooler lets through to the server."""
    peak = 0
    while any(process.poll() is None for process in processes):
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            (application_name,),
        ).fetchone()
        peak = max(peak, int(row[0]))
        time.sleep(0.05)
    return peak
