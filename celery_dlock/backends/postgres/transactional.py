"""A statement run in the caller's own transaction, on the caller's own connection.

``record_success`` keeps a ``once`` success in the same transaction as the caller's writes
(a payment and its ledger row), so both commit or neither does. The caller may hold a
psycopg 3 or psycopg2 connection or cursor, or a SQLAlchemy ``Session`` or ``Connection``
on either driver; all of them take ``%(name)s`` parameters through a DB-API cursor, which
is what this module uses, and none of them is committed here.
"""

from __future__ import annotations

from typing import Any

from celery_dlock.errors import ConfigurationError

__all__ = ["execute"]

#: SQLSTATE of a missing table: the connection reaches another database or schema.
_UNDEFINED_TABLE = "42P01"


def execute(connection: Any, statement: str, params: dict[str, Any], tables: str) -> bool:
    """Run ``statement`` on ``connection`` without committing; whether it returned a row.
    ``tables`` says where the statement's tables are, for the error when they are missing.

    Raises:
        ConfigurationError: ``connection`` is of no known kind, or does not reach the
            backend's tables; the driver's other errors pass through unchanged (they are
            the caller's transaction's).
    """
    cursor, owned = _cursor(connection)
    try:
        cursor.execute(statement, params)
        return cursor.fetchone() is not None
    except Exception as exc:
        code = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
        if code == _UNDEFINED_TABLE:
            raise ConfigurationError(
                f"record_success: the connection does not reach {tables}; it must be a "
                "connection to the lock store's own database"
            ) from exc
        raise
    finally:
        if owned:
            cursor.close()


def _cursor(connection: Any) -> tuple[Any, bool]:
    """A DB-API cursor in ``connection``'s transaction, and whether we made it."""
    if type(connection).__module__.startswith("sqlalchemy"):
        if hasattr(connection, "get_bind"):  # a Session: its connection in its transaction
            connection = connection.connection()
        connection = connection.connection  # the pooled DB-API connection
    if hasattr(connection, "fetchone") and hasattr(connection, "execute"):
        return connection, False
    if not hasattr(connection, "cursor"):
        raise ConfigurationError(
            "record_success needs a psycopg or psycopg2 connection or cursor, or a SQLAlchemy "
            f"Session or Connection, not {type(connection).__name__}"
        )
    return connection.cursor(), True
