"""The Postgres store of the contract suite: a real server, one fresh schema per test.

``DLOCK_POSTGRES_URL`` names the server (default ``postgresql://postgres@127.0.0.1:5432/test``);
each test gets a schema ``dlock_t_<random>``, made by ``migrate()`` and dropped afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from dlock_support import unavailable
from storecase import StoreCase

NAME = "postgres"
SERVER_URL = os.environ.get("DLOCK_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def with_options(url: str, **options: Any) -> str:
    """``url`` with query options added."""
    query = "&".join(f"{name}={value}" for name, value in options.items())
    return f"{url}{'&' if '?' in url else '?'}{query}"


def admin_connection() -> Any:
    """An autocommit connection to the test server, or a visible skip if there is none."""
    try:
        import psycopg
    except ImportError:
        unavailable("psycopg is not installed: pip install 'celery-dlock[postgres]'")
    try:
        return psycopg.connect(SERVER_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        unavailable(f"PostgreSQL is not reachable at {SERVER_URL}: {exc}".strip())


def drop_schema(admin: Any, schema: str) -> None:
    admin.execute("SET lock_timeout = '20s'")
    admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@contextmanager
def open_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    from celery_dlock.backends.postgres import PostgresBackend

    admin = admin_connection()
    schema = f"dlock_t_{os.urandom(6).hex()}"
    url = with_options(SERVER_URL, schema=schema)
    backend = PostgresBackend.from_url(url)
    others: list[PostgresBackend] = []

    def second() -> PostgresBackend:
        other = PostgresBackend.from_url(url)
        others.append(other)
        return other

    try:
        backend.migrate()
        yield StoreCase(backend=backend, url=url, clock=None, second=second)
    finally:
        for other in others:
            other.close()
        backend.close()
        drop_schema(admin, schema)
        admin.close()
