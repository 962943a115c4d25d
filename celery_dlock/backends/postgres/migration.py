"""``migrate()``: the store's schema made, or brought to this version, on a live database.

It runs only the statements that change something: ``CREATE SCHEMA IF NOT EXISTS`` needs
CREATE on the database even when the schema exists (a role that owns the schema a DBA made
for it may create nothing else there), and ``CREATE INDEX IF NOT EXISTS`` takes a SHARE lock
on its table before it looks, so it would wait for every open transaction that wrote history
while every acquire and release queued behind it. A table of the store's name that another
application made is refused, not passed over.

The schema carries its version, :data:`SCHEMA_VERSION`, at the end of the locks table's
comment (``\\dt+``: ``...; schema version 1``). A comment, not a table of its own, and on the
store's table, not on the schema: ``migrate()`` already writes that comment (as the table's
owner), so it needs no new right and no new relation to grant or to declare for Alembic; it is
per store (two table prefixes share a schema; a DBA's schema keeps its own comment); and every
release before the version was recorded rewrites it on its ``migrate()``, so a schema that
such a release has downgraded reads as unrecorded (version 0) instead of carrying a number it
no longer has. ``migrate()`` of this version refuses a schema of a newer version.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

from celery_dlock.backends import mask_url
from celery_dlock.backends.postgres.config import Config, translate
from celery_dlock.backends.postgres.functions import functions
from celery_dlock.backends.postgres.sql import COMMENTS, Names, ddl
from celery_dlock.errors import ConfigurationError

__all__ = ["SCHEMA_VERSION", "foreign_tables", "locks_comment", "migrate", "recorded_version"]

#: The version of the schema (tables, indexes, SQL functions) that this code's ``migrate()``
#: leaves. Bump it when ``ddl()`` or ``functions()`` change in a release: ``migrate()`` of an
#: older version then refuses the schema instead of putting back its own functions. 0 is a
#: schema that records none (made or last migrated by a release from before 1).
SCHEMA_VERSION = 1

_SCHEMA = re.compile(r'CREATE SCHEMA IF NOT EXISTS ("[^"]+")')
_INDEX = re.compile(r'CREATE INDEX IF NOT EXISTS ("[^"]+")')
_MADE = re.compile(r'CREATE (?:UNLOGGED )?(?:TABLE|SEQUENCE) IF NOT EXISTS ("[^"]+"\."[^"]+")')
_RECORDED = re.compile(r"; schema version (\d+)\Z")


def locks_comment(version: int = SCHEMA_VERSION) -> str:
    """The locks table's comment that records schema ``version``."""
    return f"{COMMENTS['locks']}; schema version {version}"


def recorded_version(conn: psycopg.Connection[Any], names: Names) -> int | None:
    """The schema version recorded in the store's schema: None without a locks table, 0 when
    it records none."""
    row = conn.execute(
        "-- schema_version: locks table | whether it exists, its comment\n"
        "SELECT to_regclass(%s) IS NOT NULL, obj_description(to_regclass(%s), 'pg_class')",
        (names.locks, names.locks),
    ).fetchone()
    if row is None or not row[0]:
        return None
    found = _RECORDED.search(row[1] or "")
    return 0 if found is None else int(found.group(1))


def migrate(config: Config) -> str:
    """Create what the schema lacks, idempotently, and record :data:`SCHEMA_VERSION`;
    concurrent callers take turns. Returns what it did: ``created`` (there was no locks
    table), ``upgraded from schema version N``, ``completed`` (parts were missing), or
    ``up to date``.

    Raises:
        ConfigurationError: a table of the store's name is another application's, or the
            schema records a newer schema version than this code's.
        BackendError: the server refused (its message, and for missing rights, who may).
    """
    statements = config.statements
    names = statements.names
    with config.connect("migrate", autocommit=False) as conn:
        try:
            with conn.transaction():
                conn.execute(f"SELECT pg_advisory_xact_lock({names.ddl_lock_key})")
                before = recorded_version(conn, names)
                _refuse_newer(config, before)
                row = conn.execute(statements.sequence_exists).fetchone()
                fresh = row is not None and not row[0]
                made = 0
                for statement in ddl(names):
                    if not _exists(conn, names.schema, statement):
                        conn.execute(statement)
                        made += statement.startswith("CREATE")  # not a comment
                foreign = foreign_tables(conn, names)
                if foreign:
                    raise ConfigurationError(
                        f"{'; '.join(foreign)}: another application's table, which migrate() "
                        "leaves alone: give the store a schema or table_prefix of its own "
                        f"[{mask_url(config.url)}]"
                    )
                for statement in functions(statements):
                    conn.execute(statement)
                conn.execute(f"COMMENT ON TABLE {names.locks} IS '{locks_comment()}'")
                if fresh:
                    # A sequence made now has handed out no fence that a crash could lose.
                    conn.execute(statements.mark_guard)
        except psycopg.Error as exc:
            raise translate(exc, "migrate", config.url) from exc
    if before is None:
        return "created"
    if before < SCHEMA_VERSION:
        return f"upgraded from schema version {before}"
    return "completed" if made else "up to date"


