"""The Postgres backend's tables as SQLAlchemy Core ``MetaData``, for your own migrations.

``PostgresBackend.migrate()`` creates the same objects with plain SQL (a test checks that the
two agree), so Alembic is optional. To manage the tables with Alembic instead::

    # env.py
    from celery_dlock.backends.postgres.schema import metadata as dlock_metadata

    target_metadata = [my_app.metadata, dlock_metadata(schema="dlock")]
    # and context.configure(..., include_schemas=True)

Autogenerate emits the schema, sequence, tables and indexes; add ``CREATE SCHEMA`` if the
schema is new. The tables created this way behave as after ``migrate()``, but for two things:
the first session finds the fence guard empty, as after a crash, and moves the fence sequence
up by ``FENCE_GAP`` (10**9) before its first grant, so fences start above a billion (they
only have to rise); and the SQL functions for SQL clients are ``migrate()``'s alone (the
doctor notes their absence; ``migrate()`` adds them and changes nothing else here). The locks
table's comment records the schema version, as ``migrate()`` does: after an upgrade, let
autogenerate emit its change with the others, or the doctor reports the schema as older.

Importing this module needs SQLAlchemy (the backend itself does not).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    Table,
    Text,
)
from sqlalchemy.dialects.postgresql import JSON

from celery_dlock.backends.postgres.migration import locks_comment
from celery_dlock.backends.postgres.sql import COMMENTS, FENCE_START, validate_names

__all__ = ["metadata"]


def _record_columns() -> list[Column[object]]:
    """The columns of a history record after ``key`` (and ``task_name``)."""
    return [
        Column("token", Text, nullable=False),
        Column("fence", BigInteger, nullable=False),
        Column("holder", JSON, nullable=False),
        Column("acquired_at", DateTime(timezone=True), nullable=False),
        Column("expires_at", DateTime(timezone=True), nullable=True),
        Column("released_at", DateTime(timezone=True), nullable=False),
        Column("outcome", Text, nullable=False),
        Column("problem", Text, nullable=True),
        Column("details", Text, nullable=True),
        Column("result", JSON, nullable=True),
    ]


def metadata(schema: str = "dlock", table_prefix: str = "") -> MetaData:
    """The backend's sequence, tables and indexes in ``schema``, names prefixed.

    Args:
        schema: the schema of the backend's URL (``?schema=``), default ``dlock``.
        table_prefix: the URL's ``table_prefix``, default empty.

    Raises:
        ValueError: the names are not plain lower-case identifiers.
    """
    validate_names(schema, table_prefix)
    p = table_prefix
    meta = MetaData(schema=schema)
    Sequence(f"{p}fence", start=FENCE_START, increment=1, cache=1, cycle=False, metadata=meta)
    Table(
        f"{p}locks",
        meta,
        Column("key", Text(collation="C"), nullable=False),
        Column("token", Text, nullable=False),
        Column("fence", BigInteger, nullable=False),
        Column("holder", JSON, nullable=False),
        Column("acquired_at", DateTime(timezone=True), nullable=False),
        Column("expires_at", DateTime(timezone=True), nullable=True),
        Column("backend_pid", Integer, nullable=False),
        PrimaryKeyConstraint("key", name=f"{p}locks_pkey"),
        prefixes=["UNLOGGED"],
        comment=locks_comment(),
    )
    history = Table(
        f"{p}history",
        meta,
        Column("key", Text(collation="C"), nullable=False),
        *_record_columns(),
        PrimaryKeyConstraint("key", "released_at", "token", name=f"{p}history_pkey"),
        comment=COMMENTS["history"],
    )
    Index(
        f"{p}history_outcome_released_at",
        history.c.outcome,
        history.c.released_at,
        postgresql_where=history.c.outcome != "succeeded",
    )
    Index(f"{p}history_released_at", history.c.released_at)
    Table(
        f"{p}successes",
        meta,
        Column("key", Text(collation="C"), nullable=False),
        Column("task_name", Text, nullable=False),
        *_record_columns(),
        PrimaryKeyConstraint("key", "task_name", name=f"{p}successes_pkey"),
        comment=COMMENTS["successes"],
    )
    Table(
        f"{p}fence_guard",
        meta,
        Column("id", Integer, nullable=False, autoincrement=False),
        Column("marked_at", DateTime(timezone=True), nullable=False),
        PrimaryKeyConstraint("id", name=f"{p}fence_guard_pkey"),
        prefixes=["UNLOGGED"],
        comment=COMMENTS["fence_guard"],
    )
    return meta
