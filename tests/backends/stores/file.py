from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from celery_dlock.backends.file import FileBackend
from celery_dlock.testing import FakeClock
from tests.backends.storecase import StoreCase

NAME = "file"
#: A URL of this kind whose store cannot be reached (or made), with a password where the
#: scheme has one: ``from_url`` must accept it without I/O (contract).
UNREACHABLE = "file:///proc/dlock-cannot-be-made"


@contextmanager
def open_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    clock = FakeClock()
    directory = tmp_path / "locks"
    backend = FileBackend(str(directory), clock=clock)
    yield StoreCase(
        backend=backend,
        url=f"file://{directory}",
        clock=clock,
        second=lambda: FileBackend(str(directory), clock=clock),
    )
