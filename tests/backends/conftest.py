"""The ``backend`` fixture of the contract suite, parametrised over every store.

A store is a module in ``stores/`` with ``NAME`` and a context manager
``open_store(tmp_path, request) -> StoreCase``. Adding a backend to the suite is adding one
such module; a store whose server is missing calls ``tests.support.unavailable``.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import pkgutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_dlock.backends.base import LockBackend
from tests.backends import stores as store_modules
from tests.backends.storecase import StoreCase
from tests.support.redis_cluster import Cluster, start_cluster


def _load_stores() -> dict[str, ModuleType]:
    stores = {}
    for found in pkgutil.iter_modules(store_modules.__path__):
        if found.name.startswith("_"):
            continue
        module = importlib.import_module(f"{store_modules.__name__}.{found.name}")
        stores[module.NAME] = module
    return stores


STORES = _load_stores()
#: The stores the contract suite runs on: every one, S3 on SeaweedFS (a real S3
#: implementation) and not also on moto's mock, which the tests beyond the contract and the
#: race tests use (``tests/support/objectstore_servers.py``). Moto's twin of each contract
#: test cost about a tenth of a CI run on a 2-core machine. A test may still ask for any
#: store by name (``indirect`` parametrisation).
CONTRACT = sorted(name for name in STORES if name != "s3")


@pytest.fixture(params=CONTRACT)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreCase]:
    with STORES[request.param].open_store(tmp_path, request) as case:
        try:
            yield case
        finally:
            case.backend.close()


@pytest.fixture
def backend(store: StoreCase) -> LockBackend:
    return store.backend


@pytest.fixture
def admin() -> Iterator[Any]:
    """A connection to the Postgres server of the tests, as its superuser."""
    from tests.backends.stores.postgres import admin_connection

    conn = admin_connection()
    yield conn
    conn.close()


@pytest.fixture
def schema(admin: Any) -> Iterator[str]:
    """A fresh Postgres schema name, dropped afterwards."""
    from tests.backends.stores.postgres import drop_schema

    name = f"dlock_t_{os.urandom(6).hex()}"
    yield name
    drop_schema(admin, name)


@pytest.fixture(params=["file", "memory", "postgres", "redis"])
def lock_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A backend of each store the lock tests outside this directory run on (file, memory,
    Postgres, Redis); a test module takes it as its own ``backend``."""
    with STORES[request.param].open_store(tmp_path, request) as case:
        try:
            yield case.backend
        finally:
            case.backend.close()


@pytest.fixture
def backends(schema: str) -> Iterator[Callable[..., Any]]:
    """Makes Postgres backends on ``schema`` (migrated once), each a client of its own,
    closed at the end: ``backends()``, or ``backends(other_url, **options)``."""
    from celery_dlock.backends.postgres import PostgresBackend
    from tests.backends.stores.postgres import SERVER_URL, with_options

    url = with_options(SERVER_URL, schema=schema)
    made: list[PostgresBackend] = []

    def make(target: str | None = None, **options: Any) -> PostgresBackend:
        backend = PostgresBackend.from_url(target or url, **options)
        if not made:
            backend.migrate()
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def postgres_backend(schema: str) -> Iterator[Any]:
    """A Postgres backend on ``schema``, migrated by this code, closed afterwards."""
    from celery_dlock.backends.postgres import PostgresBackend
    from tests.backends.stores.postgres import SERVER_URL, with_options

    backend = PostgresBackend.from_url(with_options(SERVER_URL, schema=schema))
    try:
        backend.migrate()
        yield backend
    finally:
        backend.close()


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for a test's asyncio calls: its connections claim the layout once."""
    running = asyncio.new_event_loop()
    yield running
    running.run_until_complete(running.shutdown_asyncgens())
    running.close()


@pytest.fixture
def private_cluster() -> Iterator[Cluster]:
    """A Redis Cluster of the test's own (six nodes), for tests that kill or cut its nodes."""
    cluster = start_cluster()
    yield cluster
    cluster.stop()
