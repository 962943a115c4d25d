"""The Postgres store with ``liveness=ttl`` through a real PgBouncer in transaction pooling
mode (4 server connections): one fresh schema per test, as the session store's; leases
without a ttl get the URL's ``ttl`` (60 s)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.backends.storecase import StoreCase
from tests.backends.stores.postgres import schema_store
from tests.support.pgbouncer import pgbouncer_url

NAME = "postgres_ttl"
#: A URL of this kind whose store cannot be reached (or made), with a password where the
#: scheme has one: ``from_url`` must accept it without I/O (contract).
UNREACHABLE = "postgresql://nobody:s3cret@127.0.0.1:1/none?connect_timeout=2&liveness=ttl&ttl=60"


@contextmanager
def open_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    from celery_dlock.backends.postgres import PostgresTTLBackend

    with schema_store(pgbouncer_url(), liveness="ttl", ttl=60) as case:
        assert isinstance(case.backend, PostgresTTLBackend)
        yield case