def _refuse_newer(config: Config, recorded: int | None) -> None:
    """Raise ``ConfigurationError`` when the schema is of a newer version than this code."""
    if recorded is None or recorded <= SCHEMA_VERSION:
        return
    names = config.statements.names
    raise ConfigurationError(
        f"schema {names.schema!r} (table_prefix {names.table_prefix!r}) is at schema version "
        f"{recorded}, made by a newer celery-dlock; this one knows schema version "
        f"{SCHEMA_VERSION} and would put back its own SQL functions: run migrate() of the "
        "newer version only, and upgrade this process (pip install -U celery-dlock); "
        f"nothing was changed [{mask_url(config.url)}]"
    )


_TABLE = re.compile(
    r'TABLE IF NOT EXISTS ("[^"]+"\."[^"]+") \((.*), '
    r'CONSTRAINT "[^"]+" PRIMARY KEY \(([^)]*)\)\)\Z',
    re.DOTALL,
)


def foreign_tables(conn: psycopg.Connection[Any], names: Names) -> list[str]:
    """The backend's tables that exist with another primary key than ``migrate()`` makes,
    each described (``CREATE TABLE IF NOT EXISTS`` passes them over)."""
    shapes = {}
    for statement in ddl(names):
        found = _TABLE.search(statement)
        if found is not None:
            table, columns, key = found.groups()
            shapes[table] = ([c.split(" ", 1)[0] for c in columns.split(", ")], key.split(", "))
    rows = conn.execute(
        "-- shapes: table names | (name, columns, primary key columns) of those that exist\n"
        "SELECT t.name, array(SELECT a.attname::text FROM pg_catalog.pg_attribute AS a "
        "WHERE a.attrelid = to_regclass(t.name) AND a.attnum > 0 AND NOT a.attisdropped "
        "ORDER BY a.attnum), array(SELECT a.attname::text FROM pg_catalog.pg_index AS i, "
        "unnest(i.indkey) WITH ORDINALITY AS k(num, place), pg_catalog.pg_attribute AS a "
        "WHERE i.indrelid = to_regclass(t.name) AND i.indisprimary "
        "AND a.attrelid = i.indrelid AND a.attnum = k.num ORDER BY k.place) "
        "FROM unnest(%s::text[]) AS t(name) WHERE to_regclass(t.name) IS NOT NULL",
        (list(shapes),),
    ).fetchall()
    foreign = []
    for table, columns, key in rows:
        wanted, wanted_key = shapes[table]
        # Another primary key: not a table of any version (those differ in columns,
        # which preparing the statements names).
        if key != wanted_key:
            foreign.append(
                f"table {table} has columns ({', '.join(columns)}) and primary key "
                f"({', '.join(key)}), not ({', '.join(wanted)}) and ({', '.join(wanted_key)})"
            )
    return foreign


def _exists(conn: psycopg.Connection[Any], schema: str, statement: str) -> bool:
    """Whether the schema, table, sequence or index that ``statement`` creates exists
    already (False for any other statement: it runs)."""
    made = _SCHEMA.match(statement)
    if made is not None:
        found = conn.execute("SELECT to_regnamespace(%s) IS NOT NULL", (made.group(1),))
        return found.fetchone() == (True,)
    table = _MADE.match(statement)
    if table is not None:
        found = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table.group(1),))
        return found.fetchone() == (True,)
    index = _INDEX.match(statement)
    if index is None:
        return False
    name = f'"{schema}".{index.group(1)}'
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone() == (True,)
