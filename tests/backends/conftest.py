"""The ``backend`` fixture of the contract suite, parametrised over every store.

A store is a module in ``stores/`` with ``NAME`` and a context manager
``open_store(tmp_path, request) -> StoreCase``. Adding a backend to the suite is adding one
such module; a store whose server is missing calls ``tests.support.unavailable``.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_dlock.backends.base import LockBackend
from tests.backends import stores as store_modules
from tests.backends.storecase import StoreCase


def _load_stores() -> dict[str, ModuleType]:
    stores = {}
    for found in pkgutil.iter_modules(store_modules.__path__):
        if found.name.startswith("_"):
            continue
        module = importlib.import_module(f"{store_modules.__name__}.{found.name}")
        stores[module.NAME] = module
    return stores


STORES = _load_stores()


@pytest.fixture(params=sorted(STORES))
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
