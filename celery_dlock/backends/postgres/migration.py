"""``migrate()``: the store's schema made, or brought to this version, on a live database.

It runs only the statements that change something: ``CREATE SCHEMA IF NOT EXISTS`` needs
CREATE on the database even when the schema exists (a role that owns the schema a DBA made
for it may create nothing else there), and ``CREATE INDEX IF NOT EXISTS`` takes a SHARE lock
on its table before it looks, so it would wait for every open transaction that wrote history
while every acquire and release queued behind it. A table of the store's name that another
application made is refused, not passed over.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

from celery_dlock.backends import mask_url
from celery_dlock.backends.postgres.config import Config, translate
from celery_dlock.backends.postgres.doctor import foreign_tables
from celery_dlock.backends.postgres.functions import functions
from celery_dlock.backends.postgres.sql import ddl
from celery_dlock.errors import ConfigurationError

__all__ = ["migrate"]

_SCHEMA = re.compile(r'CREATE SCHEMA IF NOT EXISTS ("[^"]+")')
_INDEX = re.compile(r'CREATE INDEX IF NOT EXISTS ("[^"]+")')


def migrate(config: Config) -> None:
    """Create what the schema lacks, idempotently; concurrent callers take turns.

    Raises:
        ConfigurationError: a table of the store's name is another application's.
        BackendError: the server refused (its message, and for missing rights, who may).
    """
    statements = config.statements
    names = statements.names
    with config.connect("migrate", autocommit=False) as conn:
        try:
            with conn.transaction():
                conn.execute(f"SELECT pg_advisory_xact_lock({names.ddl_lock_key})")
                row = conn.execute(statements.sequence_exists).fetchone()
                fresh = row is not None and not row[0]
                for statement in ddl(names):
                    if not _exists(conn, names.schema, statement):
                        conn.execute(statement)
                foreign = foreign_tables(conn, names)
                if foreign:
                    raise ConfigurationError(
                        f"{'; '.join(foreign)}: another application's table, which migrate() "
                        "leaves alone: give the store a schema or table_prefix of its own "
                        f"[{mask_url(config.url)}]"
                    )
                for statement in functions(statements):
                    conn.execute(statement)
                if fresh:
                    # A sequence made now has handed out no fence that a crash could lose.
                    conn.execute(statements.mark_guard)
        except psycopg.Error as exc:
            raise translate(exc, "migrate", config.url) from exc


def _exists(conn: psycopg.Connection[Any], schema: str, statement: str) -> bool:
    """Whether the schema or index that ``statement`` creates exists already."""
    made = _SCHEMA.match(statement)
    if made is not None:
        found = conn.execute("SELECT to_regnamespace(%s) IS NOT NULL", (made.group(1),))
        return found.fetchone() == (True,)
    index = _INDEX.match(statement)
    if index is None:
        return False
    name = f'"{schema}".{index.group(1)}'
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone() == (True,)
