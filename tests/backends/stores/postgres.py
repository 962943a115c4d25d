"""The Postgres store of the contract suite: a real server, one fresh schema per test.

``DLOCK_POSTGRES_URL`` names the server (default ``postgresql://postgres@127.0.0.1:5432/test``);
each test gets a schema ``dlock_t_<random>``, made by ``migrate()`` and dropped afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.backends.storecase import StoreCase
from tests.support.services import POSTGRES_URL as SERVER_URL
from tests.support.services import drop_schema, with_options
from tests.support.services import postgres_admin as admin_connection

__all__ = [
    "NAME",
    "SERVER_URL",
    "admin_connection",
    "drop_schema",
    "open_store",
    "schema_store",
    "with_options",
]

NAME = "postgres"
#: A URL of this kind whose store cannot be reached (or made), with a password where the
#: scheme has one: ``from_url`` must accept it without I/O (contract).
UNREACHABLE = "postgresql://nobody:s3cret@127.0.0.1:1/none?connect_timeout=2"


@contextmanager
def open_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    with schema_store(SERVER_URL) as case:
        yield case


@contextmanager
def schema_store(server_url: str, **options: object) -> Iterator[StoreCase]:
    """A store on a fresh schema of ``server_url`` (with ``options``), migrated, dropped
    afterwards."""
    from celery_dlock.backends.postgres import PostgresBackend

    admin = admin_connection()
    schema = f"dlock_t_{os.urandom(6).hex()}"
    url = with_options(server_url, schema=schema, **options)
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
