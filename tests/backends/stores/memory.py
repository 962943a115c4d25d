from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.testing import FakeClock
from tests.backends.storecase import StoreCase

NAME = "memory"
#: A URL of this kind whose store cannot be reached (or made), with a password where the
#: scheme has one: ``from_url`` must accept it without I/O (contract).
UNREACHABLE = None  # nothing to reach


@contextmanager
def open_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    yield StoreCase(backend=backend, url=None, clock=clock, second=lambda: backend)
