"""The ``backend`` fixture of the contract suite, parametrised over every store.

A store is a module in ``stores/`` with ``NAME`` and a context manager
``open_store(tmp_path, request) -> StoreCase``. Adding a backend to the suite is adding one
such module; a store whose server is missing calls ``dlock_support.unavailable``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from storecase import StoreCase

from celery_dlock.backends.base import LockBackend


def _load_stores() -> dict[str, ModuleType]:
    stores = {}
    for path in sorted((Path(__file__).parent / "stores").glob("*.py")):
        if path.name.startswith("_"):
            continue
        spec = importlib.util.spec_from_file_location(f"dlock_store_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
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
