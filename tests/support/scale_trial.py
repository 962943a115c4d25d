"""Helpers of the scale trial (tests/backends/test_scale_trial.py): a PgBouncer whose
configuration a test chooses (an admin console, ``ignore_startup_parameters``), a login role
with a ``CONNECTION LIMIT``, and a look at every server connection of a pool.

``tests.support.pgbouncer`` starts the stock configuration that most tests need; a test here
needs lines of its own in ``pgbouncer.ini`` and the admin console (``KILL``, ``RESUME``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from psycopg.conninfo import conninfo_to_dict

from tests.support.pgbouncer import pgbouncer
from tests.support.services import POSTGRES_URL


@dataclass(frozen=True)
class Bouncer:
    """A private PgBouncer: the URL of the test database through it, and its console."""

    url: str
    port: int

    def console(self, command: str) -> list[tuple[Any, ...]]:
        """Run ``command`` (``KILL test``, ``RESUME``, ``SHOW POOLS``) on the admin console,
        which speaks the simple query protocol only (a ``ClientCursor``)."""
        import psycopg

        with psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{self.port}/pgbouncer", autocommit=True
        ) as conn:
            cursor = psycopg.ClientCursor(conn)
            cursor.execute(command)
            return cursor.fetchall() if cursor.description else []


@contextlib.contextmanager
def bouncer(mode: str, pool_size: int, **settings: str) -> Iterator[Bouncer]:
    """A PgBouncer in pool ``mode`` with ``pool_size`` server connections in front of the
    test server, ``settings`` added to its ``[pgbouncer]`` section, and its admin console;
    stopped on exit."""
    user = conninfo_to_dict(POSTGRES_URL).get("user", "postgres")
    with pgbouncer(mode, pool_size, admin_users=user, **settings) as url:
        port = conninfo_to_dict(url)["port"]
        yield Bouncer(url, int(port))


def server_connections(url: str, count: int) -> list[dict[str, Any]]:
    """What each of ``count`` server connections of a pool holds: ``count`` clients of the
    pooler at ``url`` each keep a transaction open at once, so each has a server connection
    of its own, and report its backend pid, prepared statements, advisory locks and the
    settings a client could have left on it."""
    import psycopg

    clients = [psycopg.connect(url, prepare_threshold=None) for _ in range(count)]
    try:
        found = []
        for conn in clients:
            row = conn.execute(
                "SELECT pg_backend_pid(), "
                "(SELECT count(*) FROM pg_prepared_statements), "
                "(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                "AND pid = pg_backend_pid()), "
                "current_setting('synchronous_commit'), current_setting('lock_timeout'), "
                "current_setting('idle_session_timeout')"
            ).fetchone()
            assert row is not None
            names = ("pid", "prepared", "advisory", "synchronous_commit", "lock_timeout", "idle")
            found.append(dict(zip(names, row, strict=True)))
        return found
    finally:
        for conn in clients:
            conn.rollback()
            conn.close()


@contextlib.contextmanager
def limited_role(admin: Any, schema: str, limit: int) -> Iterator[str]:
    """A login role with ``CONNECTION LIMIT limit`` and the rights the store uses on
    ``schema`` (migrated); its sessions ended and the role dropped on exit."""
    name = f"dlock_scale_{os.urandom(4).hex()}"
    admin.execute(f'CREATE ROLE "{name}" LOGIN CONNECTION LIMIT {limit}')
    try:
        admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{name}"')
        admin.execute(
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" TO "{name}"'
        )
        admin.execute(
            f'GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA "{schema}" TO "{name}"'
        )
        yield name
    finally:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,)
        )
        admin.execute(f'DROP OWNED BY "{name}" CASCADE')
        admin.execute(f'DROP ROLE "{name}"')
