"""The two definitions of the Postgres schema agree: what ``migrate()`` creates is what the
SQLAlchemy ``MetaData`` of ``celery_dlock.backends.postgres.schema`` creates, compared in the
server's catalog (columns, types, collations, nullability, defaults, keys, indexes, table
persistence, comments and the fence sequence)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.backends.stores.postgres import SERVER_URL, admin_connection, drop_schema, with_options

pytest.importorskip("psycopg")
sqlalchemy = pytest.importorskip("sqlalchemy")

from celery_dlock.backends.postgres import PostgresBackend  # noqa: E402
from celery_dlock.backends.postgres.schema import metadata  # noqa: E402


def catalog(admin: Any, schema: str) -> dict[str, Any]:
    """Everything about ``schema``'s objects that a migration decides, schema name removed."""

    def rows(query: str) -> list[tuple[Any, ...]]:
        found = admin.execute(query, {"schema": schema}).fetchall()
        return sorted(tuple(str(v).replace(f"{schema}.", "<schema>.") for v in r) for r in found)

    return {
        "relations": rows(
            "SELECT c.relname, c.relkind, c.relpersistence, obj_description(c.oid, 'pg_class') "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %(schema)s"
        ),
        "columns": rows(
            "SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), "
            "a.attnotnull, coalesce(co.collname, ''), pg_get_expr(d.adbin, d.adrelid) "
            "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "LEFT JOIN pg_collation co ON co.oid = a.attcollation AND co.collname <> 'default' "
            "LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
            "WHERE n.nspname = %(schema)s AND c.relkind = 'r' AND a.attnum > 0 "
            "AND NOT a.attisdropped"
        ),
        "constraints": rows(
            "SELECT conname, contype, pg_get_constraintdef(co.oid) FROM pg_constraint co "
            "JOIN pg_namespace n ON n.oid = co.connamespace WHERE n.nspname = %(schema)s"
        ),
        "indexes": rows("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %(schema)s"),
        "sequences": rows(
            "SELECT sequencename, data_type, start_value, min_value, max_value, "
            "increment_by, cycle, cache_size FROM pg_sequences WHERE schemaname = %(schema)s"
        ),
    }


@pytest.fixture
def two_schemas() -> Iterator[tuple[Any, str, str]]:
    admin = admin_connection()
    by_migrate = f"dlock_m_{os.urandom(6).hex()}"
    by_metadata = f"dlock_a_{os.urandom(6).hex()}"
    yield admin, by_migrate, by_metadata
    for schema in (by_migrate, by_metadata):
        drop_schema(admin, schema)
    admin.close()


@pytest.mark.parametrize("table_prefix", ["", "app_"])
def test_migrate_creates_what_the_metadata_declares(
    two_schemas: tuple[Any, str, str], table_prefix: str
) -> None:
    admin, by_migrate, by_metadata = two_schemas
    backend = PostgresBackend.from_url(
        with_options(SERVER_URL, schema=by_migrate, table_prefix=table_prefix)
    )
    backend.migrate()
    backend.migrate()  # idempotent: changes nothing
    backend.close()

    admin.execute(f'CREATE SCHEMA "{by_metadata}"')
    engine = sqlalchemy.create_engine(SERVER_URL.replace("postgresql://", "postgresql+psycopg://"))
    try:
        metadata(schema=by_metadata, table_prefix=table_prefix).create_all(engine)
    finally:
        engine.dispose()

    migrated = catalog(admin, by_migrate)
    assert migrated == catalog(admin, by_metadata)
    relations = {row[0]: row for row in migrated["relations"]}
    p = table_prefix
    assert relations[f"{p}locks"][2] == "u" and relations[f"{p}fence_guard"][2] == "u"
    assert relations[f"{p}history"][2] == "p" and relations[f"{p}successes"][2] == "p"
    assert len(migrated["indexes"]) == 6  # 4 primary keys, 2 more on history


def test_tables_made_by_the_metadata_work_with_the_backend(
    two_schemas: tuple[Any, str, str],
) -> None:
    admin, _, schema = two_schemas
    admin.execute(f'CREATE SCHEMA "{schema}"')
    engine = sqlalchemy.create_engine(SERVER_URL.replace("postgresql://", "postgresql+psycopg://"))
    try:
        metadata(schema=schema).create_all(engine)
    finally:
        engine.dispose()
    from celery_dlock import Holder, Outcome

    backend = PostgresBackend.from_url(with_options(SERVER_URL, schema=schema))
    try:
        lease = backend.try_acquire("job:alembic", Holder.current(), None)
        assert lease is not None
        assert backend.release(lease, Outcome.SUCCEEDED) is not None
    finally:
        backend.close()


def test_metadata_refuses_names_that_are_not_plain_identifiers() -> None:
    with pytest.raises(ValueError, match="schema"):
        metadata(schema="Drop Table")
